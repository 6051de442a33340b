"""The combination study's grid (Sohoni et al. 2019, the combination study behind 60.7x and 8.7x): sparsity x
precision x microbatch x checkpoint for each task, with levers beyond the paper (both: the bits of saved activations;
WRN: the optimizer, 8-bit momentum, and Kahan-compensated bf16 as a precision setting; DynamicConv: 8-bit Adam and
Kahan's all-bf16 as precision settings): its parameters (``CombinationsParams``), and each combination's
configuration, name and run options. The sweep that accounts the grid is ``combination_memory``, the choice of what
trains ``combination_search``, the training and the stage's command ``combinations``.

- WRN: every combination is a ``lowmem.wrn.train.Techniques``; memory is WRN-28-2's step at B = 128, step time is the
  profile's trained model at its batch, and a chosen combination trains with ``lowmem.wrn.train.train``.
- DynamicConv: every combination is a set of fairseq-train options of lowmem's plugin (``lowmem.studies.translation``);
  memory is the full-size model's update at the recipe's tokens, and a chosen combination trains with fairseq-train.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lowmem.config import PROFILES, ParamError, check_seeds, stage
from lowmem.dynamicconv.params import TranslationTechniquesParams
from lowmem.studies import params as _study_params  # noqa: F401  (registers stage sparsity, which ``derived`` reads)
from lowmem.studies.quality_model import (BEYOND_PAPER_DYNAMICCONV, EXACT, KAHAN_PRECISIONS_WRN, LEVERS_STAGES, dims,
                                          techniques_config)
from lowmem.techniques import compress, precision, registry
from lowmem.wrn import memory as wrn_memory
from lowmem.wrn.train import Techniques

TASKS = ("wrn", "dynamicconv")
# The grid's dimensions (dims) and EXACT: lowmem.studies.quality_model, which the frontier reads without this module's imports.


@dataclass
class CombinationsParams:
    """Blocks ``combinations_wrn`` and ``combinations_dynamicconv`` of params.yaml: the grid, what is trained, and
    the quality budgets of the tables."""

    task: str = "wrn"
    profile: str = "smoke"
    seed: int = 0
    sparsity: list[float] = field(default_factory=lambda: [0.0, 0.9])  # 0 = dense
    precision: list[str] = field(default_factory=lambda: ["fp32", "half-bf16"])
    microbatch: list[int] = field(default_factory=lambda: [0, 8])  # WRN: examples per pass, 0 = whole batch; DynamicConv: --microbatches
    checkpoint: list[str] = field(default_factory=lambda: ["none", "sqrt"])  # WRN strategies; DynamicConv: none or layers
    # Beyond the paper: bits of each activation saved for backward (lowmem.techniques.compress; DynamicConv: the
    # plugin's --activation-bits), 0 = as computed
    activation_bits: list[int] = field(default_factory=lambda: [0])
    # WRN, beyond the paper: the optimizer (lowmem.techniques.optimizers; bnb-sgd8bit: momentum in 8 bits). Kahan's
    # optimi-sgd enters as a precision setting (quality_model.KAHAN_PRECISIONS_WRN), where its weights are 16-bit.
    optimizer: list[str] = field(default_factory=lambda: ["sgd"])
    singles: list[dict[str, Any]] = field(default_factory=list)  # single-technique points always trained, e.g. {sparsity: 0.9}
    levels: list[float] = field(default_factory=lambda: [4.0])  # memory reductions (x) at which one combination is trained
    trained_elsewhere: list[str] = field(default_factory=list)  # DynamicConv: configurations whose runs come from stage 08
    slots: int = 3  # slots of the DVC matrix stage; must equal what ``select`` picks (dvc.yaml lists 0 .. slots-1)
    budgets: list[float] = field(default_factory=lambda: [0.1, 0.4, 1.0])  # quality losses of the budget table
    train_seeds: list[int] = field(default_factory=lambda: [0])  # WRN: seeds of each trained combination
    # WRN: pick the levels' combinations by predicted quality (``search``) once the singles have trained, instead of
    # by fewest techniques from memory alone; the singles must then be lossy levers, one setting each.
    search: bool = False
    search_max: bool = True  # with search: one more slot per pass, the largest reduction whose quality can be predicted
    # with search: after the picks among every lever of the grid, the same levels (and maximum) among the paper's
    # levers alone, so that the headline's rows "the paper's" rest on trained combinations of them too
    search_paper: bool = False
    # with search: stages of levers beyond the paper (metrics/<stage>.json, trained at this profile on train_seeds)
    # whose arms that set one setting of the grid alone give that setting's effect, paired by seed with the study's
    # own baseline, where no single here trains it (e.g. bnb-sgd8bit, half-bf16-kahan)
    effects_from: list[str] = field(default_factory=list)
    timing_repeats: int = 1  # WRN: timed steps per combination (after a warm-up), all combinations in turn
    workers: int = 1  # processes that account the grid (WRN's timing then runs in one, alone); the table is the same
    sparse_format: str = "csr16"  # WRN: accounted CSR index width (16-bit where every index fits)
    wrn: dict = field(default_factory=dict)  # WRN: the memory study's shapes (block ``sparsity``: model, batch, ...)
    train: dict = field(default_factory=dict)  # WRN: the baseline block, resolved (the trained runs' recipe)
    dsr: dict = field(default_factory=dict)  # WRN: block ``sparsity``'s DSR periods and reallocation
    translation: dict = field(default_factory=dict)  # DynamicConv: translation_techniques, resolved

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ParamError(f"task={self.task!r} is not one of {', '.join(TASKS)}")
        stage_task = type(self).__dataclass_fields__["task"].default  # a task's stage (combinations_<task>) fixes it
        if type(self) is not CombinationsParams and self.task != stage_task:
            raise ParamError(f"combinations_{stage_task}.task must be {stage_task}, got {self.task!r}")
        if self.profile not in PROFILES:
            raise ParamError(f"base.profile={self.profile!r} is not allowed; use one of: {', '.join(PROFILES)}")
        for name in dims(self.task):
            values = getattr(self, name)
            if not isinstance(values, list) or not values:
                raise ParamError(f"combinations_{self.task}.{name} must be a non-empty list, got {values!r}")
        for cfg in self.singles:
            if not isinstance(cfg, dict) or len(cfg) != 1 or set(cfg) - set(dims(self.task)):
                raise ParamError(f"combinations_{self.task}.singles: each is one technique's setting, {{name: value}} with a name among {dims(self.task)}; got {cfg!r}")
        self._check_wrn_levers()
        bad = [b for b in self.activation_bits if b != 0 and b not in compress.BITS]
        if bad:
            raise ParamError(f"combinations_{self.task}.activation_bits: {bad} not allowed; use 0 (off) or one of "
                             f"{', '.join(map(str, compress.BITS))}")
        if (self.sparsity[0] != 0 or self.precision[0] != "fp32" or self.microbatch[0] not in (0, 1)
                or self.checkpoint[0] != "none" or self.activation_bits[0] != 0 or self.optimizer[0] != "sgd"):
            raise ParamError(f"combinations_{self.task}: each list must start with its 'off' value (sparsity 0, "
                             f"precision fp32, microbatch {'0' if self.task == 'wrn' else '1'}, checkpoint none, "
                             "activation_bits 0, optimizer sgd): the baseline is the first combination")
        if self.task == "wrn" and self.beyond_paper_in_grid() and not self.search:
            raise ParamError("combinations_wrn: a lever beyond the paper in the grid (activation_bits, optimizer or a "
                             "Kahan precision) needs search: true (the levels picked by fewest techniques would mix it "
                             "into the paper's rows)")
        if bad := [s for s in self.effects_from if s not in LEVERS_STAGES]:
            raise ParamError(f"combinations_{self.task}.effects_from: {bad} not allowed; use stages among "
                             f"{', '.join(LEVERS_STAGES)}")
        if self.effects_from and not (self.task == "wrn" and self.search):
            raise ParamError(f"combinations_{self.task}.effects_from: lever effects are the WRN search's; it needs "
                             "task wrn with search: true")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ParamError(f"combinations_{self.task}.workers must be an integer >= 1 (processes that account the "
                             f"grid), got {self.workers!r}")
        if self.search_paper and not self.search:
            raise ParamError(f"combinations_{self.task}.search_paper: a second pass of the search needs search: true")
        if not self.levels or sorted(self.levels) != self.levels or self.levels[0] <= 1:
            raise ParamError(f"combinations_{self.task}.levels must be increasing reductions above 1, got {self.levels!r}")
        check_seeds(f"combinations_{self.task}.train_seeds", self.train_seeds)
        if self.search:
            if self.task != "wrn":
                raise ParamError(f"combinations_{self.task}.search: the quality-aware search is WRN's only")
            if self.search_paper and not self.beyond_paper_in_grid():
                raise ParamError(f"combinations_{self.task}.search_paper: the grid holds the paper's levers only "
                                 "(activation_bits: [0], optimizer: [sgd], no Kahan precision), so one search covers "
                                 "them; set it to false")
            exact = [c for c in self.singles if set(c) & set(EXACT)]
            if exact:
                raise ParamError(f"combinations_wrn.singles: {exact} are exact levers (tested equal to the plain "
                                 "step), whose quality effect is zero by test; with search, list lossy levers only")


    def beyond_paper_in_grid(self) -> bool:
        """Whether the grid's lists hold a lever beyond the paper."""
        return (self.activation_bits != [0] or self.optimizer != ["sgd"]
                or any(m in KAHAN_PRECISIONS_WRN for m in self.precision))

    def _check_wrn_levers(self) -> None:
        """The optimizer list, and WRN's Kahan precision settings: checked before any compute, with what to use."""
        if self.task == "dynamicconv":
            if self.optimizer != ["sgd"]:
                raise ParamError("combinations_dynamicconv.optimizer: DynamicConv's optimizer levers are precision "
                                 f"settings ({', '.join(BEYOND_PAPER_DYNAMICCONV)}); remove the optimizer list")
            return
        kahan = {f["optimizer"] for f in KAHAN_PRECISIONS_WRN.values()}  # a precision setting's, not a lever of its own
        allowed = [o for o in registry.optimizers() if o not in kahan]
        for o in self.optimizer:
            if o not in allowed:
                hint = (" (Kahan's optimi-sgd is the precision setting " + ", ".join(KAHAN_PRECISIONS_WRN) + ")"
                        if o in kahan else "")
                raise ParamError(f"combinations_wrn.optimizer: {o!r} is not allowed; use one of {', '.join(allowed)}{hint}")
        for o in {*self.optimizer, *(f["optimizer"] for m, f in KAHAN_PRECISIONS_WRN.items() if m in self.precision)}:
            try:
                registry.check_optimizer(o)  # a missing library stops here, before the sweep's hour of accounting
            except ValueError as e:
                raise ParamError(f"combinations_wrn: {e}") from None
        for m in self.precision:
            try:
                precision.parse(KAHAN_PRECISIONS_WRN.get(m, {"precision": m})["precision"])
            except ValueError as e:
                raise ParamError(f"combinations_wrn.precision: {m!r}: {e}; Kahan's settings: "
                                 f"{', '.join(KAHAN_PRECISIONS_WRN)}") from None


@stage("combinations_wrn")
@dataclass
class WrnCombinationsParams(CombinationsParams):
    """Block ``combinations_wrn``; the trained runs' recipe, DSR's schedule and the full-size shape are stage
    sparsity's (``derived``)."""

    task: str = "wrn"

    @staticmethod
    def derived(resolved: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        sp = resolved("sparsity")
        return {"train": sp["train"], "dsr": {"dsr_periods": sp["dsr_periods"], "dsr_reallocate": sp["dsr_reallocate"]},
                "wrn": {k: sp[k] for k in ("model", "num_classes", "in_channels", "image_size", "batch_size", "device")}}


@stage("combinations_dynamicconv")
@dataclass
class DynamicConvCombinationsParams(CombinationsParams):
    """Block ``combinations_dynamicconv``; the runs' settings are stage translation_techniques' (``derived``)."""

    task: str = "dynamicconv"

    @staticmethod
    def derived(resolved: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        return {"translation": resolved("translation_techniques")}


def accountable(p: CombinationsParams, cfg: dict[str, Any]) -> bool:
    """Whether the accountant can account ``cfg``, and whether it is one run. The plugin's mixed-bf16 accounts on
    fake tensors, and DSR draws its pattern from values that they lack, so lowmem.dynamicconv.memory refuses the two
    together. WRN's Kahan precision is torch-optimi's SGD, so it takes no other optimizer."""
    if p.task == "wrn":
        return not (cfg.get("precision") in KAHAN_PRECISIONS_WRN and cfg.get("optimizer"))
    return not (cfg.get("precision") == "mixed-bf16" and cfg.get("sparsity"))


def grid(p: CombinationsParams) -> list[dict[str, Any]]:
    """Every accountable combination of the task's lists (``dims``), the baseline first; only a technique that is on
    appears in a config."""
    off = {d: getattr(p, d)[0] for d in dims(p.task)}
    out = []
    for values in itertools.product(*(getattr(p, d) for d in dims(p.task))):
        cfg = {d: v for d, v in zip(dims(p.task), values) if v != off[d]}
        if accountable(p, cfg):
            out.append(cfg)
    return out


def name(p: CombinationsParams, cfg: dict[str, Any]) -> str:
    """A readable, unique name; DynamicConv's single techniques are named as in stage 08 (translation_techniques)."""
    if not cfg:
        return "baseline"
    parts = []
    if "sparsity" in cfg:
        parts.append(f"sparsity-{cfg['sparsity']:g}")
    if "precision" in cfg:
        parts.append(cfg["precision"])
    if "microbatch" in cfg:
        parts.append(f"microbatch-{cfg['microbatch']}")  # DynamicConv's too: the plugin's exact --microbatches
    if "checkpoint" in cfg:
        parts.append(f"checkpoint-{cfg['checkpoint']}" if p.task == "wrn" else "checkpoint")
    if "activation_bits" in cfg:  # named as stage levers_train's arms
        parts.append(f"activations-{cfg['activation_bits']}")
    if "optimizer" in cfg:  # named as stage levers_state_train's arms
        parts.append(cfg["optimizer"])
    return "+".join(parts)


def mildness(p: CombinationsParams, cfg: dict[str, Any]) -> int:
    """How far a combination moves training from the baseline, for ``select``: the sum of each setting's rank in
    its list (a list runs from the 'off' value to the strongest setting)."""
    return sum(getattr(p, d).index(v) for d, v in cfg.items())


def trainable(p: CombinationsParams, precision_mode: str) -> bool:
    """Whether DynamicConv trains in ``precision_mode`` here. fairseq 0.12's --fp16 needs CUDA and
    --memory-efficient-fp16 fails on the CPU at its first overflow (docs/translation.md); the plugin's bf16 modes train anywhere."""
    if precision_mode not in FAIRSEQ_16BIT:
        return True
    return torch.cuda.is_available() and p.translation.get("device", "auto") != "cpu"


FAIRSEQ_16BIT = ("fp16", "memory-efficient-fp16")  # fairseq's own flags; other precision settings are stage 08's names


def wrn_techniques(p: CombinationsParams, cfg: dict[str, Any], trained_batch: int | None = None) -> Techniques:
    """The trainer's configuration. A microbatch at least as large as the trained batch is no microbatching."""
    b = cfg.get("microbatch", 0)
    if trained_batch is not None and b >= trained_batch:
        b = 0
    t = techniques_config("wrn", cfg)
    return Techniques(sparsity=t.get("sparsity", 0.0), precision=t.get("precision", "fp32"), microbatch=b,
                      checkpoint=t.get("checkpoint", "none"), activation_bits=t.get("activation_bits", 0),
                      optimizer=t.get("optimizer", "sgd"), sparse_format=p.sparse_format,
                      dsr_periods=tuple(p.dsr.get("dsr_periods", (100, 200, 400, 800))),
                      dsr_reallocate=p.dsr.get("dsr_reallocate", 20000))


def wrn_shape(p: CombinationsParams) -> wrn_memory.Shape:
    """The full-size step whose memory the WRN grid accounts (``p.wrn``: WRN-28-2 at B = 128)."""
    w = p.wrn
    return wrn_memory.Shape(w["model"], w["batch_size"], w["num_classes"], w["in_channels"], w["image_size"])


def translation_options(p: CombinationsParams, cfg: dict[str, Any]) -> list[str]:
    """fairseq-train options of ``cfg`` for lowmem's plugin. With --fp16 the sparse layers are static: DSR's moving
    pattern cannot live in fairseq's flattened fp32 master copy (the plugin refuses it); the bytes are the same."""
    t = p.translation
    args: list[str] = []
    if cfg.get("sparsity"):
        args += ["--sparsity", f"{cfg['sparsity']:g}"]
        if cfg.get("precision") == "fp16":
            args += ["--sparse-method", "static"]
    mode = cfg.get("precision")
    if mode in FAIRSEQ_16BIT:
        args += [f"--{mode}"]
    elif mode:  # the plugin's bf16, with its options as stage 08 names them (mixed-bf16, all-bf16)
        if mode not in t["techniques"]:
            raise ParamError(f"combinations_dynamicconv.precision: {mode!r} is neither fairseq's ({', '.join(FAIRSEQ_16BIT)}) "
                             f"nor a technique of translation_techniques.techniques ({', '.join(t['techniques'])})")
        args += list(t["techniques"][mode])
    k = cfg.get("microbatch", 1)
    if k > 1:  # the baseline's own batches in k sub-batches (not --update-freq, which forms other batches)
        args += ["--microbatches", str(k)]
    if cfg.get("checkpoint"):
        args += ["--checkpoint-activations"]
    if cfg.get("activation_bits"):
        args += ["--activation-bits", str(cfg["activation_bits"])]
    return args


def translation_params(p: CombinationsParams, configs: list[dict[str, Any]], trained: list[str] | None = None) -> TranslationTechniquesParams:
    techniques = {name(p, c): translation_options(p, c) for c in configs}
    names = ["baseline", *(trained or [])]
    return TranslationTechniquesParams(**{**p.translation, "techniques": techniques, "trained": names, "timed": names})

