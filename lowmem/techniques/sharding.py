"""Sharded data-parallel training: the lever people reach for first when a model outgrows one device, beyond
Sohoni et al. (2019), whose study is of one device.

N devices each step on 1/N of the global batch, so each device's activations shrink by N. What each device keeps of
the rest depends on the mode (``MODES``), all run by PyTorch's own wrappers, none hand-written:

- ``replicate``: ``DistributedDataParallel``. Every device keeps the whole model, gradients and optimizer state,
  plus DDP's flat gradient buckets (the size of the gradients, kept for the whole run).
- ``optimizer`` (ZeRO-1): DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer``, which gives each device the
  optimizer state of a partition of the parameters and broadcasts the updated parameters after the step.
- ``gradients`` (ZeRO-2): FSDP2 (``torch.distributed.fsdp.fully_shard``) with ``reshard_after_forward=False``,
  PyTorch's counterpart of ZeRO-2 (FSDP1's ``SHARD_GRAD_OP``): gradients and optimizer state are sharded, and the
  weights gathered in forward stay until backward ends (between steps they are sharded too).
- ``full`` (ZeRO-3): FSDP2 with ``reshard_after_forward=True``: each unit's weights are gathered before its
  forward and again before its backward, and freed after each.

FSDP2's units are the blocks of the model's chains (``units``) plus the model itself, as PyTorch's examples wrap a
transformer's layers: the gathered weights of one unit (and of the next one, prefetched) exist at a time.

Per-device accounting needs no processes: ``fake_group`` stands up PyTorch's fake process group (its collectives
return at once, without data), and the accountant follows FSDP2's real code on tensors without values. DDP's
reducer is C++ that reads tensor data, which such tensors have not, so for the two DDP modes the model is not
wrapped and its gradient buckets are held as tensors of their size instead (``held_buckets``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.weak import WeakIdKeyDictionary

from lowmem.memory.accounting import gradient_ready, resizable

MODES = {
    "replicate": "DDP: everything replicated",
    "optimizer": "ZeRO-1: optimizer state sharded (DDP + ZeroRedundancyOptimizer)",
    "gradients": "ZeRO-2: + gradients sharded (FSDP2, reshard_after_forward=False)",
    "full": "ZeRO-3: + weights sharded (FSDP2, reshard_after_forward=True)",
}
FSDP_MODES = ("gradients", "full")

LEVER = dict(  # lowmem.techniques.registry
    name="sharding",
    what="the batch split over N devices, each keeping the model state its mode does not shard (DDP, ZeRO-1, FSDP2)",
    settings=tuple(MODES),
    field="",
    short="",
    wrn="studies.shard_run: WRN under torchrun on gloo, each mode by PyTorch's own wrapper (notebook 13)",
    fairseq="not applied: fairseq's own --ddp-backend and --zero-sharding would need several processes per run here",
    any_model="lowmem profile/plan --devices N --shard MODE, accounted per device on PyTorch's fake process group",
    accounted="per device: its share of the batch, and of the weights, gradients and state its mode shards",
    exact="exact up to summation order",
    proof="tests/test_notebook_metrics.py::test_13_sharding_reports_per_device_peaks_that_fall_with_devices_and_a_step_equal_to_one_process",
    quality="",
)


@dataclass(frozen=True)
class Sharding:
    """How many devices a step runs on, and what they shard. ``devices=1`` is the single-device step, unwrapped."""

    devices: int = 1  # data-parallel devices; the global batch is split evenly among them
    mode: str = "replicate"  # one of MODES

    def __post_init__(self) -> None:
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise ValueError(f"devices must be an integer >= 1, got {self.devices!r}")
        if self.mode not in MODES:
            raise ValueError(f"sharding mode {self.mode!r} is not one of {', '.join(MODES)}")

    @property
    def active(self) -> bool:
        return self.devices > 1

    def per_device(self, batch: int) -> int:
        """Examples each device steps on; the global batch must split evenly."""
        if batch % self.devices:
            raise ValueError(f"a batch of {batch} does not split evenly over {self.devices} devices; use a multiple of {self.devices}")
        return batch // self.devices


def check(model: nn.Module, sharding: Sharding) -> None:
    """Refuses, before any process starts, what the wrappers would fail on later."""
    if not sharding.active:
        return
    if not dist.is_available():
        raise ValueError("this PyTorch has no torch.distributed; sharding needs it")
    if any(p.layout != torch.strided for p in model.parameters()):
        raise ValueError("sharding needs dense parameters; this model has sparse ones (use sparsity=0 with sharding)")
    if sharding.mode in FSDP_MODES and any(hasattr(m, "mask") for m in model.modules()):
        # lowmem.techniques.sparsity keeps a dense mask per weight and rewrites the weights in place; FSDP2 replaces
        # the weights with shards, which the masks would no longer match.
        raise ValueError(f"sharding mode {sharding.mode!r} cannot shard a model with sparsity masks; use 'replicate' or 'optimizer'")


def units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: the children of each outermost ``nn.Sequential`` or ``nn.ModuleList``
    of at least two children that all hold parameters (WRN's blocks, a ResNet's bottlenecks, a transformer's
    layers). The root is wrapped last, around what is left."""
    found: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if isinstance(child, (nn.Sequential, nn.ModuleList)) and len(child) >= 2 and \
                    all(any(True for _ in c.parameters()) for c in child):
                found.extend(child)
            else:
                visit(child)

    visit(model)
    return found


_hooked = WeakIdKeyDictionary()  # gathered weights whose gradients are reported (by identity: tensors compare by value)


def _track_unsharded(module: nn.Module, args: Any) -> None:
    # Called after FSDP2's own pre-forward hook: the module's parameters are now the gathered ones. Their gradients
    # are the unsharded gradients FSDP2 reduce-scatters and drops; reported, they count as gradients, not temporaries.
    from torch.distributed.tensor import DTensor

    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            resizable(p, "weight-copy", name)
            if p.requires_grad and p not in _hooked:
                p.register_post_accumulate_grad_hook(gradient_ready)
                _hooked[p] = True


def wrap(model: nn.Module, sharding: Sharding, accounting: bool = False) -> nn.Module:
    """``model`` wrapped for ``sharding`` on the default process group (``dist.init_process_group``, or
    ``fake_group``). With ``accounting`` the DDP modes leave the model unwrapped (see the module docstring; pass
    ``held_buckets(model)`` to the accountant instead), and FSDP2's gathered weights are reported to it."""
    check(model, sharding)
    if not sharding.active:
        return model
    if sharding.mode in FSDP_MODES:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        device = next(model.parameters()).device.type
        with unset_fake_temporarily():  # the mesh holds real rank ids, which a fake tensor would lose
            mesh = init_device_mesh(device, (sharding.devices,))
        reshard = sharding.mode == "full"
        for unit in [*units(model), model]:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
            if accounting:
                # The gathered weights are the same tensors in every step, forward and backward: watched once
                # seen, they are followed through each free and refill (lowmem.memory.accounting.resizable).
                unit.register_forward_pre_hook(_track_unsharded)
        return model
    if accounting:
        return model
    return nn.parallel.DistributedDataParallel(model)


def held_buckets(model: nn.Module, sharding: Sharding) -> list[tuple[str, torch.Tensor]]:
    """DDP's gradient buckets as tensors of their size, for the accountant (``account_step(held=...)``): one flat
    buffer per dtype holding every gradient, which DDP keeps from construction on (its bucket size cap only splits
    them). None for the FSDP2 modes or one device."""
    if not sharding.active or sharding.mode in FSDP_MODES:
        return []
    numel: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            numel[p.dtype] = numel.get(p.dtype, 0) + p.numel()
    device = next(model.parameters()).device
    return [("bucket", torch.empty(n, dtype=dtype, device=device)) for dtype, n in numel.items()]


def optimizer(model: nn.Module, sharding: Sharding, make: Callable[..., torch.optim.Optimizer], accounting: bool = False,
              **kwargs: Any) -> torch.optim.Optimizer:
    """``make(model.parameters(), **kwargs)`` (an optimizer class, or any callable of the same signature), sharded
    by ``ZeroRedundancyOptimizer`` in the ``optimizer`` mode. With ``accounting`` its ``state`` is its local
    optimizer's, the state this device keeps, which is what the accountant reads (ZeroRedundancyOptimizer's own
    ``state`` stays empty)."""
    if sharding.active and sharding.mode == "optimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=make, **kwargs)
        if accounting:
            zero.state = zero.optim.state
        return zero
    return make(model.parameters(), **kwargs)


@contextmanager
def fake_group(devices: int) -> Iterator[None]:
    """PyTorch's fake process group of ``devices`` ranks, this process rank 0, as the default group: collectives
    return at once and move no data, so a sharded step can be accounted without processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized; account sharding in a process without one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=devices)
    try:
        yield
    finally:
        dist.destroy_process_group()


def traffic_bytes(param_bytes: int, sharding: Sharding) -> int:
    """Bytes each device sends (and receives) per step with ring collectives (Rajbhandari et al. 2020, ZeRO, Sec. 7):
    an all-reduce moves 2(N-1)/N of the data, an all-gather or reduce-scatter (N-1)/N.
    - replicate: all-reduce of the gradients;
    - optimizer: as PyTorch runs it (DDP + ZeroRedundancyOptimizer), the same all-reduce plus the updated
      parameters broadcast from their owners, (N-1)/N; ZeRO-1 proper, reduce-scatter then all-gather, moves 2(N-1)/N;
    - gradients: weights all-gathered once, gradients reduce-scattered;
    - full: weights all-gathered twice (forward, backward), gradients reduce-scattered."""
    n = sharding.devices
    if n == 1:
        return 0
    passes = {"replicate": 2, "optimizer": 3, "gradients": 2, "full": 3}[sharding.mode]
    return passes * (n - 1) * param_bytes // n

