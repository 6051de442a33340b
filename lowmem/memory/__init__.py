"""The accountant (bottom layer): where the bytes of one training step go, accounted on the meta device at full
size, and measured as PyTorch itself sees them. Imports nothing else of lowmem."""
