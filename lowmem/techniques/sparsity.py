"""Sparsity (Sohoni et al. 2019, the first technique): the 3x3 block convolutions of WRN trained sparse, with
dynamic sparse reparameterization (DSR, Mostafa & Wang 2019) or a static magnitude-pruned pattern, and stored
compressed.

Why hand-written: ``torch.nn.utils.prune`` and mask-based sparse-training libraries keep the dense weight and a mask,
so they use *more* memory than dense training, and torch has no sparse convolution for training. Here a sparse
layer holds only ``values`` (its nonzeros, the parameter the optimizer sees) and ``indices`` (their flat positions
in the dense weight, int32). The dense weight is built from them while the layer computes, in its forward and again
in its backward, and is never saved for backward; gradients and optimizer state are ``values``-sized, so they are
compressed too. The accountant counts these as CSR (``CSRFormat``: nnz values, nnz column indices and rows + 1 row
pointers, at 4 or 2 bytes each).

DSR, as in the paper notes: sparse from the start at a uniform initial sparsity; every ``period`` steps, prune the
weights below a global adaptive magnitude threshold (doubled when it prunes too few, halved when too many), and
regrow as many at random free positions, spread over the layers in proportion to their surviving weights, at zero,
with zero momentum. The total number of nonzeros never changes; the per-layer counts do (that is the point of DSR).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowmem.memory.ledger import StorageRecord
from lowmem.techniques import optimizers

LEVER = dict(  # lowmem.techniques.registry
    name="sparsity",
    what="the 3x3 convolutions' weights kept sparse, stored as CSR (values and indices), and rewired by DSR",
    settings=(0.0, "a fraction in (0, 1)"),
    field="sparsity",
    short="sparsity-S",
    wrn="Techniques(sparsity=S, sparse_method=dsr|static): each block's 3x3 convolution a SparseConv2d",
    fairseq="the plugin's --sparsity S (--sparse-method, --dsr-periods, --dsr-reallocate): DynamicConv's linear layers",
    any_model="not applied: which layers to sparsify, and how the model takes it, is the model's own choice",
    accounted="the CSR bytes of each sparse layer (values, column indices, row pointers) in place of its dense weight",
    exact="lossy",
    proof="tests/test_sparsity.py::test_dsr_holds_the_sparsity_level_and_a_consistent_pattern_over_many_rewirings",
    quality="metrics/sparsity.json",
)

INDEX_FORMATS = ("csr32", "csr16")  # CSR index width: 32-bit, or 16-bit in the layers where every index fits


class _SparseConv(torch.autograd.Function):
    """conv2d with a weight given as (values, indices): the dense weight exists only inside forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, shape: torch.Size, stride: int, padding: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, values, indices)
        ctx.conf = (shape, stride, padding)
        return F.conv2d(x, densify(values.to(x.dtype), indices, shape), None, stride, padding)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, values, indices = ctx.saved_tensors
        shape, stride, padding = ctx.conf
        w = densify(values.to(x.dtype), indices, shape)
        # The kernel autograd calls for a dense conv2d, so gradients equal the dense-masked computation's.
        gx, gw, _ = torch.ops.aten.convolution_backward(
            grad, x, w, None, [stride] * 2, [padding] * 2, [1, 1], False, [0, 0], 1, [ctx.needs_input_grad[0], True, False]
        )
        return gx, gw.reshape(-1).index_select(0, indices).to(values.dtype), None, None, None, None


def densify(values: torch.Tensor, indices: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    # index_add_ into zeros (each position once) is a copy, and unlike index_copy_ it takes int32 indices.
    return values.new_zeros(shape.numel()).index_add_(0, indices, values).view(shape)


class SparseWeight(nn.Module):
    """A weight stored as its nonzeros (``values``, the parameter the optimizer sees) and their sorted flat positions
    (``indices``, int32) in a dense weight of ``shape``: what DSR rewires, CSR accounts and ``resize_to`` reloads,
    for every sparse layer type."""

    def __init__(self, weight: torch.Tensor, keep: torch.Tensor) -> None:
        """``keep``: a CPU bool tensor over the weight's positions, True where the weight is kept."""
        super().__init__()
        self.shape = weight.shape
        flat = keep.reshape(-1).nonzero().squeeze(1).to(weight.device)
        self.values = nn.Parameter(weight.detach().reshape(-1)[flat].clone())
        self.register_buffer("indices", flat.to(torch.int32))

    @property
    def nnz(self) -> int:
        return self.values.numel()

    @property
    def rows(self) -> int:
        """Rows of the weight as the m x n matrix CSR stores: output channels x (input channels * kh * kw)."""
        return self.shape[0]

    @torch.no_grad()
    def dense_weight(self) -> torch.Tensor:
        return densify(self.values, self.indices, self.shape)

    def set_pattern(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Replaces the stored nonzeros; the parameter object stays the one the optimizer holds."""
        self.values.data = values
        self.values.grad = None
        self.indices = indices.to(torch.int32)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, nnz={self.nnz}, density={self.nnz / self.shape.numel():.3f}"


class SparseConv2d(SparseWeight):
    """A bias-free conv2d with a sparse weight (``SparseWeight``)."""

    def __init__(self, conv: nn.Conv2d, keep: torch.Tensor) -> None:
        if conv.bias is not None or conv.groups != 1 or conv.dilation != (1, 1):
            raise ValueError("SparseConv2d takes bias-free, ungrouped, undilated convolutions (WRN's)")
        super().__init__(conv.weight, keep)
        self.stride, self.padding = conv.stride[0], conv.padding[0]  # type: ignore[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
            # Autocast does not reach into a custom Function: cast as autocast would, then run without it.
            x = x.to(torch.get_autocast_dtype(dev))
            with torch.autocast(dev, enabled=False):
                return _SparseConv.apply(x, self.values, self.indices, self.shape, self.stride, self.padding)
        return _SparseConv.apply(x, self.values, self.indices, self.shape, self.stride, self.padding)


def _random_positions(weight: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(weight.numel(), generator=gen, device="cpu")[:k]


def _largest_magnitudes(weight: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    return weight.detach().abs().reshape(-1).cpu().topk(k).indices


# The sparse methods, by name: which k positions of a weight are kept at initialization. DSR starts from random
# positions and moves them while training; static keeps the initialization's largest weights for good.
METHODS: dict[str, Callable[[torch.Tensor, int, torch.Generator], torch.Tensor]] = {
    "dsr": _random_positions,
    "static": _largest_magnitudes,
}


def keep_mask(weight: torch.Tensor, k: int, method: str, gen: torch.Generator) -> torch.Tensor:
    """A CPU bool mask over ``weight``'s positions with ``k`` True, where ``method`` keeps weights."""
    if method not in METHODS:
        raise ValueError(f"sparse method {method!r} is not one of {', '.join(METHODS)}")
    keep = torch.zeros(weight.numel(), dtype=torch.bool, device="cpu")  # on the CPU even inside a torch.device context
    if weight.device.type == "meta":
        keep[:k] = True  # shapes only (the accountant): which positions are kept changes no byte count
    else:
        keep[METHODS[method](weight, k, gen)] = True
    return keep


def sparse_layers(model: nn.Module) -> dict[str, SparseWeight]:
    return {n: m for n, m in model.named_modules() if isinstance(m, SparseWeight)}


def sparsify(model: nn.Module, sparsity: float, method: str = "dsr", seed: int = 0) -> dict[str, SparseConv2d]:
    """Replaces the 3x3 convolutions inside ``model.blocks`` (the stem conv, the 1x1 shortcuts and the classifier stay
    dense, as in DSR's WRN setup) by ``SparseConv2d`` at a uniform ``sparsity``: random positions for DSR (its
    initialization), the largest-magnitude weights of the initialization for ``static``."""
    if not 0.0 < sparsity < 1.0:
        raise ValueError(f"sparsity must be in (0, 1), got {sparsity!r}")
    if method not in METHODS:
        raise ValueError(f"sparse method {method!r} is not one of {', '.join(METHODS)}")
    gen = torch.Generator().manual_seed(seed)
    for block in model.blocks:  # type: ignore[attr-defined]
        for name in ("conv1", "conv2"):
            conv = getattr(block, name)
            if not isinstance(conv, nn.Conv2d) or conv.kernel_size != (3, 3):
                continue
            k = round((1.0 - sparsity) * conv.weight.numel())
            setattr(block, name, SparseConv2d(conv, keep_mask(conv.weight, k, method, gen)))
    return sparse_layers(model)


def sparse_weight_count(model: nn.Module) -> int:
    """Weights of the layers ``sparsify`` makes sparse, counted dense: what DSR's reallocation count scales with."""
    total = 0
    for block in model.blocks:  # type: ignore[attr-defined]
        for name in ("conv1", "conv2"):
            conv = getattr(block, name)
            total += conv.shape.numel() if isinstance(conv, SparseConv2d) else conv.weight.numel() if conv.kernel_size == (3, 3) else 0
    return total


# DSR's recipe (Mostafa & Wang 2019) moves 20,000 weights per rewiring in WRN-28-2, whose sparse layers (the 3x3
# convs of its 12 residual blocks: widths 32, 64, 128 after 16, 32, 64 input channels, 4 blocks each) hold this many
# weights. Written from the architecture, so that this layer needs no model; tests/test_sparsity.py builds WRN-28-2
# and checks it.
RECIPE_REALLOCATE = 20000
RECIPE_SPARSE_WEIGHTS = 9 * sum(c_in * w + 7 * w * w for c_in, w in ((16, 32), (32, 64), (64, 128)))


def scaled_reallocation(model: nn.Module, count: int) -> int:
    """DSR's per-cycle reallocation, given for WRN-28-2 (the recipe's 20,000), scaled to ``model`` by the number of
    weights in their sparse layers."""
    return max(1, round(count * sparse_weight_count(model) / RECIPE_SPARSE_WEIGHTS))


def resize_to(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Gives each sparse layer the number of nonzeros it has in ``state_dict``, so a DSR checkpoint (whose per-layer
    counts moved) loads with ``load_state_dict``."""
    for name, layer in sparse_layers(model).items():
        idx = state_dict[f"{name}.indices"]
        layer.set_pattern(idx.clone(), layer.values.new_zeros(idx.numel()))


@dataclass
class DSR:
    """Dynamic sparse reparameterization over the sparse layers of a model, for a run of ``total_steps`` steps.

    Every ``periods[i]`` steps from the fraction ``phases[i]`` of the run on, ``reallocate`` weights move; rewiring
    stops at the fraction ``stop``. The recipe's schedule is periods 100/200/400/800 iterations from epochs
    0/25/80/140 of 200, stopping at 190: these phases, and the periods a run of that length uses.
    """

    layers: dict[str, SparseConv2d]
    total_steps: int
    reallocate: int
    periods: tuple[int, ...] = (100, 200, 400, 800)
    phases: tuple[float, ...] = (0.0, 0.125, 0.4, 0.7)
    stop: float = 0.95
    threshold: float = 0.001  # DSR's initial H
    tolerance: float = 0.1  # H is adapted when the pruned count is more than this fraction off ``reallocate``
    seed: int = 0
    step: int = 0
    rewirings: int = 0
    pruned_last: int = 0
    _gen: torch.Generator = field(default_factory=torch.Generator, repr=False)

    def __post_init__(self) -> None:
        if len(self.periods) != len(self.phases) or min(self.periods) < 1:
            raise ValueError(f"DSR needs one period (>= 1 step) per phase {self.phases}, got {self.periods}")
        self._gen.manual_seed(self.seed)

    def period(self, step: int) -> int:
        frac = step / self.total_steps
        return [p for p, start in zip(self.periods, self.phases) if frac >= start][-1]

    def after_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Call after each optimizer step; rewires when the schedule says so and returns whether it did."""
        self.step += 1
        if self.step >= self.stop * self.total_steps or self.step % self.period(self.step):
            return False
        self.rewire(optimizer)
        return True

    @torch.no_grad()
    def rewire(self, optimizer: torch.optim.Optimizer) -> None:
        layers = list(self.layers.values())
        keep = [layer.values.abs() >= self.threshold for layer in layers]
        pruned = sum(int((~k).sum()) for k in keep)
        # The global adaptive threshold: aim at `reallocate` pruned weights per cycle.
        if pruned < (1 - self.tolerance) * self.reallocate:
            self.threshold *= 2
        elif pruned > (1 + self.tolerance) * self.reallocate:
            self.threshold /= 2
        survivors = torch.tensor([int(k.sum()) for k in keep], dtype=torch.float64)
        free = torch.tensor([layer.shape.numel() for layer in layers], dtype=torch.float64) - survivors
        grow = _apportion(pruned, survivors, free)
        for layer, k, g in zip(layers, keep, grow.tolist()):
            self._regrow(layer, k, int(g), optimizer)
        self.rewirings += 1
        self.pruned_last = pruned

    def _regrow(self, layer: SparseConv2d, keep: torch.Tensor, grow: int, optimizer: torch.optim.Optimizer) -> None:
        kept = layer.indices[keep].long()
        occupied = torch.zeros(layer.shape.numel(), dtype=torch.bool, device=kept.device)
        occupied[kept] = True
        candidates = (~occupied).nonzero().squeeze(1)
        grown = candidates[torch.randperm(candidates.numel(), generator=self._gen)[:grow].to(candidates.device)]
        order = torch.cat([kept, grown]).argsort()
        new_idx = torch.cat([kept, grown])[order]

        def realign(t: torch.Tensor) -> torch.Tensor:
            # Survivors keep their value; regrown positions start at zero; pruned ones are gone.
            return torch.cat([t[keep], t.new_zeros(grow)])[order]

        optimizers.realign(optimizer.state.get(layer.values, {}), layer.values.shape, realign)
        layer.set_pattern(new_idx, realign(layer.values.data))

    def state_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "step": self.step, "rewirings": self.rewirings, "gen": self._gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.threshold, self.step, self.rewirings = state["threshold"], state["step"], state["rewirings"]
        self._gen.set_state(state["gen"])


def _apportion(total: int, weights: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """``total`` split in proportion to ``weights`` (largest remainders), no part above its cap; the sum is exact."""
    out = torch.zeros_like(weights)
    left = float(total)
    open_ = caps > out
    while left > 0 and bool(open_.any()):
        w = torch.where(open_, weights.clamp(min=1e-12), torch.zeros_like(weights))
        share = torch.minimum(w / w.sum() * left, caps - out)
        base = share.floor()
        rem = int(left - base.sum().item())
        if rem > 0:
            frac = torch.where(caps - out - base >= 1, share - base, torch.full_like(share, -1.0))
            base[frac.argsort(descending=True)[:rem]] += 1
            base = torch.minimum(base, caps - out)
        out += base
        left = float(total) - float(out.sum())
        open_ = caps > out
        if base.sum() == 0:
            break
    return out.long()


@dataclass(frozen=True)
class CSRFormat:
    """The accountant's storage format for a model with sparse layers: each sparse layer's values, gradients and
    value-shaped optimizer state count nnz x ``value_bytes`` (None: the dtype's own width), and its index buffer
    counts as CSR indices, nnz column indices + (rows + 1) row pointers, once per layer (the gradient and the state
    share the weight's pattern). ``index_bytes`` 2 is used only in layers where every index fits in 16 bits;
    ``index_widths`` says which. Every other tensor counts as PyTorch stores it."""

    model: nn.Module
    index_bytes: int = 4
    value_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.index_bytes not in (2, 4) or self.value_bytes not in (None, 2, 4):
            raise ValueError("CSRFormat: index_bytes must be 4 or 2, value_bytes None, 4 or 2")
        # The layers as they are now (the accountant formats one step's records right after it).
        object.__setattr__(self, "_layers", sparse_layers(self.model))
        object.__setattr__(self, "_widths", self._index_widths())

    def index_widths(self) -> dict[str, int]:
        """Bytes per index of each sparse layer: 2 only where column indices (< n) and row pointers (<= nnz) fit."""
        return dict(self._widths)  # type: ignore[attr-defined]

    def _index_widths(self) -> dict[str, int]:
        out = {}
        for name, layer in self._layers.items():  # type: ignore[attr-defined]
            n = layer.shape.numel() // layer.rows
            fits = n - 1 < 2**16 and layer.nnz < 2**16
            out[name] = 2 if self.index_bytes == 2 and fits else 4
        return out

    def __call__(self, record: StorageRecord) -> int:
        layers, widths = self._layers, self._widths  # type: ignore[attr-defined]
        head, _, tail = record.name.partition(".values")
        if head in layers and record.role in ("param", "grad", "state") and record.numel == layers[head].nnz:
            return record.numel * (self.value_bytes or record.dtype.itemsize)
        if record.role == "buffer" and record.name.endswith(".indices") and record.name[: -len(".indices")] in layers:
            name = record.name[: -len(".indices")]
            return (layers[name].nnz + layers[name].rows + 1) * widths[name]
        return record.nbytes
