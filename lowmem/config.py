"""The one resolver of every stage's parameters, both tracks: ``params.yaml`` → a checked, typed dataclass.

``params.yaml`` has a ``base`` block (profile, seed) and one block per DVC stage. A value that differs by profile is
written as a mapping with the keys ``smoke``, ``cpu`` and ``paper``; ``resolve`` picks the active one. Each stage's
parameters are a dataclass registered here by ``@stage(name)`` next to the code it configures (``lowmem.wrn.params``,
``lowmem.dynamicconv.params``, ``lowmem.studies.params``); it checks its values when built, so a bad parameter stops a
run before any work, with a message that names the parameter and what is allowed.

- ``resolve(stage, params)``: the flat, checked values of a stage at the profile of ``params['base']``.
- ``load(stage, source)``: the dataclass, from a resolved file (what the ``params`` stage writes to data/params/),
  from a params.yaml, or, for ``None``, from this checkout's params.yaml at the ``smoke`` profile: the default of
  every notebook's ``parameters`` cell, so that a notebook's smoke values have one source.

``python -m lowmem.pipeline params`` resolves every stage at once (the pipeline's first stage).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

PROFILES = ("smoke", "cpu", "paper")
DEVICES = ("auto", "cpu", "cuda")
PARAMS_YAML = Path(__file__).parents[1] / "params.yaml"
# Every stage's dataclass, by stage name; filled by @stage where each class is defined.
STAGES: dict[str, type] = {}


class ParamError(ValueError):
    """A parameter in params.yaml (or a notebook's parameters cell) is not allowed."""


def stage(name: str) -> Callable[[type], type]:
    """Registers a dataclass as the parameters of stage ``name``."""
    def register(cls: type) -> type:
        if name in STAGES and STAGES[name] is not cls:
            raise ValueError(f"stage {name!r} is registered twice: {STAGES[name].__qualname__} and {cls.__qualname__}")
        STAGES[name] = cls
        return cls
    return register


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ParamError(f"{name}={value!r} is not allowed; use one of: {', '.join(allowed)}")


def check_batch_sizes(name: str, value: Any) -> None:
    if not isinstance(value, list) or not value:
        raise ParamError(f"{name} must be a non-empty list of positive integers, got {value!r}")
    for b in value:
        if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
            raise ParamError(f"{name} must hold positive integers (a batch size of 0 or below is meaningless), got {b!r}")


def check_seeds(name: str, value: Any) -> None:
    if not isinstance(value, list) or not value or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ParamError(f"{name} must be a non-empty list of integers, got {value!r}")


def check_positive(**values: Any) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ParamError(f"{name} must be a positive integer, got {v!r}")


def resolve_device(name: str) -> torch.device:
    """'auto' is CUDA where available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but CUDA is not available; use device='auto' or 'cpu'")
    return torch.device(name)


def pick(value: Any, profile: str) -> Any:
    """A value written per profile (a mapping with exactly the keys smoke, cpu, paper) at ``profile``."""
    if isinstance(value, dict) and set(value) == set(PROFILES):
        return value[profile]
    return value


def _stage_class(name: str) -> type:
    if name not in STAGES:
        raise ParamError(f"stage={name!r} is not a stage; use one of: {', '.join(sorted(STAGES))} "
                         "(a stage is known once the module defining its parameters is imported)")
    return STAGES[name]


def resolve(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The flat, checked parameters of stage ``name`` for the profile named in ``params['base']``.

    A class may say where else its values come from: ``INHERITS`` names a stage resolved whole into its ``train``
    field; ``FROM`` maps a field to the block it is read from when that block sets it; ``derived(resolved)`` returns
    fields taken from other stages' resolved values (``resolved(stage)``), for a study built on theirs."""
    cls = _stage_class(name)
    base = params.get("base", {})
    profile = base.get("profile")
    check_choice("base.profile", profile, PROFILES)
    known = {f.name for f in dataclasses.fields(cls)}
    block = params.get(name, {})
    unknown = sorted(set(block) - known)
    if unknown:
        raise ParamError(f"unknown parameter(s) {unknown} in params.yaml block {name!r}; known: {sorted(known)}")
    values = {"profile": profile, **{k: v for k, v in base.items() if k in known and k != "profile"}}
    for field_name, other in getattr(cls, "FROM", {}).items():
        if field_name in params.get(other, {}):
            values[field_name] = pick(params[other][field_name], profile)
    values.update({k: pick(v, profile) for k, v in block.items()})
    if hasattr(cls, "INHERITS"):
        values["train"] = resolve(cls.INHERITS, params)
    if hasattr(cls, "derived"):
        values.update(cls.derived(lambda other: resolve(other, params)))
    return dataclasses.asdict(cls(**values))


def smoke(params: dict[str, Any] | None = None) -> dict[str, Any]:
    """``params`` (default: this checkout's params.yaml) with its profile set to smoke."""
    params = yaml.safe_load(PARAMS_YAML.read_text()) if params is None else params
    return {**params, "base": {**params.get("base", {}), "profile": "smoke"}}


def load(name: str, source: str | Path | dict[str, Any] | None = None, **overrides: Any) -> Any:
    """Stage ``name``'s dataclass from ``source``: a resolved file (data/params/<stage>.yaml), a params.yaml (it has
    a ``base`` block) or its contents, or ``None`` for this checkout's params.yaml at the smoke profile.
    ``overrides`` replace resolved values (where a notebook runs from, say)."""
    if source is None:
        data = resolve(name, smoke())
    else:
        data = source if isinstance(source, dict) else yaml.safe_load(Path(source).read_text())
    if "base" in data:
        data = resolve(name, data)
    cls = _stage_class(name)
    return cls(**{**data, **overrides})
