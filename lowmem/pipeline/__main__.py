"""``python -m lowmem.pipeline COMMAND ...``: lowmem.pipeline.commands."""

import sys

from lowmem.pipeline.commands import main

sys.exit(main())
