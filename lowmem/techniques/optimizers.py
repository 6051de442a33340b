"""The optimizer of a run, as a lever: the recipe's SGD, or torch-optimi's SGD, whose Kahan-compensated update keeps
16-bit weights from losing small steps to rounding.

A lever beyond Sohoni et al. (2019). In half-bf16 every weight is stored in bf16, whose 8-bit mantissa rounds away
any update smaller than half a unit in the last place: with lr 0.1 and a gradient of 1e-3, a weight near 1 moves by
1e-4, below bf16's spacing of 2^-8 there, so it never moves at all. Kahan summation keeps, per weight, the part of
each update that rounding dropped (a bf16 compensation buffer, counted as optimizer state) and adds it back on the
next step. torch-optimi's optimizers do this on the CPU (``kahan_sum``, on by default for 16-bit parameters).

- ``sgd``: ``torch.optim.SGD`` with the recipe's Nesterov momentum (``lowmem.wrn.recipe``).
- ``optimi-sgd``: ``optimi.SGD``, heavy-ball momentum with L2 weight decay, Kahan summation where the parameters are
  16-bit. optimi's SGD has no Nesterov momentum, so this arm changes the recipe in one more way than Kahan
  summation; in fp32 (no compensation) it measures that change alone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

OPTIMIZERS = ("sgd", "optimi-sgd")


def check(name: str) -> None:
    """Raises ValueError for an unknown optimizer, and for optimi-sgd where torch-optimi is not installed."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r} is not one of {', '.join(OPTIMIZERS)}")
    if name == "optimi-sgd":
        try:
            import optimi  # noqa: F401
        except ImportError as e:
            raise ValueError("optimizer='optimi-sgd' needs torch-optimi, which is not installed: `make setup` installs "
                             "the pinned torch-optimi (requirements-2.txt)") from e


def make(params: Iterable[torch.Tensor], name: str, lr: float, momentum: float, nesterov: bool,
         weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params`` (``nesterov`` applies to ``sgd`` only: optimi's SGD has none)."""
    check(name)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    import optimi

    # foreach=False: one parameter at a time, as the accountant's meta tensors and the CPU run alike take it.
    return optimi.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=False)
