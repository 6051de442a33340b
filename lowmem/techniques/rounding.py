"""bf16 stochastic rounding of the weight update: the alternative to Kahan's compensation for 16-bit weights.

A lever beyond Sohoni et al. (2019). In half-bf16 an update smaller than half a unit in the last place of a weight
is rounded away, every step, so small steps never move the weight (``lowmem.techniques.optimizers`` explains the
arithmetic). Kahan summation (``kahan``) keeps what was lost in a 16-bit buffer per weight. Stochastic rounding keeps
no buffer: it rounds the fp32 result up or down at random, with the probabilities that make the rounding unbiased,
so a small update moves the weight by one unit in the last place with a probability proportional to its size, and
by the right amount on average. It costs no optimizer state, and some noise.

``StochasticRoundingSGD`` is the heavy-ball SGD with L2 weight decay of the ``kahan`` arm (``optimi-sgd``, so that
the two compare on the same update), computed in fp32 per parameter. A bf16 weight takes the result through
torchao's ``_fp32_to_bf16_sr``, the rounding its optimizers' ``bf16_stochastic_round=True`` applies; the momentum
stays in the weights' dtype, as in plain half-bf16 SGD, rounded to nearest. An fp32 weight needs no rounding, and
there the update is torch's SGD without Nesterov, bit for bit (tested): in fp32 this arm is the control.

torchao draws its random bits from the global generator; the optimizer draws them from a generator of its own
(seeded by the run's seed, kept in its ``state_dict``), so that the rounding neither shifts the run's other draws
(augmentation) against the arms it is paired with, nor changes when a run resumes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

LEVER = dict(  # lowmem.techniques.registry
    name="stochastic-rounding",
    what="16-bit weights take each fp32 update rounded up or down at random, unbiased, with no buffer",
    settings=("sr-sgd",),
    field="optimizer",
    short="",
    wrn="Techniques(optimizer=sr-sgd): heavy-ball SGD whose bf16 weights are stochastically rounded (fp32: the control)",
    fairseq="not applied yet: the plugin's optimizers are AdamW's; torchao's AdamW has bf16_stochastic_round",
    any_model="not offered by lowmem plan: it needs no memory that the plain half-bf16 step does not (a quality lever)",
    accounted="no state beyond the momentum; the step's fp32 copies and random bits are its temporaries",
    exact="lossy",
    proof="tests/test_rounding.py::test_bf16_weights_follow_updates_that_round_to_nearest_loses",
    quality="metrics/levers_rounding_train.json",
)

OPTIMIZERS = ("sr-sgd",)


def check(name: str) -> None:
    """Raises ValueError for a name this lever does not provide, and where torchao is not installed."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r} is not one of {', '.join(OPTIMIZERS)}")
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise ValueError(f"optimizer={name!r} needs torchao, which is not installed: `make setup` installs the pinned "
                         "torchao (requirements-2.txt)")


def make(params: Iterable[torch.Tensor], name: str, lr: float, momentum: float, nesterov: bool,
         weight_decay: float) -> torch.optim.Optimizer:
    """The lever's optimizer (``nesterov`` is not taken: the update is the heavy-ball one of the ``kahan`` arm)."""
    check(name)
    return StochasticRoundingSGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def _rounding() -> Callable[[torch.Tensor], torch.Tensor]:
    import logging

    # torchao's import logs a deprecation of torch.compile's enum registration, which says nothing about this lever.
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        from torchao.optim.quant_utils import _fp32_to_bf16_sr
    finally:
        pytree.setLevel(level)
    return _fp32_to_bf16_sr


class StochasticRoundingSGD(torch.optim.Optimizer):
    """Heavy-ball SGD with L2 weight decay, its bf16 weights stochastically rounded (module docstring)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        # torch.initial_seed() is the run's seed and draws nothing, so the run's own random stream is untouched.
        self.rng = torch.Generator().manual_seed(torch.initial_seed()).get_state()
        self.round_bf16 = _rounding()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        outer = torch.get_rng_state()
        torch.set_rng_state(self.rng)
        try:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, group)
        finally:
            self.rng = torch.get_rng_state()
            torch.set_rng_state(outer)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        # In fp32 these are torch.optim.SGD's single-tensor operations, in its order, so fp32 is bit-equal to it.
        lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
        half = p.dtype != torch.float32
        weight = p.float() if half else p
        d = p.grad.float() if half else p.grad
        if weight_decay:
            d = d.add(weight, alpha=weight_decay)
        if momentum:
            state = self.state[p]
            stored = state.get("momentum_buffer")
            if stored is None:
                buf = torch.clone(d).detach()
                state["momentum_buffer"] = buf.to(p.dtype) if half else buf
            elif half:
                buf = stored.float().mul_(momentum).add_(d)
                stored.copy_(buf)  # the momentum in the weights' dtype, rounded to nearest, as plain half-bf16 keeps it
            else:
                buf = stored.mul_(momentum).add_(d)
            d = buf
        if not half:
            p.add_(d, alpha=-lr)
        elif p.dtype == torch.bfloat16:
            p.copy_(self.round_bf16(weight.add_(d, alpha=-lr)))
        else:
            raise ValueError(f"stochastic rounding is to bf16; a {p.dtype} weight would round to nearest (use half-bf16)")

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rounding_rng": self.rng}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.rng = state_dict.pop("rounding_rng")
        super().load_state_dict(state_dict)
