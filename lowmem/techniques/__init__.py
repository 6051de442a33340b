"""The paper's four memory levers, each one module (precision, microbatch, checkpoint, sparsity with its sparse
layers), and the training step that applies them (``step``). Model-agnostic: imports only ``lowmem.memory``."""
