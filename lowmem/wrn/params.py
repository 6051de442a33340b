"""The WRN trainer's parameters: stage ``baseline``, also the base of every WRN training run of the studies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowmem.config import DEVICES, PROFILES, ParamError, check_batch_sizes, check_choice, check_seeds, stage
from lowmem.wrn.data import DATASETS
from lowmem.wrn.models import parse_model_name


def check_model(name: str, value: Any) -> None:
    try:
        parse_model_name(value)
    except ValueError as e:
        raise ParamError(f"{name}: {e}") from None


@stage("baseline")
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
        check_choice("profile", self.profile, PROFILES)
        check_choice("dataset", self.dataset, DATASETS)
        if not isinstance(self.augment, bool):
            raise ParamError(f"augment must be true or false, got {self.augment!r}")
        check_model("model", self.model)
        check_choice("device", self.device, DEVICES)
        check_batch_sizes("batch_size", [self.batch_size])
        check_seeds("seeds", self.seeds)
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
