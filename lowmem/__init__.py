"""lowmem: how much memory training a neural network needs, and what each way of cutting it costs."""
