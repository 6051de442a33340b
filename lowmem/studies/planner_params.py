"""Parameters of the planner's stage (notebook 12): which models the planner runs on, at which budgets, and which
models the cross-checks against PyTorch's tools take; and of the sharding stage (notebook 13)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lowmem.cli import models
from lowmem.studies import crosscheck
from lowmem.cli.models import SpecError
from lowmem.cli.plan import OPTIMIZER_STATE, Levers, budget_bytes
from lowmem.cli.profile import STEPS, request
from lowmem.config import PROFILES, ParamError, check_choice, stage
from lowmem.techniques import sharding

MODEL_KEYS = {"name", "model", "batch", "input", "optimizer"}  # one model: a Request's fields under a display name
# The planner's models may also say which optimizer-state settings its plan combines (lowmem.cli.plan.OPTIMIZER_STATE;
# default: the given optimizer only, since each more setting costs the stage as much time again), and which steps
# (lowmem.cli.profile.STEPS; default: the plain step only).
PLAN_KEYS = {"optimizer_state", "step"}


def levers(m: dict) -> Levers:
    """The levers the planner's stage combines for model entry ``m``."""
    return Levers(optimizer_state=tuple(m.get("optimizer_state", ["given"])), step=tuple(m.get("step", ["plain"])))


@stage("planner")
@dataclass
class PlannerParams:
    """Stage ``planner``: ``lowmem plan`` on ``models`` at each of ``budgets``, with each model's breakdown, and the
    cross-checks: the accountant against MemTracker on ``memtracker_families`` (``crosscheck.FAMILIES``), the DP
    checkpoint planner against PyTorch's SAC integer program on ``sac_models``; ``workers`` processes at once."""

    profile: str = "smoke"
    seed: int = 0
    models: list[dict] = field(default_factory=lambda: [
        {"name": "1-d CNN", "model": "lowmem.cli.examples:conv1d", "batch": 8, "input": "8x128", "optimizer": "adam"}])
    budgets: list[str] = field(default_factory=lambda: ["600KiB", "1GiB"])
    memtracker_families: list[str] = field(default_factory=lambda: ["1-d convolutions"])
    sac_models: list[dict] = field(default_factory=lambda: [
        {"name": "WRN-10-1", "model": "wrn:wrn-10-1", "batch": 8, "input": "3x32x32", "optimizer": "sgd-momentum"}])
    workers: int = 1  # processes that share the accounting (lowmem.studies.planner.run); no number depends on it

    def __post_init__(self) -> None:
        check_choice("profile", self.profile, PROFILES)
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ParamError(f"workers must be a whole number of processes, at least 1 (e.g. this machine's cores), got {self.workers!r}")
        for key in ("models", "sac_models"):
            entries = getattr(self, key)
            if not isinstance(entries, list) or not entries:
                raise ParamError(f"{key} must list at least one model, e.g. [{{name: ResNet-50, model: torchvision:resnet50, "
                                 "batch: 256, input: 3x224x224, optimizer: sgd-momentum}]")
            for m in entries:
                extra = PLAN_KEYS if key == "models" else set()
                if not isinstance(m, dict) or not MODEL_KEYS <= set(m) <= MODEL_KEYS | extra:
                    raise ParamError(f"{key}: each model is a mapping with exactly {sorted(MODEL_KEYS)}"
                                     f"{f', and optionally {sorted(extra)}' if extra else ''}, got {m!r}")
                states = m.get("optimizer_state", ["given"])
                if not isinstance(states, list) or "given" not in states or not set(states) <= set(OPTIMIZER_STATE):
                    raise ParamError(f"{key}: {m['name']!r}: optimizer_state must list 'given' and some of "
                                     f"{list(OPTIMIZER_STATE)}, got {states!r}")
                steps = m.get("step", ["plain"])
                if not isinstance(steps, list) or "plain" not in steps or not set(steps) <= set(STEPS):
                    raise ParamError(f"{key}: {m['name']!r}: step must list 'plain' and optionally 'fused', got {steps!r}")
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


LEVER_KEYS = {"checkpoint", "microbatch", "precision"}  # the exact or cheap levers sharding is combined with here


@stage("sharding")
@dataclass
class ShardingParams:
    """Stage ``sharding`` (notebook 13): per-device memory of ``wrn`` (under each of ``wrn_levers``) and of the
    DynamicConv recipe (full size, ``max_tokens`` per update in all) over ``devices``, in each of ``modes``
    (``lowmem.techniques.sharding``), accounted with a fake process group; and one real run of ``wrn`` at
    ``run_batch`` on ``run_devices`` gloo processes (``lowmem.studies.shard_run``), measured against the account."""

    profile: str = "smoke"
    seed: int = 0
    wrn: dict = field(default_factory=lambda: {"name": "WRN-10-1", "model": "wrn:wrn-10-1", "batch": 8, "input": "3x32x32",
                                               "optimizer": "sgd-momentum"})
    wrn_levers: dict[str, dict] = field(default_factory=lambda: {"plain": {}})  # name -> Techniques fields
    devices: list[int] = field(default_factory=lambda: [1, 2])
    modes: list[str] = field(default_factory=lambda: list(sharding.MODES))
    recipe_args: list[str] = field(default_factory=list)  # from translation_train: the full-size model
    max_tokens: int = 4000  # from translation_train: tokens per update, split over the devices
    src_vocab: int = 8848  # from translation_memory
    tgt_vocab: int = 6632
    reference_length: int = 32  # from translation_memory: tokens per sentence
    run_batch: int = 4  # the gloo run's global batch (small: two processes share this machine's cores)
    run_devices: int = 2
    run_steps: int = 4  # per mode; all but the first are measured and timed
    interconnects: dict[str, float] = field(default_factory=dict)  # name -> bytes per second, for the time estimate

    FROM = {"recipe_args": "translation_train", "max_tokens": "translation_train", "src_vocab": "translation_memory",
            "tgt_vocab": "translation_memory", "reference_length": "translation_memory"}

    def __post_init__(self) -> None:
        check_choice("profile", self.profile, PROFILES)
        if not isinstance(self.wrn, dict) or set(self.wrn) != MODEL_KEYS:
            raise ParamError(f"wrn must be a mapping with exactly {sorted(MODEL_KEYS)}, got {self.wrn!r}")
        if not self.devices or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in self.devices):
            raise ParamError(f"devices must list integers >= 1, e.g. [1, 2, 4, 8], got {self.devices!r}")
        if 1 not in self.devices:
            raise ParamError("devices must include 1: each reduction is over the single-device step")
        for d in self.devices:
            for what, n in (("wrn.batch", self.wrn["batch"]), ("max_tokens", self.max_tokens)):
                if n % d:
                    raise ParamError(f"{what} = {n} does not split evenly over {d} devices; use devices that divide it")
        unknown = sorted(set(self.modes) - set(sharding.MODES))
        if not self.modes or unknown:
            raise ParamError(f"modes must be some of {list(sharding.MODES)}, got {self.modes!r}")
        for name, lev in self.wrn_levers.items():
            if not isinstance(lev, dict) or set(lev) - LEVER_KEYS:
                raise ParamError(f"wrn_levers.{name}: use only {sorted(LEVER_KEYS)}, got {lev!r}")
        if "plain" not in self.wrn_levers or self.wrn_levers["plain"]:
            raise ParamError("wrn_levers must include 'plain: {}', the step without levers")
        if self.run_devices < 2 or self.run_batch % self.run_devices:
            raise ParamError(f"run_devices must be >= 2 and divide run_batch, got {self.run_devices} and {self.run_batch}")
        if self.run_steps < 2:
            raise ParamError("run_steps must be at least 2 (the first step is not timed)")
        if any(not isinstance(v, (int, float)) or v <= 0 for v in self.interconnects.values()):
            raise ParamError(f"interconnects: each is a name and a bandwidth in bytes per second > 0, got {self.interconnects!r}")
