"""The levers, each declared once, in the module that implements it (fairseq's registries, sparse_learning's
``funcs.py``): a module of ``lowmem.techniques`` that defines ``LEVER`` (or ``LEVERS``, for two) is a lever, and this
registry finds it there. Nothing here lists levers, so adding one touches only its own module.

A card is a plain dict (the module needs no import for it, and ``lowmem.runs`` leaves cards out of a run's code
digest: a card says what a lever is called and where its evidence is; what a run computes is in the module's
functions and tables, which stay in the digest). Its keys are ``Lever``'s fields.

The WRN trainer asks the registry for the optimizer of ``Techniques.optimizer``: a lever whose card sets the
``optimizer`` field provides ``check(name)`` and ``make(params, name, lr, momentum, nesterov, weight_decay)``, and a
run that uses such a lever has the lever's module on its code path (``modules_for``); one that does not, does not.
So a new lever retrains no run that does not use it.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any

import torch

PACKAGE = "lowmem.techniques"
EXACTNESS = ("bit-exact", "exact up to summation order", "lossy")
BASE_OPTIMIZER = "sgd"  # the recipe's SGD (lowmem.techniques.optimizers): what Techniques.optimizer is when no lever sets it


@dataclass(frozen=True)
class Lever:
    """What a reader, a grid, the planner and a table need to know of a lever, in one vocabulary."""

    name: str  # the lever's name in tables, figures, params.yaml and the planner
    what: str  # one line: what it keeps smaller, and how
    settings: tuple[Any, ...]  # what it can be set to, as its field or option takes it (off first, where it has one)
    field: str  # the Techniques field a WRN run sets it by ("" where a WRN run has none)
    short: str  # its short name in an arm or --levers, as PREFIX-VALUE ("microbatch-N"); "" where it is a setting's own
    wrn: str  # how it applies to a WRN step, or why it does not
    fairseq: str  # how it applies to a fairseq run (the plugin's flag), or why it does not
    any_model: str  # how `lowmem profile` / `lowmem plan` apply it to any model, or why they do not
    accounted: str  # how the accountant counts it
    exact: str  # one of EXACTNESS
    proof: str  # the test that proves it exact (tests/FILE.py::NAME), or, for a lossy lever, that tests its invariant
    quality: str  # where its measured quality is (a committed file), "" for an exact lever
    module: str = ""  # filled by the registry: where it is implemented and declared

    def __post_init__(self) -> None:
        if self.exact not in EXACTNESS:
            raise ValueError(f"lever {self.name!r}: exact={self.exact!r} is not one of {', '.join(EXACTNESS)}")
        if not self.settings:
            raise ValueError(f"lever {self.name!r} declares no settings")


def _cards(module: ModuleType) -> list[dict[str, Any]]:
    one = getattr(module, "LEVER", None)
    return [one] if one is not None else list(getattr(module, "LEVERS", ()))


@functools.cache
def levers() -> dict[str, Lever]:
    """Every lever, by name, in the order of its module's name."""
    package = importlib.import_module(PACKAGE)
    out: dict[str, Lever] = {}
    keys = {f.name for f in fields(Lever)} - {"module"}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{PACKAGE}.{info.name}")
        for card in _cards(module):
            if set(card) != keys:
                raise ValueError(f"{module.__name__}: a lever card has keys {sorted(set(card) ^ keys)} wrong "
                                 f"(a card has exactly {', '.join(sorted(keys))})")
            lever = Lever(**{**card, "settings": tuple(card["settings"])}, module=module.__name__)
            if lever.name in out:
                raise ValueError(f"lever {lever.name!r} is declared by {out[lever.name].module} and {module.__name__}")
            out[lever.name] = lever
    return out


def on_field(field: str) -> list[Lever]:
    """The levers a WRN run sets through the Techniques field ``field``."""
    return [lv for lv in levers().values() if lv.field == field]


def optimizers() -> tuple[str, ...]:
    """Every value ``Techniques.optimizer`` takes: the recipe's SGD, then each optimizer lever's settings."""
    return (BASE_OPTIMIZER, *(s for lv in on_field("optimizer") for s in lv.settings))


def _optimizer_module(name: str) -> ModuleType:
    for lv in on_field("optimizer"):
        if name in lv.settings:
            return importlib.import_module(lv.module)
    if name == BASE_OPTIMIZER:
        return importlib.import_module(f"{PACKAGE}.optimizers")
    raise ValueError(f"optimizer={name!r} is not one of {', '.join(optimizers())}")


def check_optimizer(name: str) -> None:
    """Raises ValueError for an unknown optimizer, or one whose library is not installed (saying what to install)."""
    _optimizer_module(name).check(name)


def make_optimizer(params: Any, name: str, lr: float, momentum: float, nesterov: bool, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer ``name``, made by the module of the lever that declares it."""
    return _optimizer_module(name).make(params, name, lr, momentum, nesterov, weight_decay)


def modules_for(values: dict[str, Any]) -> list[str]:
    """The modules of the levers that a run with these Techniques field ``values`` sets (the trainer's path holds the
    paper's levers already; a lever added later joins only the code path of the runs that set it)."""
    return sorted({lv.module for lv in levers().values() if lv.field and values.get(lv.field, _UNSET) in lv.settings})


_UNSET = object()
