"""lowmem's fairseq plugin: ``fairseq-train --user-dir <this folder> --task lowmem_translation --arch
lowmem_lightconv_iwslt_de_en``. The code is ``lowmem.dynamicconv.plugin``; importing it registers the model, its
architecture and the task."""

import lowmem.dynamicconv.plugin  # noqa: F401
