"""The optimizer step fused into backward: each parameter is updated, and its gradient freed, as soon as its
gradient is complete, so the gradients of the whole model never exist at once.

A lever beyond Sohoni et al. (2019), whose gradients are all alive at the optimizer step. It is PyTorch's documented
pattern ("How to save memory by fusing the optimizer step into the backward pass": one optimizer per parameter,
stepped by a ``Tensor.register_post_accumulate_grad_hook``), for any optimizer that updates each parameter on its
own: torch's SGD (with the recipe's Nesterov momentum) and AdamW, bitsandbytes' 8-bit ones. No library wraps that
pattern as an optimizer (torch-optimi's gradient release has SGD without Nesterov, which would change the recipe), so
``FusedOptimizer`` does, and keeps what a training loop relies on: the ``param_groups`` as the plain optimizer's (an
LR scheduler drives them; each update copies its group's settings into the parameter's own optimizer), one shared
``state`` (so ``state_dict`` is the plain optimizer's too), and ``step()``, which has nothing left to do.

Where it cannot work, ``check`` refuses before any compute:
- gradient accumulation (microbatching): the hook would step after every microbatch, on a partial gradient;
- loss scaling (the 16-bit modes): a step whose gradients are not finite must be skipped, and that is known only
  once every gradient exists.
For the same reason it cannot serve gradient clipping by the global norm, or any optimizer that needs every
gradient first; a training loop that clips after backward finds no gradients left, which no hook can detect, so
that is the caller's to avoid. A parameter frozen when the optimizer was built has no hook: if it later gets a
gradient, ``step()`` raises rather than leave it unupdated.

Each parameter's optimizer sees its parameter as the first of its only group, so bitsandbytes' per-parameter
overrides (``GlobalOptimManager``), keyed by group and position, do not carry over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lowmem.memory.accounting import gradient_ready


LEVER = dict(  # lowmem.techniques.registry
    name="fused-step",
    what="each parameter steps, and its gradient is freed, as soon as its gradient is complete",
    settings=("plain", "fused"),
    field="",
    short="",
    wrn="not a Techniques field: the WRN studies step after backward (the recipe's loss scaler needs every gradient)",
    fairseq="not applied: fairseq-train steps after backward",
    any_model="lowmem profile/plan --step fused (whole batch, fp32, one device)",
    accounted="the step accounted with the hooks: one parameter's gradient alive at a time",
    exact="bit-exact",
    proof="tests/test_fused_step.py::test_parameters_equal_plain_sgd_bit_for_bit_after_many_steps_under_a_schedule",
    quality="",
)


def check(microbatch: int, precision: str) -> None:
    """Raises ValueError where the fused step cannot give the plain step's update."""
    if microbatch:
        raise ValueError(f"fused_step cannot run with microbatch={microbatch}: it would step on each microbatch's "
                         "partial gradient; use microbatch=0, or the plain step (--step plain) to accumulate")
    if precision != "fp32":
        raise ValueError(f"fused_step cannot run with precision={precision!r}: its loss scaler skips a step whose "
                         "gradients are not finite, which is known only once all of them exist; use precision='fp32'")


class FusedOptimizer(torch.optim.Optimizer):
    """The optimizer ``make(params)`` over ``params``, with each parameter's update run inside backward by its own
    ``make([p])``; its gradients are freed as they are used."""

    def __init__(self, params: Any, make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        self._make = make
        self._inner: dict[torch.Tensor, torch.optim.Optimizer] = {}
        self._group: dict[torch.Tensor, int] = {}  # parameter -> index of its group, read anew at every update
        self._handles: list[Any] = []
        # The plain optimizer's defaults, so that every group gets the settings it would have had there.
        defaults = make([torch.zeros(1, requires_grad=True)]).defaults
        super().__init__(params, defaults)  # calls add_param_group, which hooks each group's parameters

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group.get("differentiable"):
            raise ValueError("a fused optimizer cannot be differentiable: each update runs in a backward hook")
        for p in group["params"]:
            if p.requires_grad:  # a frozen parameter has no gradient, and PyTorch refuses to hook it
                self._inner[p] = self._make([p])
                self._group[p] = len(self.param_groups) - 1
                self._handles.append(p.register_post_accumulate_grad_hook(self._step_one))

    def _step_one(self, p: torch.Tensor) -> None:
        gradient_ready(p)  # the accountant's only chance to see this tensor as a gradient: it is freed below
        # By index, not by the dict itself: load_state_dict replaces the group dicts and the state, and a scheduler
        # drives the new ones.
        inner = self._inner[p]
        inner.param_groups[0].update({k: v for k, v in self.param_groups[self._group[p]].items() if k != "params"})
        inner.state = self.state
        inner.step()
        p.grad = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Every update already ran in backward; a closure is still called, for its loss."""
        loss = closure() if closure is not None else None
        left = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if left:
            raise RuntimeError(f"{len(left)} parameter(s) have a gradient that no backward hook stepped: they were frozen "
                               "when the fused optimizer was built; build it again after unfreezing them")
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts every state tensor but "step" to its parameter's floating dtype, which would turn bitsandbytes'
        # uint8 codes into floats that it then reads as 32-bit moments: restore the dtypes that were saved.
        saved = {(i, k): v.dtype for i, st in state_dict["state"].items() for k, v in st.items()
                 if isinstance(v, torch.Tensor) and not v.is_floating_point()}
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for (i, k), dtype in saved.items():
            self.state[params[i]][k] = self.state[params[i]][k].to(dtype)

    def remove(self) -> None:
        """Unhooks the parameters (a model then trains with a plain optimizer again)."""
        for h in self._handles:
            h.remove()


def fused_sgd(model: nn.Module, **kwargs: Any) -> FusedOptimizer:
    """``torch.optim.SGD`` over ``model``'s parameters, with SGD's keyword arguments, fused into backward."""
    return FusedOptimizer(model.parameters(), lambda ps: torch.optim.SGD(ps, **kwargs))
