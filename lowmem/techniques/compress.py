"""Compressed activations: what autograd saves for backward is stored in 2, 4, 8 or 16 bits instead of 32.

A lever beyond Sohoni et al. (2019), after ActNN (Chen et al., "ActNN: Reducing Training Memory Footprint via
2-Bit Activation Compressed Training", ICML 2021). The forward pass is unchanged (its outputs, and so BatchNorm's
statistics, are the plain ones); only the copies kept for the backward pass are lossy, so the gradients are those
of the plain step computed from dequantized activations.

- 2, 4, 8 bits: each saved activation is cut into groups of ``GROUP`` consecutive elements; a group keeps its
  minimum and its step ((max - min) / (2^bits - 1)), both fp32, and each element the nearest of the 2^bits levels,
  bit-packed into uint8. An element comes back within half a step of its value (``error_bound``).
- 16 bits: the activation is kept in bf16 (an fp32 value comes back within 2^-9 of its magnitude).

Why hand-written: ActNN and GACT need CUDA and are not in the package registries, and torchao's quantizers work on
weights, not on autograd's saved tensors. PyTorch's documented mechanism for this is
``torch.autograd.graph.saved_tensors_hooks``, used here. Two choices differ from ActNN: rounding is to nearest, not
stochastic (a training run stays deterministic and resumable without an RNG of its own), and groups run over the
flattened tensor, not per sample.

What is packed: floating activations whose packed form is smaller. Weights are not (a parameter, a view of it or
autocast's 16-bit copy of it: they are alive anyway, and rounding them would change the model), nor the batch (it is
alive anyway), nor integer tensors (pooling indices, masks). A tensor saved by two ops (a ReLU's output, saved by the
ReLU and by the next convolution) is packed once. Checkpointing composes: the segment inputs that
``torch.utils.checkpoint`` keeps are saved through these hooks and packed, while tensors recomputed inside a segment
are kept by checkpoint's own hooks.

The accountant (``lowmem.memory.accounting``) finds saved tensors through its own ``saved_tensors_hooks``, but only
the innermost pair of hooks runs; so the pack hook reports what it keeps to the accountant (``accounting.saved``):
the packed bytes are counted as activations, and the full-precision tensor they came from, freed as in the plain
step once nothing else holds it, is not.
"""

from __future__ import annotations

import math
import weakref
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lowmem.memory.accounting import saved

BITS = (2, 4, 8, 16)  # what activation_bits may be, besides 0 (off)

LEVER = dict(  # lowmem.techniques.registry
    name="activation-bits",
    what="each saved activation packed to a few bits per element in groups with their own range, unpacked in backward",
    settings=(0, *BITS),
    field="activation_bits",
    short="activations-BITS",
    wrn="Techniques(activation_bits=B): torch.autograd.graph.saved_tensors_hooks around the forward",
    fairseq="the plugin's --activation-bits B",
    any_model="lowmem plan's activation-bits column (0, 8, 2), and --levers with --max-batch",
    accounted="the packed bytes counted as activations, the full-precision tensor freed as in the plain step",
    exact="lossy",
    proof="tests/test_compress.py::test_weight_gradient_error_within_the_quantization_bound",
    quality="metrics/levers_train.json",
)

GROUP = 256  # elements per (minimum, step) pair: 8 bytes of fp32 per 256 elements, 1/32 bit per element at 8 bits


def check(bits: int) -> None:
    """Raises ValueError unless ``bits`` is 0 (off) or one of ``BITS``."""
    if isinstance(bits, bool) or bits not in (0, *BITS):
        raise ValueError(f"activation_bits={bits!r} is not allowed; use 0 (off) or one of {', '.join(map(str, BITS))}")


def packed_bytes(numel: int, bits: int, group: int = GROUP) -> int:
    """Bytes that ``pack`` keeps for a tensor of ``numel`` elements: codes for whole groups, plus two fp32 per group."""
    if bits == 16:
        return 2 * numel
    groups = math.ceil(numel / group)
    return groups * group * bits // 8 + groups * 2 * 4


@dataclass
class Packed:
    """One saved tensor, compressed: its codes (uint8, ``8 // bits`` per byte; bf16 values at 16 bits), per-group
    minimum and step (fp32), and what it takes to rebuild it."""

    codes: torch.Tensor
    low: torch.Tensor | None
    step: torch.Tensor | None
    bits: int
    shape: torch.Size
    dtype: torch.dtype

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.codes, self.low, self.step) if t is not None)


def pack(t: torch.Tensor, bits: int, group: int = GROUP) -> Packed:
    """``t`` at ``bits`` bits (see the module's docstring)."""
    t = t.detach()
    if bits == 16:
        return Packed(t.to(torch.bfloat16), None, None, bits, t.shape, t.dtype)
    flat = t.reshape(-1).to(torch.float32, copy=True)
    n = flat.numel()
    groups = math.ceil(n / group)
    # Padding with zeros only widens the last group's range, so the bound still holds there. The codes are computed
    # in place in this copy: packing holds one fp32 copy at most.
    pad = groups * group - n
    x = (F.pad(flat, (0, pad)) if pad else flat).view(groups, group)
    low, high = x.aminmax(dim=1, keepdim=True)
    levels = 2**bits - 1
    # A constant group (all zeros after a ReLU) has no range; any positive step codes it exactly.
    step = ((high - low) / levels).clamp_min(torch.finfo(torch.float32).tiny)
    q = x.sub_(low).div_(step).round_().clamp_(0, levels).to(torch.uint8)
    per = 8 // bits
    q = q.view(-1, per)
    codes = q[:, 0].clone()
    for i in range(1, per):
        codes |= q[:, i] << (bits * i)
    return Packed(codes, low, step, bits, t.shape, t.dtype)


def unpack(p: Packed) -> torch.Tensor:
    """The tensor ``p`` was packed from, to within ``error_bound``, in its own dtype and shape."""
    if p.bits == 16:
        return p.codes.to(p.dtype)
    assert p.low is not None and p.step is not None
    per, mask = 8 // p.bits, 2**p.bits - 1
    q = torch.stack([(p.codes >> (p.bits * i)) & mask for i in range(per)], dim=1)
    x = q.view(p.low.shape[0], -1).float().mul_(p.step).add_(p.low)
    return x.reshape(-1)[: p.shape.numel()].view(p.shape).to(p.dtype)


def error_bound(t: torch.Tensor, bits: int, group: int = GROUP) -> torch.Tensor:
    """Per element of ``t``, the most that ``unpack(pack(t, bits))`` may differ from it: half a group's step (2, 4, 8
    bits) or bf16's rounding (16 bits); then the rounding of the value back into ``t``'s dtype, and fp32's own."""
    dtype, t = t.dtype, t.detach().float()
    if bits == 16:
        return t.abs() * torch.finfo(torch.bfloat16).eps / 2 + torch.finfo(torch.float32).tiny
    n = t.numel()
    groups = math.ceil(n / group)
    x = F.pad(t.reshape(-1), (0, groups * group - n)).view(groups, group)
    low, high = x.aminmax(dim=1, keepdim=True)
    half_step = (high - low) / (2**bits - 1) / 2
    fp32 = torch.finfo(torch.float32).eps * x.abs().amax(dim=1, keepdim=True) * 4
    bound = (half_step + fp32).expand(groups, group).reshape(-1)[:n].view(t.shape)
    return bound + (t.abs() + bound) * torch.finfo(dtype).eps / 2


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter or the batch (leaves), a view of one, or autocast's cast of a parameter: alive anyway."""
    while t._base is not None:
        t = t._base
    if t.is_leaf:
        return True
    fn = t.grad_fn
    return fn is not None and fn.name() == "ToCopyBackward0" and \
        all(f is None or f.name() == "torch::autograd::AccumulateGrad" for f, _ in fn.next_functions)


class _Hooks:
    """The pack and unpack hooks of one ``compressing`` context. A storage packed once is reused while it lives, so
    a tensor that two ops save is stored once."""

    def __init__(self, bits: int, group: int) -> None:
        self.bits, self.group = bits, group
        self._cache: dict[tuple[Any, ...], Packed] = {}

    def pack(self, t: torch.Tensor) -> Any:
        worth = t.is_floating_point() and packed_bytes(t.numel(), self.bits, self.group) < t.numel() * t.element_size()
        if not worth or _is_weight(t) or (self.bits == 16 and t.dtype == torch.bfloat16):
            saved(t)
            return t.detach()  # a detached alias shares the storage and avoids a grad_fn <-> output cycle
        st = t.untyped_storage()
        key = (id(st), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        if key not in self._cache:
            self._cache[key] = pack(t, self.bits, self.group)
            weakref.finalize(st, self._cache.pop, key, None)  # the storage is gone: its id may be reused
        p = self._cache[key]
        for part in p.tensors():
            saved(part)
        return p

    @staticmethod
    def unpack(p: Any) -> torch.Tensor:
        return unpack(p) if isinstance(p, Packed) else p


def compressing(bits: int, group: int = GROUP) -> AbstractContextManager[Any]:
    """A context in which tensors saved for backward are stored at ``bits`` bits (0: as they are)."""
    check(bits)
    if not bits:
        return nullcontext()
    hooks = _Hooks(bits, group)
    return torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack)
