"""Sparse linear layers (Sohoni et al. 2019, sparsity applied to the DynamicConv benchmark): the ``nn.Linear``
counterpart of ``lowmem.techniques.sparsity.SparseConv2d``, stored the same way (``SparseWeight``) and trained by the same ``sparsity.DSR``.

A ``SparseLinear`` holds only ``values`` (the nonzeros of its weight, the parameter the optimizer sees) and
``indices`` (their sorted flat positions in the dense out x in weight, int32); the dense weight exists only inside
its forward and backward. The bias, if any, stays dense. ``sparsity.DSR``, ``sparsity.CSRFormat`` and
``sparsity.resize_to`` work on these layers unchanged. Kept apart from ``sparsity.py`` so that the WRN stages, whose
code that file is, do not have to be retrained for a layer type they do not use.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowmem.techniques.sparsity import METHODS, SparseWeight, densify, keep_mask


class _SparseLinear(torch.autograd.Function):
    """F.linear with a weight given as (values, indices); nothing dense is saved for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, shape: torch.Size) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, values, indices)
        ctx.shape = shape
        return F.linear(x, densify(values.to(x.dtype), indices, shape))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, values, indices = ctx.saved_tensors
        w = densify(values.to(x.dtype), indices, ctx.shape)
        gx = grad @ w if ctx.needs_input_grad[0] else None
        # Only the kept positions of grad^T x are needed, but torch has no sampled dense-dense product on CPU
        # for training, so the dense product is formed and gathered (it is freed before the next layer's).
        gw = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return gx, gw.reshape(-1).index_select(0, indices).to(values.dtype), None, None


class SparseLinear(SparseWeight):
    """A linear layer with a sparse weight (``SparseWeight``: the storage DSR, the CSR accounting and checkpoint
    resizing share with ``SparseConv2d``); the bias stays dense."""

    def __init__(self, linear: nn.Linear, keep: torch.Tensor) -> None:
        """``keep``: a CPU bool tensor over the weight's positions, True where the weight is kept."""
        super().__init__(linear.weight, keep)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _SparseLinear.apply(x, self.values, self.indices, self.shape)
        return y if self.bias is None else y + self.bias


def sparse_linears(model: nn.Module) -> dict[str, SparseLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, SparseLinear)}


def sparsify(root: nn.Module, names: list[str], sparsity: float, method: str = "dsr", seed: int = 0) -> dict[str, SparseLinear]:
    """Replaces the ``nn.Linear`` modules of ``root`` named in ``names`` by ``SparseLinear`` at a uniform
    ``sparsity``: random positions for DSR (its initialization), the largest-magnitude weights for ``static``."""
    if not 0.0 < sparsity < 1.0:
        raise ValueError(f"sparsity must be in (0, 1), got {sparsity!r}")
    if method not in METHODS:
        raise ValueError(f"sparse method {method!r} is not one of {', '.join(METHODS)}")
    gen = torch.Generator().manual_seed(seed)
    modules = dict(root.named_modules())
    for name in names:
        linear = modules[name]
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} is a {type(linear).__name__}, not an nn.Linear")
        k = max(1, round((1.0 - sparsity) * linear.weight.numel()))
        parent, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, attr, SparseLinear(linear, keep_mask(linear.weight, k, method, gen)))
    return sparse_linears(root)
