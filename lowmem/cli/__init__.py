"""``lowmem profile`` and ``lowmem plan``: the accountant and the levers for anyone's model (``lowmem.cli.main``)."""
