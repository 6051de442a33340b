"""The optimizer step fused into backward: each parameter is updated, and its gradient freed, as soon as its
gradient is complete, so the gradients of the whole model never exist at once.

A lever beyond Sohoni et al. (2019), whose gradients are all alive at the optimizer step. It is PyTorch's documented
pattern ("How to save memory by fusing the optimizer step into the backward pass": a
``Tensor.register_post_accumulate_grad_hook`` per parameter that steps it). No library provides it for torch's SGD
with Nesterov momentum: torch-optimi's gradient release has SGD without Nesterov, which would change the recipe.
So this subclasses ``torch.optim.SGD``: the same ``param_groups`` (an LR scheduler drives it as it drives SGD), the
same ``state`` and ``state_dict`` (``momentum_buffer`` per parameter), and the same update, taken by SGD's own
functional ``torch.optim.sgd.sgd`` on one parameter at a time. ``step()`` then has nothing left to do.

Where it cannot work, it refuses (``check``):
- gradient accumulation (microbatching): the hook would step after every microbatch, on a partial gradient;
- loss scaling (the 16-bit modes): a step whose gradients are not finite must be skipped, and that is known only
  once every gradient exists;
- gradient clipping by the global norm, or any optimizer that needs every gradient first: the same reason.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.sgd import sgd

from lowmem.memory.accounting import gradient_ready


def check(microbatch: int, precision: str) -> None:
    """Raises ValueError where the fused step cannot give the plain step's update."""
    if microbatch:
        raise ValueError(f"fused_step cannot run with microbatch={microbatch}: it would step on each microbatch's "
                         "partial gradient; use microbatch=0, or fused_step=False to accumulate")
    if precision != "fp32":
        raise ValueError(f"fused_step cannot run with precision={precision!r}: its loss scaler skips a step whose "
                         "gradients are not finite, which is known only once all of them exist; use precision='fp32'")


class FusedSGD(torch.optim.SGD):
    """``torch.optim.SGD`` whose update of each parameter runs inside backward (``momentum``, ``nesterov``,
    ``dampening``, ``weight_decay`` and ``maximize`` as SGD's); its gradients are freed as they are used."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        self._handles: list[Any] = []
        self._group: dict[torch.Tensor, int] = {}  # parameter -> index of its group, read anew at every update
        super().__init__(params, **kwargs)  # calls add_param_group, which hooks each group's parameters

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["differentiable"]:
            raise ValueError("FusedSGD cannot be differentiable: each update runs in a backward hook")
        for p in group["params"]:
            if p.requires_grad:  # a frozen parameter has no gradient, and PyTorch refuses to hook it
                self._group[p] = len(self.param_groups) - 1
                self._handles.append(p.register_post_accumulate_grad_hook(self._step_one))

    @torch.no_grad()
    def _step_one(self, p: torch.Tensor) -> None:
        gradient_ready(p)  # the accountant's only chance to see this tensor as a gradient: it is freed below
        # By index, not by the dict itself: load_state_dict replaces the group dicts, and a scheduler drives the new ones.
        g = self.param_groups[self._group[p]]
        buf = [self.state[p].get("momentum_buffer") if g["momentum"] != 0 else None]
        sgd([p], [p.grad], buf, weight_decay=g["weight_decay"], momentum=g["momentum"], lr=g["lr"],
            dampening=g["dampening"], nesterov=g["nesterov"], maximize=g["maximize"], foreach=False)
        if g["momentum"] != 0:
            self.state[p]["momentum_buffer"] = buf[0]
        p.grad = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Every update already ran in backward; a closure is still called, for its loss."""
        return closure() if closure is not None else None

    def remove(self) -> None:
        """Unhooks the parameters (a model then trains with a plain optimizer again)."""
        for h in self._handles:
            h.remove()


def fused_sgd(model: nn.Module, **kwargs: Any) -> FusedSGD:
    """``FusedSGD`` over ``model``'s parameters, with SGD's keyword arguments."""
    return FusedSGD(model.parameters(), **kwargs)
