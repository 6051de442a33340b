"""Parameters of the planner's stage (notebook 12): which models the planner runs on, at which budgets, and which
models the cross-checks against PyTorch's tools take."""

from __future__ import annotations

from dataclasses import dataclass, field

from lowmem.cli import crosscheck, models
from lowmem.cli.models import SpecError, shape
from lowmem.cli.plan import budget_bytes
from lowmem.cli.profile import Request
from lowmem.config import PROFILES, ParamError, check_choice, stage

MODEL_KEYS = {"name", "model", "batch", "input", "optimizer"}  # one model: a Request's fields under a display name


def request(m: dict) -> Request:
    """A model entry of params.yaml as the profile's Request."""
    return Request(m["model"], m["batch"], shape(str(m["input"])), m["optimizer"])


@stage("planner")
@dataclass
class PlannerParams:
    """Stage ``planner``: ``lowmem plan`` on ``models`` at each of ``budgets``, with each model's breakdown, and the
    cross-checks: the accountant against MemTracker on ``memtracker_families`` (``crosscheck.FAMILIES``), the DP
    checkpoint planner against PyTorch's SAC integer program on ``sac_models``."""

    profile: str = "smoke"
    seed: int = 0
    models: list[dict] = field(default_factory=lambda: [
        {"name": "WRN-10-1", "model": "wrn:wrn-10-1", "batch": 8, "input": "3x32x32", "optimizer": "sgd-momentum"}])
    budgets: list[str] = field(default_factory=lambda: ["2MiB", "4MiB"])
    memtracker_families: list[str] = field(default_factory=lambda: ["1-d convolutions"])
    sac_models: list[dict] = field(default_factory=lambda: [
        {"name": "WRN-10-1", "model": "wrn:wrn-10-1", "batch": 8, "input": "3x32x32", "optimizer": "sgd-momentum"}])

    def __post_init__(self) -> None:
        check_choice("profile", self.profile, PROFILES)
        for key in ("models", "sac_models"):
            entries = getattr(self, key)
            if not isinstance(entries, list) or not entries:
                raise ParamError(f"{key} must list at least one model, e.g. [{{name: ResNet-50, model: torchvision:resnet50, "
                                 "batch: 256, input: 3x224x224, optimizer: sgd-momentum}]")
            for m in entries:
                if not isinstance(m, dict) or set(m) != MODEL_KEYS:
                    raise ParamError(f"{key}: each model is a mapping with exactly {sorted(MODEL_KEYS)}, got {m!r}")
                try:
                    models.factory(request(m).spec)  # names a torchvision model that does not exist, before any work
                except SpecError as e:
                    raise ParamError(f"{key}: {m['name']!r}: {e}") from None
        if not self.budgets:
            raise ParamError("budgets must list at least one budget, e.g. [1GiB, 4GiB, 16GiB]")
        for b in self.budgets:
            try:
                budget_bytes(str(b))
            except SpecError as e:
                raise ParamError(f"budgets: {e}") from None
        unknown = set(self.memtracker_families) - set(crosscheck.FAMILIES)
        if unknown:
            raise ParamError(f"memtracker_families: {sorted(unknown)} unknown; use some of {list(crosscheck.FAMILIES)}")
