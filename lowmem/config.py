"""Typed stage parameters, resolved from ``params.yaml`` for one profile.

``params.yaml`` has a ``base`` block (profile, seed) and one block per DVC stage. A value that differs by profile is
written as a mapping with the keys ``smoke``, ``cpu`` and ``paper``; ``resolve`` picks the active one. Each stage's
dataclass checks its values when built, so a bad parameter stops a run before any work, with a message that names
the parameter and what is allowed.

``python -m lowmem.config STAGE [--params params.yaml] [--out FILE]`` writes the resolved, checked parameters as
YAML, which papermill reads with ``-f`` (see ``dvc.yaml``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from lowmem.data import DATASETS
from lowmem.models import parse_model_name

PROFILES = ("smoke", "cpu", "paper")
DEVICES = ("auto", "cpu", "cuda")


class ParamError(ValueError):
    """A parameter in params.yaml (or a notebook's parameters cell) is not allowed."""


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ParamError(f"{name}={value!r} is not allowed; use one of: {', '.join(allowed)}")


def _check_batch_sizes(name: str, value: Any) -> None:
    if not isinstance(value, list) or not value:
        raise ParamError(f"{name} must be a non-empty list of positive integers, got {value!r}")
    for b in value:
        if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
            raise ParamError(f"{name} must hold positive integers (a batch size of 0 or below is meaningless), got {b!r}")


def _check_model(name: str, value: Any) -> None:
    try:
        parse_model_name(value)
    except ValueError as e:
        raise ParamError(f"{name}: {e}") from None


@dataclass
class MemoryProfileParams:
    """Stage ``memory_profile``: where the memory of one WRN training step goes (notebook 01)."""

    profile: str = "smoke"
    seed: int = 0  # seeds the weights and batch of the measured runs
    model: str = "wrn-28-2"
    num_classes: int = 10
    in_channels: int = 3
    image_size: int = 32  # pixels per side
    lr: float = 0.1  # only so the optimizer step is the recipe's; memory does not depend on it
    accounted_batch_sizes: list[int] = field(default_factory=lambda: [1, 128])  # accounted at full size on meta
    measured_batch_sizes: list[int] = field(default_factory=lambda: [2])  # run for real on `device`
    reference_batch_size: int = 128  # the batch whose breakdown goes into the metrics; must be accounted
    device: str = "auto"  # where measured steps run: cuda if available under "auto"

    def __post_init__(self) -> None:
        _check_choice("profile", self.profile, PROFILES)
        _check_model("model", self.model)
        _check_choice("device", self.device, DEVICES)
        _check_batch_sizes("accounted_batch_sizes", self.accounted_batch_sizes)
        _check_batch_sizes("measured_batch_sizes", self.measured_batch_sizes)
        if self.reference_batch_size not in self.accounted_batch_sizes:
            raise ParamError(
                f"reference_batch_size={self.reference_batch_size!r} must be one of accounted_batch_sizes {self.accounted_batch_sizes}"
            )
        for name in ("num_classes", "in_channels", "image_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ParamError(f"{name} must be a positive integer, got {v!r}")


@dataclass
class BaselineParams:
    """Stage ``baseline``: the recipe's training run, no technique (notebook 02). Also the base of every technique run."""

    profile: str = "smoke"
    seed: int = 0  # unused by this stage (it runs every seed in `seeds`); kept so base.seed resolves
    seeds: list[int] = field(default_factory=lambda: [0])  # one run per seed; accuracy is reported as mean and spread
    dataset: str = "synthetic"
    augment: bool = True  # the recipe's reflect-pad-4 crop and horizontal flip on the training split
    data_root: str = "../data/raw"  # datasets are read (or downloaded, or generated) here
    model: str = "wrn-10-1"
    epochs: int = 1
    batch_size: int = 64
    lr: float = 0.1  # initial learning rate
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    milestones: list[float] = field(default_factory=lambda: [0.3, 0.6, 0.8])  # fractions of the epochs: 60/120/160 of 200
    gamma: float = 0.2  # lr factor at each milestone
    train_subset: int = 0  # examples drawn once (fixed across seeds) from the training split; 0 = all
    test_subset: int = 0  # likewise for the test split
    device: str = "auto"
    num_workers: int = 0  # DataLoader worker processes

    def __post_init__(self) -> None:
        _check_choice("profile", self.profile, PROFILES)
        _check_choice("dataset", self.dataset, DATASETS)
        if not isinstance(self.augment, bool):
            raise ParamError(f"augment must be true or false, got {self.augment!r}")
        _check_model("model", self.model)
        _check_choice("device", self.device, DEVICES)
        _check_batch_sizes("batch_size", [self.batch_size])
        if not isinstance(self.seeds, list) or not self.seeds or not all(isinstance(s, int) for s in self.seeds):
            raise ParamError(f"seeds must be a non-empty list of integers, got {self.seeds!r}")
        if not isinstance(self.epochs, int) or self.epochs <= 0:
            raise ParamError(f"epochs must be a positive integer, got {self.epochs!r}")
        if not isinstance(self.lr, (int, float)) or self.lr <= 0:
            raise ParamError(f"lr must be a positive number, got {self.lr!r}")
        if not (0 <= self.momentum < 1) or self.weight_decay < 0 or not (0 < self.gamma <= 1):
            raise ParamError("momentum must be in [0, 1), weight_decay >= 0 and gamma in (0, 1]")
        if not all(0 < f < 1 for f in self.milestones):
            raise ParamError(f"milestones are fractions of the training run, each in (0, 1), got {self.milestones!r}")
        for name in ("train_subset", "test_subset", "num_workers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ParamError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")


@dataclass
class CheckpointingParams:
    """Stage ``checkpointing``: strategies compared at full size, and timed (notebook 06)."""

    profile: str = "smoke"
    seed: int = 0
    model: str = "wrn-28-2"
    num_classes: int = 10
    in_channels: int = 3
    image_size: int = 32
    batch_size: int = 128  # accounted at full size on the meta device
    strategies: list[str] = field(default_factory=lambda: ["none", "block", "sqrt", "selective", "optimal-0.5"])
    timing_batch_size: int = 4  # real steps on `device`
    timing_repeats: int = 1  # timed steps per strategy (after one warm-up); the median is reported
    device: str = "auto"

    def __post_init__(self) -> None:
        from lowmem.checkpoint import parse

        _check_choice("profile", self.profile, PROFILES)
        _check_model("model", self.model)
        _check_choice("device", self.device, DEVICES)
        _check_batch_sizes("batch_size", [self.batch_size])
        _check_batch_sizes("timing_batch_size", [self.timing_batch_size])
        _check_batch_sizes("timing_repeats", [self.timing_repeats])
        if "none" not in self.strategies:
            raise ParamError(f"strategies must include 'none', the reference of every ratio; got {self.strategies}")
        for spec in self.strategies:
            try:
                parse(spec)
            except ValueError as e:
                raise ParamError(f"strategies: {e}") from None


@dataclass
class MicrobatchingParams:
    """Stage ``microbatching``: memory against the microbatch size b at full size, and accuracy and throughput of
    training with per-microbatch BatchNorm and its remedies (notebook 05). Training uses the ``baseline`` block."""

    INHERITS = "baseline"  # the resolved baseline block arrives as `train`

    profile: str = "smoke"
    seed: int = 0
    model: str = "wrn-28-2"  # the memory study's model, accounted at full size
    num_classes: int = 10
    in_channels: int = 3
    image_size: int = 32
    batch_size: int = 128  # B of the memory study
    memory_microbatches: list[int] = field(default_factory=lambda: [128, 32])  # b values accounted at batch B
    norms: list[str] = field(default_factory=lambda: ["batch", "group", "renorm"])
    train_microbatches: list[int] = field(default_factory=lambda: [0, 16])  # b values trained; 0 = b = B (no split)
    train_norms: list[str] = field(default_factory=lambda: ["batch", "group", "renorm"])  # trained, each at every b; a subset of norms
    train_seeds: list[int] = field(default_factory=lambda: [0])
    train: dict = field(default_factory=dict)  # the baseline block, resolved

    def __post_init__(self) -> None:
        from lowmem.microbatch import NORMS

        _check_choice("profile", self.profile, PROFILES)
        _check_model("model", self.model)
        _check_batch_sizes("batch_size", [self.batch_size])
        _check_batch_sizes("memory_microbatches", self.memory_microbatches)
        if max(self.memory_microbatches) > self.batch_size:
            raise ParamError(f"memory_microbatches must not exceed batch_size={self.batch_size}: {self.memory_microbatches}")
        for n in self.norms:
            _check_choice("norms", n, NORMS)
        if not self.train_norms or not set(self.train_norms) <= set(self.norms):
            raise ParamError(f"train_norms must be a non-empty subset of norms {self.norms}, got {self.train_norms!r}")
        if not self.train_microbatches or not all(isinstance(b, int) and b >= 0 for b in self.train_microbatches):
            raise ParamError(f"train_microbatches must be integers >= 0 (0 = no split), got {self.train_microbatches!r}")
        if not self.train_seeds or not all(isinstance(x, int) for x in self.train_seeds):
            raise ParamError(f"train_seeds must be a non-empty list of integers, got {self.train_seeds!r}")


@dataclass
class PrecisionParams:
    """Stage ``precision``: what each 16-bit mode stores, at full size, and what it costs in accuracy, skipped steps
    and step time (notebook 04). Training uses the ``baseline`` block."""

    INHERITS = "baseline"  # the resolved baseline block arrives as `train`

    profile: str = "smoke"
    seed: int = 0
    model: str = "wrn-28-2"  # the memory study's model, accounted at full size
    num_classes: int = 10
    in_channels: int = 3
    image_size: int = 32
    batch_size: int = 128
    modes: list[str] = field(default_factory=lambda: ["fp32", "mixed-bf16", "mixed-fp16", "half-bf16", "half-fp16"])
    # Microbatch sizes accounted at batch B: at small b the weights, gradients and optimizer state dominate, and
    # there the fp32 master copy of mixed precision shows.
    memory_microbatches: list[int] = field(default_factory=lambda: [128, 1])
    train_modes: list[str] = field(default_factory=lambda: ["fp32", "half-bf16"])  # trained at the active profile
    train_seeds: list[int] = field(default_factory=lambda: [0])
    timing_batch_size: int = 4  # real steps of `model` on `device`, modes interleaved
    timing_repeats: int = 1
    check_batch_size: int = 2  # accounted against measured, for real on `device`, for each trained mode
    device: str = "auto"
    train: dict = field(default_factory=dict)  # the baseline block, resolved

    def __post_init__(self) -> None:
        from lowmem.precision import MODES

        _check_choice("profile", self.profile, PROFILES)
        _check_model("model", self.model)
        _check_choice("device", self.device, DEVICES)
        for name in ("batch_size", "timing_batch_size", "timing_repeats", "check_batch_size"):
            _check_batch_sizes(name, [getattr(self, name)])
        _check_batch_sizes("memory_microbatches", self.memory_microbatches)
        if max(self.memory_microbatches) > self.batch_size:
            raise ParamError(f"memory_microbatches must not exceed batch_size={self.batch_size}: {self.memory_microbatches}")
        for name in ("modes", "train_modes"):
            for m in getattr(self, name):
                _check_choice(name, m, MODES)
            if "fp32" not in getattr(self, name):
                raise ParamError(f"{name} must include 'fp32', the reference of every ratio; got {getattr(self, name)}")
        if not self.train_seeds or not all(isinstance(x, int) for x in self.train_seeds):
            raise ParamError(f"train_seeds must be a non-empty list of integers, got {self.train_seeds!r}")


@dataclass
class SparsityParams:
    """Stage ``sparsity``: sparse 3x3 block convs (DSR and static), memory at full size with CSR storage, and
    accuracy and step time of real training (notebook 03). Training uses the ``baseline`` block."""

    INHERITS = "baseline"  # the resolved baseline block arrives as `train`

    profile: str = "smoke"
    seed: int = 0
    model: str = "wrn-28-2"  # the memory study's model, accounted at full size
    num_classes: int = 10
    in_channels: int = 3
    image_size: int = 32
    batch_size: int = 128
    memory_levels: list[float] = field(default_factory=lambda: [0.0, 0.5, 0.9])  # sparsities accounted; 0 = dense
    formats: list[list[int]] = field(default_factory=lambda: [[4, 4], [4, 2], [2, 2]])  # CSR (value, index) bytes
    check_batch_size: int = 2  # accounted against measured, for real on `device`
    train_levels: list[float] = field(default_factory=lambda: [0.0, 0.9])  # trained with DSR; 0 = the dense run
    static_levels: list[float] = field(default_factory=lambda: [0.9])  # trained with the static pattern
    train_seeds: list[int] = field(default_factory=lambda: [0])
    dsr_periods: list[int] = field(default_factory=lambda: [2, 4, 8, 16])  # steps, per phase (recipe: 100..800)
    dsr_reallocate: int = 20000  # per rewiring, for WRN-28-2 (the recipe's); scaled to the trained model
    timing_batch_size: int = 4
    timing_repeats: int = 1
    device: str = "auto"
    train: dict = field(default_factory=dict)  # the baseline block, resolved

    def __post_init__(self) -> None:
        _check_choice("profile", self.profile, PROFILES)
        _check_model("model", self.model)
        _check_choice("device", self.device, DEVICES)
        for name in ("batch_size", "check_batch_size", "timing_batch_size", "timing_repeats", "dsr_reallocate"):
            _check_batch_sizes(name, [getattr(self, name)])
        _check_batch_sizes("dsr_periods", self.dsr_periods)
        for name in ("memory_levels", "train_levels", "static_levels"):
            levels = getattr(self, name)
            if not isinstance(levels, list) or not all(isinstance(s, (int, float)) and 0 <= s < 1 for s in levels):
                raise ParamError(f"{name} must be a list of sparsities in [0, 1) (0 = dense), got {levels!r}")
        for name in ("memory_levels", "train_levels"):
            if 0 not in getattr(self, name):
                raise ParamError(f"{name} must include 0 (dense), the reference of every ratio; got {getattr(self, name)}")
        if not self.formats or not all(isinstance(f, list) and len(f) == 2 and f[0] in (2, 4) and f[1] in (2, 4) for f in self.formats):
            raise ParamError(f"formats must be [value_bytes, index_bytes] pairs, each 4 or 2, got {self.formats!r}")
        if not self.train_seeds or not all(isinstance(x, int) for x in self.train_seeds):
            raise ParamError(f"train_seeds must be a non-empty list of integers, got {self.train_seeds!r}")


STAGES: dict[str, type] = {
    "memory_profile": MemoryProfileParams,
    "baseline": BaselineParams,
    "checkpointing": CheckpointingParams,
    "microbatching": MicrobatchingParams,
    "precision": PrecisionParams,
    "sparsity": SparsityParams,
}


def resolve_device(name: str) -> torch.device:
    """'auto' is CUDA where available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but CUDA is not available; use device='auto' or 'cpu'")
    return torch.device(name)


def _pick(value: Any, profile: str) -> Any:
    if isinstance(value, dict) and set(value) == set(PROFILES):
        return value[profile]
    return value


def resolve(stage: str, params: dict[str, Any]) -> dict[str, Any]:
    """The flat, checked parameters of ``stage`` for the profile named in ``params['base']``."""
    _check_choice("stage", stage, tuple(STAGES))
    base = params.get("base", {})
    profile = base.get("profile")
    _check_choice("base.profile", profile, PROFILES)
    cls = STAGES[stage]
    known = {f.name for f in dataclasses.fields(cls)}
    block = params.get(stage, {})
    unknown = sorted(set(block) - known)
    if unknown:
        raise ParamError(f"unknown parameter(s) {unknown} in params.yaml block {stage!r}; known: {sorted(known)}")
    values = {"profile": profile, **{k: v for k, v in base.items() if k in known and k != "profile"}}
    values.update({k: _pick(v, profile) for k, v in block.items()})
    if hasattr(cls, "INHERITS"):
        values["train"] = resolve(cls.INHERITS, params)
    return dataclasses.asdict(cls(**values))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", help=f"one of {', '.join(STAGES)}")
    ap.add_argument("--params", default="params.yaml", type=Path)
    ap.add_argument("--out", type=Path, help="write here instead of stdout")
    args = ap.parse_args(argv)
    try:
        resolved = resolve(args.stage, yaml.safe_load(args.params.read_text()))
    except ParamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = yaml.safe_dump(resolved, sort_keys=False)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
