"""The parameters of the WRN studies' stages (notebooks 01, 03-06): what each table and figure accounts, trains
and times. Training runs take the ``baseline`` block (``lowmem.wrn.params``), resolved into their ``train`` field."""

from __future__ import annotations

from dataclasses import dataclass, field

from lowmem.config import DEVICES, PROFILES, ParamError, check_batch_sizes, check_choice, check_seeds, stage
from lowmem.techniques.checkpoint import parse as parse_checkpoint
from lowmem.techniques.microbatch import NORMS
from lowmem.techniques.precision import MODES
from lowmem.wrn.params import check_model


@dataclass
class FullSize:
    """What every WRN study's stage holds: the profile that resolved it (params.yaml's base), its seed, and the model
    whose memory it accounts at full size."""

    profile: str = "smoke"
    seed: int = 0  # seeds the weights and batch of the accounted and measured steps
    model: str = "wrn-28-2"  # the memory study's model, accounted at full size
    num_classes: int = 10
    in_channels: int = 3
    image_size: int = 32  # pixels per side

    def __post_init__(self) -> None:
        check_choice("profile", self.profile, PROFILES)
        check_model("model", self.model)
        for name in ("num_classes", "in_channels", "image_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ParamError(f"{name} must be a positive integer, got {v!r}")


@stage("memory_profile")
@dataclass
class MemoryProfileParams(FullSize):
    """Stage ``memory_profile``: where the memory of one WRN training step goes (notebook 01)."""

    lr: float = 0.1  # only so the optimizer step is the recipe's; memory does not depend on it
    accounted_batch_sizes: list[int] = field(default_factory=lambda: [1, 128])  # accounted at full size on meta
    measured_batch_sizes: list[int] = field(default_factory=lambda: [2])  # run for real on `device`
    reference_batch_size: int = 128  # the batch whose breakdown goes into the metrics; must be accounted
    device: str = "auto"  # where measured steps run: cuda if available under "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("device", self.device, DEVICES)
        check_batch_sizes("accounted_batch_sizes", self.accounted_batch_sizes)
        check_batch_sizes("measured_batch_sizes", self.measured_batch_sizes)
        if self.reference_batch_size not in self.accounted_batch_sizes:
            raise ParamError(
                f"reference_batch_size={self.reference_batch_size!r} must be one of accounted_batch_sizes {self.accounted_batch_sizes}"
            )


@stage("checkpointing")
@dataclass
class CheckpointingParams(FullSize):
    """Stage ``checkpointing``: strategies compared at full size, and timed (notebook 06)."""

    batch_size: int = 128  # accounted at full size on the meta device
    strategies: list[str] = field(default_factory=lambda: ["none", "block", "sqrt", "selective", "optimal-0.5"])
    timing_batch_size: int = 4  # real steps on `device`
    timing_repeats: int = 1  # timed steps per strategy (after one warm-up); the median is reported
    device: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("device", self.device, DEVICES)
        check_batch_sizes("batch_size", [self.batch_size])
        check_batch_sizes("timing_batch_size", [self.timing_batch_size])
        check_batch_sizes("timing_repeats", [self.timing_repeats])
        if "none" not in self.strategies:
            raise ParamError(f"strategies must include 'none', the reference of every ratio; got {self.strategies}")
        for spec in self.strategies:
            try:
                parse_checkpoint(spec)
            except ValueError as e:
                raise ParamError(f"strategies: {e}") from None


@stage("microbatching")
@dataclass
class MicrobatchingParams(FullSize):
    """Stage ``microbatching``: memory against the microbatch size b at full size, and accuracy and throughput of
    training with per-microbatch BatchNorm and its remedies (notebook 05). Training uses the ``baseline`` block."""

    INHERITS = "baseline"  # the resolved baseline block arrives as `train`

    batch_size: int = 128  # B of the memory study
    memory_microbatches: list[int] = field(default_factory=lambda: [128, 32])  # b values accounted at batch B
    norms: list[str] = field(default_factory=lambda: ["batch", "group", "renorm"])
    train_microbatches: list[int] = field(default_factory=lambda: [0, 16])  # b values trained; 0 = b = B (no split)
    train_norms: list[str] = field(default_factory=lambda: ["batch", "group", "renorm"])  # trained, each at every b; a subset of norms
    train_seeds: list[int] = field(default_factory=lambda: [0])
    train: dict = field(default_factory=dict)  # the baseline block, resolved

    def __post_init__(self) -> None:
        super().__post_init__()
        check_batch_sizes("batch_size", [self.batch_size])
        check_batch_sizes("memory_microbatches", self.memory_microbatches)
        if max(self.memory_microbatches) > self.batch_size:
            raise ParamError(f"memory_microbatches must not exceed batch_size={self.batch_size}: {self.memory_microbatches}")
        for n in self.norms:
            check_choice("norms", n, NORMS)
        if not self.train_norms or not set(self.train_norms) <= set(self.norms):
            raise ParamError(f"train_norms must be a non-empty subset of norms {self.norms}, got {self.train_norms!r}")
        if not self.train_microbatches or not all(isinstance(b, int) and b >= 0 for b in self.train_microbatches):
            raise ParamError(f"train_microbatches must be integers >= 0 (0 = no split), got {self.train_microbatches!r}")
        check_seeds("train_seeds", self.train_seeds)


@stage("precision")
@dataclass
class PrecisionParams(FullSize):
    """Stage ``precision``: what each 16-bit mode stores, at full size, and what it costs in accuracy, skipped steps
    and step time (notebook 04). Training uses the ``baseline`` block."""

    INHERITS = "baseline"  # the resolved baseline block arrives as `train`

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
        super().__post_init__()
        check_choice("device", self.device, DEVICES)
        for name in ("batch_size", "timing_batch_size", "timing_repeats", "check_batch_size"):
            check_batch_sizes(name, [getattr(self, name)])
        check_batch_sizes("memory_microbatches", self.memory_microbatches)
        if max(self.memory_microbatches) > self.batch_size:
            raise ParamError(f"memory_microbatches must not exceed batch_size={self.batch_size}: {self.memory_microbatches}")
        for name in ("modes", "train_modes"):
            for m in getattr(self, name):
                check_choice(name, m, MODES)
            if "fp32" not in getattr(self, name):
                raise ParamError(f"{name} must include 'fp32', the reference of every ratio; got {getattr(self, name)}")
        check_seeds("train_seeds", self.train_seeds)


@stage("sparsity")
@dataclass
class SparsityParams(FullSize):
    """Stage ``sparsity``: sparse 3x3 block convs (DSR and static), memory at full size with CSR storage, and
    accuracy and step time of real training (notebook 03). Training uses the ``baseline`` block."""

    INHERITS = "baseline"  # the resolved baseline block arrives as `train`

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
        super().__post_init__()
        check_choice("device", self.device, DEVICES)
        for name in ("batch_size", "check_batch_size", "timing_batch_size", "timing_repeats", "dsr_reallocate"):
            check_batch_sizes(name, [getattr(self, name)])
        check_batch_sizes("dsr_periods", self.dsr_periods)
        for name in ("memory_levels", "train_levels", "static_levels"):
            levels = getattr(self, name)
            if not isinstance(levels, list) or not all(isinstance(s, (int, float)) and 0 <= s < 1 for s in levels):
                raise ParamError(f"{name} must be a list of sparsities in [0, 1) (0 = dense), got {levels!r}")
        for name in ("memory_levels", "train_levels"):
            if 0 not in getattr(self, name):
                raise ParamError(f"{name} must include 0 (dense), the reference of every ratio; got {getattr(self, name)}")
        if not self.formats or not all(isinstance(f, list) and len(f) == 2 and f[0] in (2, 4) and f[1] in (2, 4) for f in self.formats):
            raise ParamError(f"formats must be [value_bytes, index_bytes] pairs, each 4 or 2, got {self.formats!r}")
        check_seeds("train_seeds", self.train_seeds)


PROXY_FIELDS = ("model", "epochs", "train_subset")  # what a proxy may change of the baseline block


@stage("proxy_noise")
@dataclass
class ProxyNoiseParams:
    """Stage ``proxy_noise``: how much the WRN quality proxy's test accuracy moves from seed to seed, at a few proxy
    sizes, and what interval on a quality difference that buys (notebook 10). Each proxy is the ``baseline`` block
    with some of ``PROXY_FIELDS`` changed, trained on ``seeds`` and tested on the full test split."""

    INHERITS = "baseline"  # the resolved baseline block arrives as `train`

    profile: str = "smoke"
    seed: int = 0
    proxies: list[dict] = field(default_factory=lambda: [{"name": "1 epoch"}])  # {name, and fields of PROXY_FIELDS}
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    test_subset: int = 5000  # the smaller test split compared with the full one, drawn as the baseline block draws it
    targets: list[float] = field(default_factory=lambda: [0.25, 0.4])  # interval half-widths (points) to size seeds for
    budget_minutes: float = 45.0  # pipeline minutes for quality runs: seeds x configurations x seconds per run must fit
    configurations: list[int] = field(default_factory=lambda: [8, 12])  # trained configurations to size that budget for
    train: dict = field(default_factory=dict)  # the baseline block, resolved

    def __post_init__(self) -> None:
        check_choice("profile", self.profile, PROFILES)
        if not self.proxies:
            raise ParamError("proxies must list at least one proxy, e.g. [{name: '3 epochs', epochs: 3}]")
        names = [px.get("name") if isinstance(px, dict) else None for px in self.proxies]
        if None in names or len(set(names)) != len(names):
            raise ParamError(f"proxies: each is a mapping with a unique 'name', got {self.proxies!r}")
        for px in self.proxies:
            unknown = set(px) - {"name", *PROXY_FIELDS}
            if unknown:
                raise ParamError(f"proxies: {px['name']!r} sets {sorted(unknown)}; a proxy may set only {PROXY_FIELDS}")
        if len(self.seeds) < 3 or len(set(self.seeds)) != len(self.seeds) or not all(isinstance(s, int) for s in self.seeds):
            raise ParamError(f"seeds must be 3 or more distinct integers (a spread needs them), got {self.seeds!r}")
        if not isinstance(self.test_subset, int) or self.test_subset <= 0:
            raise ParamError(f"test_subset must be a positive integer, got {self.test_subset!r}")
        if not self.targets or not all(isinstance(t, (int, float)) and t > 0 for t in self.targets):
            raise ParamError(f"targets must be positive interval half-widths in points, got {self.targets!r}")
        if not isinstance(self.budget_minutes, (int, float)) or self.budget_minutes <= 0:
            raise ParamError(f"budget_minutes must be positive, got {self.budget_minutes!r}")
        check_batch_sizes("configurations", self.configurations)
