"""Measured peak memory of one training step, as PyTorch itself observes it.

- CUDA: the caching allocator's own counter, ``torch.cuda.max_memory_allocated``.
- CPU: PyTorch has no allocator counter for the CPU, so the profiler's memory tracking stands in for one
  (``torch.profiler.profile(profile_memory=True)``). It reports each allocation and free made during the step by
  the CPU allocator, op-internal workspace included; the peak is the bytes live when the step starts (its
  parameters, buffers, optimizer state and batch) plus the highest running sum of those events.

The accountant (``lowmem.memory.accounting``) is compared against this number.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_leaves, tree_map

from lowmem.memory.accounting import StepFn, optimizer_tensors

# kineto, the profiler's backend, logs a USDT line at every profiler start and stop, and on a CUDA build without a
# GPU an ERROR that gpuGetDeviceCount failed. We start a profiler per op signature, so that is hundreds of lines of
# noise, and the ERROR reads as a failure. Level 6 (past kineto's last level) silences its log. kineto reads the
# variable when a profiler first starts, so setting it on import is in time; a user who wants the log sets it.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


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
    return base + _peak_of(prof), "torch.profiler (CPU allocator events)"


class CPUWorkspace:
    """The internal workspace of each op on the CPU, measured once per call signature.

    Some CPU kernels allocate scratch memory that no tensor holds (oneDNN's convolution backward reorders its
    operands, about twice the input's size), invisible to the accountant but part of the real peak. This runs each
    distinct op once on random CPU tensors of the same shapes under the profiler and takes its peak beyond its
    outputs. Pass it as ``workspace=`` to ``lowmem.memory.accounting.account_step``; the model itself may live on meta.
    """

    DEVICE = "cpu"  # where the ops run on real tensors

    def __init__(self) -> None:
        self.cache: dict[Any, int] = {}

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> int:
        key = (func, *(self._sig(a) for a in tree_leaves((args, kwargs))))
        if key not in self.cache:
            self.cache[key] = self._measure(func, args, kwargs)
        return self.cache[key]

    @staticmethod
    def _sig(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), tuple(a.stride()), a.dtype)
        return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else type(a).__name__

    @classmethod
    def _real(cls, a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        # A base buffer viewed with the same strides: expanded (stride-0) inputs stay expanded.
        span = 1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride()) if n > 0) if a.numel() else 0
        base = torch.empty(span, dtype=a.dtype, device=cls.DEVICE)
        base = base.normal_() if base.is_floating_point() else base.zero_()
        return base.as_strided(a.shape, a.stride())

    # Ops that random inputs must not drive: oneDNN's recurrent backward reads the forward's opaque workspace, and
    # a random one crashes the process (seen with nn.LSTM); a collective run again by one rank alone would pair with
    # the other ranks' next one (GlooWorkspace counts a collective's buffer). Their workspace is taken as none here.
    UNSAFE = ("mkldnn_rnn_layer_backward", "c10d.")

    def _measure(self, func: Any, args: tuple, kwargs: dict) -> int:
        if any(name in str(func) for name in self.UNSAFE):
            return 0
        # Calibrating must not move the step's RNG, and runs on real tensors even where the step is accounted on
        # fake ones (lowmem.cli.profile), whose mode would make these fake too.
        with torch.random.fork_rng(devices=[]), unset_fake_temporarily():
            real_args, real_kwargs = tree_map(self._real, (args, kwargs))
            try:
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    out = func(*real_args, **real_kwargs)
            except Exception:  # an op that random inputs cannot drive (e.g. needs valid indices): assume none
                return 0
        outputs = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        inputs = {id(t.untyped_storage()) for t in tree_leaves((real_args, real_kwargs)) if isinstance(t, torch.Tensor)}
        fresh = sum(b for k, b in outputs.items() if k not in inputs)  # in-place and view outputs hold no new bytes
        return max(0, _peak_of(prof) - fresh)


def _peak_of(prof: profile) -> int:
    """Highest running sum of the CPU allocator's events in a profile."""
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
    return peak


class GlooWorkspace:
    """The flat buffer gloo allocates inside a collective on CPU tensors: an all-gather into one tensor gathers into
    a temporary the size of its output, and a reduce-scatter from one tensor reduces a temporary the size of its
    input, both through PyTorch's CPU allocator (tests/test_sharding.py measures them on two gloo processes). NCCL
    on a GPU works in place, so this belongs to the CPU runs only: add it to the account when comparing with them.
    The accountant sees the collectives as ops with a fake process group (``lowmem.techniques.sharding``)."""

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> int:
        if func is torch.ops.c10d._allgather_base_.default:
            return args[0].untyped_storage().nbytes()
        if func is torch.ops.c10d._reduce_scatter_base_.default:
            return args[1].untyped_storage().nbytes()
        return 0


def workspaces(*parts: Any) -> Any:
    """One workspace that adds up several (``CPUWorkspace()`` and ``GlooWorkspace()`` for a gloo run)."""
    return lambda func, args, kwargs: sum(w(func, args, kwargs) for w in parts)
