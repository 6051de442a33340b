"""Measured peak memory of one training step, as PyTorch itself observes it.

- CUDA: the caching allocator's own counter, ``torch.cuda.max_memory_allocated``.
- CPU: PyTorch has no allocator counter for the CPU, so the profiler's memory tracking stands in for one
  (``torch.profiler.profile(profile_memory=True)``). It reports each allocation and free made during the step by
  the CPU allocator, op-internal workspace included; the peak is the bytes live when the step starts (its
  parameters, buffers, optimizer state and batch) plus the highest running sum of those events.

The accountant (``lowmem.accounting``) is compared against this number.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lowmem.accounting import StepFn, optimizer_tensors


def _noop(_: str) -> None:
    pass


def _live_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


def measure_step(
    step: StepFn, model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Iterable[torch.Tensor] = (), warmup: bool = True
) -> tuple[int, str]:
    """Runs ``step`` and returns (peak bytes, how they were measured). Runs one warm-up step first, like the accountant."""
    inputs = list(inputs)
    device = next(model.parameters()).device
    if warmup:
        step(_noop)
    # Free last step's gradients now: a block allocated before profiling starts has no size in the profiler's events.
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(_noop)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    if device.type != "cpu":
        raise ValueError(f"measuring is supported on cpu and cuda, not {device.type}; account on 'meta' instead")
    names = {p: n for n, p in model.named_parameters()}
    live = [*model.parameters(), *model.buffers(), *(t for _, t in optimizer_tensors(optimizer, names)), *inputs]
    base = _live_bytes(live)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(_noop)
    # The per-allocation events are only exposed on the raw results; the public EventList keeps a summary per op.
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    running = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return base + peak, "torch.profiler (CPU allocator events)"
