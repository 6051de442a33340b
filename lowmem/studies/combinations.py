"""The four techniques combined (Sohoni et al. 2019, the combination study behind 60.7x and 8.7x): a grid of
sparsity x precision x microbatch x checkpoint for each task, with levers beyond the paper (both: the bits of saved
activations; WRN: the optimizer, 8-bit momentum, and Kahan-compensated bf16 as a precision setting; DynamicConv: 8-bit
Adam and Kahan's all-bf16 as precision settings), accounted at full size, timed at the active profile (WRN), and a
subset chosen for training. WRN's accounted rows are kept by key in ``data/combinations/wrn_memory.csv``, so that a
grid that grows, or a sweep that was stopped, accounts only what it has not.

- WRN: every combination is a ``lowmem.wrn.train.Techniques``; memory is WRN-28-2's step at B = 128, step time is the
  profile's trained model at its batch, and a chosen combination trains with ``lowmem.wrn.train.train``.
- DynamicConv: every combination is a set of fairseq-train options of lowmem's plugin (``lowmem.studies.translation``);
  memory is the full-size model's update at the recipe's tokens, and a chosen combination trains with fairseq-train.

The chosen subset, from memory alone so that it does not move with timing noise: the baseline and the single
techniques named in params.yaml, then for each memory level the combination that reaches it with the fewest and
mildest techniques (see ``select``). Each one is a slot of a DVC ``matrix`` stage.

    python -m lowmem.studies.combinations sweep wrn|dynamicconv [--params params.yaml]
    python -m lowmem.studies.combinations account wrn   (the accounting alone, into data/combinations/wrn_memory.csv)
    python -m lowmem.studies.combinations train wrn|dynamicconv --slot N [--params params.yaml]
    python -m lowmem.studies.combinations search wrn   (then train the slots it picked)

The quality-aware search (WRN, ``search: true``): the singles are lossy levers trained alone on the same seeds as
the baseline; each one's paired change is its effect, a combination's predicted change is the sum of its levers'
effects (exact levers, ``EXACT``, add zero), and at each memory level the combination with the smallest predicted
loss is trained, then the largest reduction that can be predicted; with ``search_paper``, the same again among the
paper's levers alone. A setting that no single trains can take its effect from a levers stage's arm that trained it
alone (``effects_from``). A slot whose persisted metrics already hold its configuration trained with the same run
keys is kept, so a search whose picks moved retrains only what changed. Predicted against measured is notebook 09's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import itertools
import json
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml
from tqdm import tqdm

from lowmem import runs
from lowmem.config import PROFILES, ParamError, pick, resolve, resolve_device
from lowmem.dynamicconv import translation
from lowmem.dynamicconv.params import TranslationEvaluateParams, TranslationTechniquesParams
from lowmem.memory.accounting import CATEGORIES, MIB
from lowmem.studies import params as _study_params  # noqa: F401  (registers stage sparsity, which resolve_task reads)
from lowmem.studies import quality
from lowmem.studies.quality_model import (BEYOND_PAPER_DYNAMICCONV, EXACT, KAHAN_PRECISIONS_WRN, LEVERS_STAGES,
                                          arm_change, beyond_paper_rows, dims, grid_config, paired_change, predict,
                                          selection, techniques_config)
from lowmem.techniques import compress, optimizers, precision
from lowmem.wrn import memory as wrn_memory
from lowmem.wrn.data import load
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.recipe import make_optimizer
from lowmem.wrn.step import wrn_model
from lowmem.wrn.train import Techniques, store_run, summarize, train, train_step

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
        if not self.train_seeds or not all(isinstance(s, int) for s in self.train_seeds):
            raise ParamError(f"combinations_{self.task}.train_seeds must be a non-empty list of integers")
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
        allowed = [o for o in optimizers.OPTIMIZERS if o not in kahan]
        for o in self.optimizer:
            if o not in allowed:
                hint = (" (Kahan's optimi-sgd is the precision setting " + ", ".join(KAHAN_PRECISIONS_WRN) + ")"
                        if o in kahan else "")
                raise ParamError(f"combinations_wrn.optimizer: {o!r} is not allowed; use one of {', '.join(allowed)}{hint}")
        for o in {*self.optimizer, *(f["optimizer"] for m, f in KAHAN_PRECISIONS_WRN.items() if m in self.precision)}:
            try:
                optimizers.check(o)  # a missing library stops here, before the sweep's hour of accounting
            except ValueError as e:
                raise ParamError(f"combinations_wrn: {e}") from None
        for m in self.precision:
            try:
                precision.parse(KAHAN_PRECISIONS_WRN.get(m, {"precision": m})["precision"])
            except ValueError as e:
                raise ParamError(f"combinations_wrn.precision: {m!r}: {e}; Kahan's settings: "
                                 f"{', '.join(KAHAN_PRECISIONS_WRN)}") from None


def resolve_task(task: str, params: dict[str, Any]) -> CombinationsParams:
    """The checked parameters of ``task``'s combination study for the profile of ``params['base']``."""
    profile = params.get("base", {}).get("profile")
    block = {k: pick(v, profile) for k, v in params.get(f"combinations_{task}", {}).items()}
    known = {f.name for f in dataclasses.fields(CombinationsParams)}
    if set(block) - known:
        raise ParamError(f"unknown parameter(s) {sorted(set(block) - known)} in block combinations_{task}; known: {sorted(known)}")
    extra: dict[str, Any] = {}
    if task == "wrn":
        sp = resolve("sparsity", params)
        extra = {"train": sp["train"], "dsr": {"dsr_periods": sp["dsr_periods"], "dsr_reallocate": sp["dsr_reallocate"]},
                 "wrn": {k: sp[k] for k in ("model", "num_classes", "in_channels", "image_size", "batch_size", "device")}}
    elif task == "dynamicconv":
        extra = {"translation": resolve("translation_techniques", params)}
    return CombinationsParams(task=task, profile=profile, seed=params.get("base", {}).get("seed", 0), **block, **extra)


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


def select(p: CombinationsParams, memory: pd.DataFrame) -> list[dict[str, Any]]:
    """The combinations to train, in slot order: the baseline, ``p.singles``, then for each level in ``p.levels``
    the not yet chosen combination that reaches it with the fewest techniques, then the mildest settings (ties: the
    larger reduction). DynamicConv leaves out what stage 08 trains (``p.trained_elsewhere``) and, on the CPU, the
    16-bit options that fairseq cannot train there, and the levers beyond the paper (its precision settings beyond
    it, and compressed activations). Each entry is {slot, name, role}."""
    names = set(memory.name)
    chosen: list[dict[str, Any]] = []
    first = [("baseline", "baseline"), *[(name(p, s), "single technique") for s in p.singles]]
    for n, role in first:
        if n not in names:
            raise ParamError(f"combinations_{p.task}.singles: {n} is not in the grid")
        chosen.append({"name": n, "role": role})
    pool = memory[~memory.name.isin([c["name"] for c in chosen])]
    if p.task == "dynamicconv":
        # The levels are the paper's levers': levers beyond it train in stages translation_levers_train,
        # translation_activations_train and translation_kahan_train.
        pool = pool[pool.precision.map(lambda m: trainable(p, m)) & ~beyond_paper_rows(p.task, pool)]
    for level in ([] if p.search else p.levels):  # the search picks its levels after the singles have trained
        reach = pool[pool.reduction >= level]
        if reach.empty:
            raise ParamError(f"combinations_{p.task}.levels: no combination of the grid reaches {level}x (max "
                             f"{memory.reduction.max():.1f}x); lower the level or widen the grid")
        order = sorted(reach.itertuples(), key=lambda r: (r.techniques, r.mildness, -r.reduction))
        chosen.append({"name": order[0].name, "role": f"level {level:g}x"})
        pool = pool[pool.name != order[0].name]
    chosen = [c for c in chosen if c["name"] not in p.trained_elsewhere]
    if len(chosen) + search_slots(p) != p.slots:
        n = len(chosen) + search_slots(p)
        raise ParamError(f"combinations_{p.task}: {n} combinations are chosen but slots={p.slots}; set slots to {n} "
                         f"and list 0..{n - 1} in the matrix of dvc.yaml's stage combination_{p.task}"
                         f"{' and combination_search_wrn' if p.search else ''}")
    configs = memory.set_index("name").config
    return [{"slot": i, **c, "config": json.loads(configs[c["name"]])} for i, c in enumerate(chosen)]


def search_slots(p: CombinationsParams) -> int:
    """Slots the quality-aware search fills after the singles: one per level and the maximum, twice with
    ``search_paper`` (among every lever, then among the paper's alone)."""
    return (len(p.levels) + int(p.search_max)) * (1 + int(p.search_paper)) if p.search else 0


# --- the quality-aware search (WRN) ----------------------------------------------------------------------------


def lever_effects(p: CombinationsParams, trained: list[dict[str, Any]],
                  levers_dir: Path = Path("metrics")) -> dict[tuple[str, Any], tuple[quality.Paired, str]]:
    """Each lossy lever's effect alone, (dimension, setting) → (its paired change, where it was trained), from the
    trained singles (``trained``: the metrics of the slots, the baseline among them), then from the arms of
    ``p.effects_from``'s stages (``levers_dir/<stage>.json``) that set one setting of the grid alone and that no
    single trains, each paired with its own study's baseline."""
    by_name = {r["name"]: r for r in trained}
    if "baseline" not in by_name:
        raise FileNotFoundError("the search needs the trained baseline (slot 0): run `dvc repro combination_wrn`")
    effects = {}
    for single in p.singles:
        (dim, value), = single.items()
        n = name(p, single)
        if n not in by_name:
            raise FileNotFoundError(f"the search needs the trained single {n}: run `dvc repro combination_wrn`")
        effects[(dim, value)] = (paired_change(by_name[n], by_name["baseline"]), f"slot {by_name[n]['slot']}")
    for stage in p.effects_from:
        path = Path(levers_dir) / f"{stage}.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: the search takes lever effects from stage {stage} "
                                    f"(combinations_wrn.effects_from); run `dvc repro {stage}`")
        res = json.loads(path.read_text())
        base = BaselineParams(**p.train)
        theirs = (res["profile"], res["seeds"], res["model"], res["epochs"], res["batch_size"])
        ours = (p.profile, p.train_seeds, base.model, base.epochs, base.batch_size)
        if theirs != ours:
            raise FileNotFoundError(f"{path} trained (profile, seeds, model, epochs, batch) {theirs}, not {ours}: "
                                    f"rerun stage {stage} (dvc repro {stage})")
        for arm in res["arms"]:
            cfg = grid_config(p.task, res["arms"][arm]["techniques"])
            if len(cfg) != 1:
                continue
            (dim, value), = cfg.items()
            if dim in dims(p.task) and dim not in EXACT and value in getattr(p, dim) and (dim, value) not in effects:
                effects[(dim, value)] = (arm_change(res, arm, "baseline"), f"stage {stage}")
    return effects


def search(p: CombinationsParams, memory: pd.DataFrame, effects: dict[tuple[str, Any], quality.Paired],
           chosen: list[str]) -> list[dict[str, Any]]:
    """The levels' combinations: at each level, among the combinations not yet ``chosen`` that reach it and whose
    change can be predicted, the one with the smallest predicted loss; ties (combinations that differ by exact
    levers) go to the lower time ratio, then the smaller reduction. With ``p.search_max``, then the largest
    reduction that can be predicted. With ``p.search_paper``, then the same again among the combinations of the
    paper's levers alone that are not picked yet. Each entry is {name, role, config, predicted_change}."""
    pool = memory.assign(predicted_change=predict(memory, effects))
    pool = pool[pool.predicted_change.notna() & ~pool.name.isin(chosen)]
    picks = _search_levels(p, pool, "")
    if p.search_paper:
        paper = pool[~beyond_paper_rows(p.task, pool) & ~pool.name.isin([c["name"] for c in picks])]
        picks += _search_levels(p, paper, " (the paper's levers)")
    return picks


def _search_levels(p: CombinationsParams, pool: pd.DataFrame, among: str) -> list[dict[str, Any]]:
    """``search``'s picks from ``pool`` (predicted, not yet chosen); ``among`` ends each role."""
    picks = []
    for level in p.levels:
        reach = pool[pool.reduction >= level]
        if reach.empty:
            raise ParamError(f"combinations_{p.task}.levels: no combination whose quality can be predicted reaches "
                             f"{level:g}x{among} (max {pool.reduction.max():.1f}x); lower the level or train more singles")
        best = reach.sort_values(["predicted_change", "time_ratio", "reduction"], ascending=[False, True, True]).iloc[0]
        picks.append({"name": best["name"], "role": f"search {level:g}x{among}", "config": json.loads(best.config),
                      "predicted_change": round(float(best.predicted_change), 4)})
        pool = pool[pool.name != best["name"]]
    if p.search_max:
        best = pool.sort_values(["reduction", "predicted_change"], ascending=[False, False]).iloc[0]
        picks.append({"name": best["name"], "role": f"search maximum{among}", "config": json.loads(best.config),
                      "predicted_change": round(float(best.predicted_change), 4)})
    return picks


def trainable(p: CombinationsParams, precision_mode: str) -> bool:
    """Whether DynamicConv trains in ``precision_mode`` here. fairseq 0.12's --fp16 needs CUDA and
    --memory-efficient-fp16 fails on the CPU at its first overflow (docs/translation.md); the plugin's bf16 modes train anywhere."""
    if precision_mode not in FAIRSEQ_16BIT:
        return True
    return torch.cuda.is_available() and p.translation.get("device", "auto") != "cpu"


FAIRSEQ_16BIT = ("fp16", "memory-efficient-fp16")  # fairseq's own flags; other precision settings are stage 08's names


# --- WRN -------------------------------------------------------------------------------------------------------


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


def wrn_memory_row(p: CombinationsParams, cfg: dict[str, Any], skip_repeats: bool = True) -> dict[str, Any]:
    """The accounted peak of one full-size step (``p.wrn``: WRN-28-2 at B = 128) under ``cfg``, by category
    (``lowmem.wrn.memory``, which follows microbatches 1, 2 and the last one unless ``skip_repeats`` is off)."""
    r = wrn_memory.account(wrn_techniques(p, cfg), wrn_shape(p), p.seed, skip_repeats)
    return {f"{c}_mib": r.at_peak[c] / MIB for c in CATEGORIES} | {"total_mib": r.peak / MIB, "peak_phase": r.peak_phase}


# In the sweep's folder, persisted by DVC and committed: accounting the cpu grid takes most of an hour on 2 cores,
# and a grid that grows by a lever would otherwise account every old row again (``wrn_memory_rows``).
MEMORY_CACHE = "wrn_memory.csv"
# What a cached row holds; raise it when wrn_memory_row's columns or their meaning change.
MEMORY_ROW_FORMAT = 1


def _version(lib: str) -> str | None:
    """``lib``'s installed version, or None where it is not installed (a grid that does not use it needs none)."""
    try:
        return importlib.metadata.version(lib)
    except importlib.metadata.PackageNotFoundError:
        return None


def memory_keys(p: CombinationsParams, configs: list[dict[str, Any]]) -> tuple[list[str], str]:
    """Each configuration's accounted memory key, and the accountant's digest: of its code (``lowmem.runs.code_digest``
    of lowmem.wrn.memory's closure), the versions of the libraries whose optimizers it steps, and the row's format.
    A key covers what ``wrn_memory_row`` depends on (the run's Techniques, the full-size shape, the seed) and that
    digest, as run keys are made."""
    # The libraries count too: the accountant steps torch's, bitsandbytes' and torch-optimi's optimizers to size
    # their state.
    libraries = {lib: _version(lib) for lib in ("torch", "bitsandbytes", "torch-optimi")}
    digest = runs.make_key({"code": runs.code_digest(runs.closure("lowmem.wrn.memory")), "libraries": libraries,
                            "row": MEMORY_ROW_FORMAT}, [])
    shape = dataclasses.asdict(wrn_shape(p))
    return [runs.make_key({"techniques": dataclasses.asdict(wrn_techniques(p, cfg)), "shape": shape, "seed": p.seed,
                           "accountant": digest}, []) for cfg in configs], digest


def wrn_memory_rows(p: CombinationsParams, configs: list[dict[str, Any]], progress: bool = True,
                    cache: Path | None = None, every: int = 200) -> list[dict[str, Any]]:
    """``wrn_memory_row`` of each configuration, in order, on ``p.workers`` processes. With ``cache`` (a CSV that the
    sweep persists), a configuration whose memory key (``memory_keys``) is there is read from it, and what is
    accounted is added to it every ``every`` configurations, so that an interrupted sweep resumes and a grid that
    grows accounts only its new rows. Rows another version of the accountant wrote are dropped."""
    keys, digest = memory_keys(p, configs)
    known: dict[str, dict[str, Any]] = {}
    if cache is not None and cache.exists():
        # The keys as text: a digest of digits alone would read back as a number.
        old = pd.read_csv(cache, dtype={"memory_key": str, "accountant": str})
        known = {r.pop("memory_key"): r for r in old[old.accountant == digest].drop(columns="accountant").to_dict("records")}
    todo = [i for i, k in enumerate(keys) if k not in known]
    # Accounting on the meta device is PyTorch's dispatch in Python, one core per process. Spawned, not forked: the
    # workers import torch afresh rather than inherit a notebook kernel's threads. map keeps the configurations' order.
    pool = (ProcessPoolExecutor(p.workers, mp_context=multiprocessing.get_context("spawn"))
            if p.workers > 1 and len(todo) > 1 else None)
    account = partial(wrn_memory_row, p)

    def save() -> None:
        if cache is not None and known:
            table = pd.DataFrame([{"memory_key": k, "accountant": digest, **r} for k, r in known.items()])
            runs.atomic_write(cache, lambda tmp: table.to_csv(tmp, index=False))

    try:
        with tqdm(total=len(configs), initial=len(configs) - len(todo), disable=not progress, mininterval=10,
                  desc=f"accounting wrn combinations ({p.workers} process{'es' if p.workers > 1 else ''})") as bar:
            for start in range(0, len(todo), every):
                part = todo[start:start + every]
                cfgs = [configs[i] for i in part]
                for i, row in zip(part, pool.map(account, cfgs, chunksize=4) if pool else map(account, cfgs)):
                    known[keys[i]] = row
                    bar.update()
                save()
    except BaseException:
        if pool:
            # Cancels the configurations not yet started; those running (a chunk a process at most) finish before the
            # process exits.
            pool.shutdown(wait=False, cancel_futures=True)
        save()  # the rows accounted since the last write are kept too
        raise
    if pool:
        pool.shutdown()
    return [dict(known[k]) for k in keys]


def wrn_step_times(p: CombinationsParams, configs: list[dict[str, Any]], progress: bool = True) -> list[float]:
    """Seconds per training step of each configuration at the active profile (the trained model and batch, random
    inputs, on the baseline block's device): ``timing_repeats`` rounds over all configurations in turn after a
    warm-up step each, so that drift in the machine's speed hits all alike; the median of the rounds."""
    base = BaselineParams(**p.train)
    device = resolve_device(base.device)
    data = load(base.dataset, base.data_root, augment=False, seed=0)
    steps = []
    for cfg in tqdm(configs, desc="building and warming up", disable=not progress, mininterval=10):
        tech = wrn_techniques(p, cfg, base.batch_size)
        shape = (base.batch_size, data.in_channels, 32, 32)
        model = wrn_model(base.model, data.num_classes, data.in_channels, tech, device, p.seed, shape)
        opt = make_optimizer(model, name=tech.optimizer)
        prec = precision.parse(tech.precision)
        scaler = precision.make_scaler(prec, device.type)
        x = precision.cast_batch(torch.randn(shape, device=device), prec)
        y = torch.randint(0, data.num_classes, (base.batch_size,), device=device)
        step = (lambda m=model, o=opt, t=tech, s=scaler, x=x, y=y: train_step(m, o, x, y, t, scaler=s).item())
        step()
        steps.append(step)
    times: list[list[float]] = [[] for _ in configs]
    for _ in tqdm(range(p.timing_repeats), desc="timing rounds", disable=not progress):
        for i, step in enumerate(steps):
            t0 = time.perf_counter()
            step()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def kept_wrn(p: CombinationsParams, chosen: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any] | None:
    """The slot's result as its metrics file already holds it (``previous``, which DVC persists), where that file is
    this configuration trained on these seeds with the same run keys (``lowmem.wrn.train.store_run``: the code, the
    recipe and the techniques as they change training), so that a search whose picks moved retrains only the slots
    that changed, from a fresh clone's empty run store too. None where anything differs."""
    base = BaselineParams(**p.train)
    tech = wrn_techniques(p, chosen["config"], base.batch_size)
    keys = [store_run(base, seed, tech).key for seed in p.train_seeds]
    same = (previous.get("task") == p.task and previous.get("profile") == p.profile
            and previous.get("config") == chosen["config"] and previous.get("seeds") == p.train_seeds
            and [r.get("key") for r in previous.get("runs", [])] == keys)
    if not same:
        return None
    return {**previous, **chosen, "runs": [{**r, "trained": False, "kept": True} for r in previous["runs"]]}


def _previous(metrics: Path) -> dict[str, Any]:
    """A slot's persisted metrics, or nothing where there are none or they cannot be read (then the slot trains)."""
    try:
        previous = json.loads(metrics.read_text())
    except (FileNotFoundError, ValueError):  # ValueError: not JSON, or not text
        return {}
    return previous if isinstance(previous, dict) else {}


def train_wrn(p: CombinationsParams, cfg: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Trains ``cfg`` with the baseline block's recipe and data on each of ``p.train_seeds``, through the run store:
    a run another stage made (a single technique of notebooks 03-05, or the plain run of a checkpointed
    configuration) is taken from there."""
    base = BaselineParams(**p.train)
    tech = wrn_techniques(p, cfg, base.batch_size)
    store = [store_run(base, seed, tech) for seed in p.train_seeds]
    fresh = [r.result() is None for r in store]
    final = [train(base, seed, tech, progress=progress)[-1] for seed in p.train_seeds]
    s = summarize(final)
    return {"runs": [{"key": r.key, "seed": seed, "trained": t} for r, seed, t in zip(store, p.train_seeds, fresh)],
            "machine": quality.machine(), "model": base.model, "data": final[0]["data"], "epochs": base.epochs, "batch_size": base.batch_size,
            "trained_microbatch": tech.microbatch, "per_seed_acc": [r["test_acc"] for r in final],
            **{k: s[k] for k in ("seeds", "test_acc_mean", "test_acc_std", "images_per_s", "step_s")}}


# --- DynamicConv -----------------------------------------------------------------------------------------------


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


def train_translation(p: CombinationsParams, cfg: dict[str, Any], data_dir: Path) -> dict[str, Any]:
    """Trains ``cfg`` as stage 08 trains a single technique (same command, updates, seed and scoring, so the BLEU
    compares with stage 08's baseline), then times it against the baseline in alternating short runs."""
    from lowmem.studies import translation as translation_study  # fairseq: imported only where DynamicConv runs
    n = name(p, cfg)
    tp = translation_params(p, [{}, cfg], [n])
    res = translation.train_result(translation_study.train_params(tp, n), data_dir)
    records, save_dir = res["records"], Path(res["dir"])
    ev = translation.evaluate(TranslationEvaluateParams(profile=tp.profile, device=tp.device), data_dir, save_dir,
                              save_dir / "generate", tuple(translation_study.PLUGIN[:2]))
    # The baseline is stage 08's run (same command, updates and seed), from the store or trained once here.
    base = translation.train_result(translation_study.train_params(tp, "baseline"), data_dir)
    base_dir = Path(base["dir"])
    if not (base_dir / "generate" / "generate.txt").exists():
        translation.evaluate(TranslationEvaluateParams(profile=tp.profile, device=tp.device), data_dir, base_dir,
                             base_dir / "generate", tuple(translation_study.PLUGIN[:2]))
    # One seed: the interval is the test set's sampling (sacreBLEU's paired bootstrap), not training's noise.
    change = quality.bleu_paired(*(translation.detokenized(translation.hypotheses((d / "generate" / "generate.txt").read_text()))
                                   for d in (save_dir, base_dir)),
                                 translation.test_references(data_dir), resamples=translation_study.BOOTSTRAP,
                                 lowercase=translation.LOWERCASE)
    timing = translation_study.time_steps(tp, data_dir)
    per = pd.DataFrame(timing).groupby("technique").seconds_per_update.median()
    return {"runs": [{"key": res["key"], "seed": tp.seed, "trained": res["trained"]}, {"key": base["key"], "seed": tp.seed, "trained": base["trained"], "role": "baseline"}],
            "sacrebleu_change": round(change.mean, 2), "sacrebleu_change_low": round(change.low, 2),
            "sacrebleu_change_high": round(change.high, 2), "bootstrap_resamples": translation_study.BOOTSTRAP,
            "bleu_tokenized": ev["bleu_tokenized"], "sacrebleu": ev["sacrebleu"], "max_update": tp.max_update,
            "updates": max(int(r["num_updates"]) for r in records if "num_updates" in r),
            "time_ratio": round(float(per[n] / per["baseline"]), 3), "timing": timing}


# --- the two pipeline steps ------------------------------------------------------------------------------------


def sweep(p: CombinationsParams, progress: bool = True, cache: Path | None = None) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """Every combination of the grid accounted at full size (and, for WRN, timed at the active profile), and the
    subset chosen for training: (table, selection). WRN's accounted rows come from and go to ``cache``
    (``wrn_memory_rows``)."""
    configs = grid(p)
    rows = []
    if p.task == "dynamicconv":
        from lowmem.studies import translation as translation_study  # fairseq: imported only where DynamicConv runs

        mem = translation_study.memory(translation_params(p, configs), progress, p.workers)
        by_name = mem.set_index("technique")
    else:
        memory = wrn_memory_rows(p, configs, progress, cache)
    for i, cfg in enumerate(configs):
        n = name(p, cfg)
        full = {d: cfg.get(d, getattr(p, d)[0]) for d in dims(p.task)}
        row: dict[str, Any] = {"name": n, **full, "config": json.dumps(cfg), "techniques": len(cfg), "mildness": mildness(p, cfg)}
        if p.task == "wrn":
            row |= memory[i]
        else:
            m = by_name.loc[n]
            row |= {"options": m.options, **{f"{c}_mib": m[f"{c}_mib"] for c in CATEGORIES}, "total_mib": m.total_mib,
                    "peak_phase": m.peak_phase}
        rows.append(row)
    df = pd.DataFrame(rows)
    df["reduction"] = df.total_mib.iloc[0] / df.total_mib
    if p.task == "wrn":
        secs = wrn_step_times(p, configs, progress)
        df["step_s"] = secs
        df["time_ratio"] = df.step_s / df.step_s.iloc[0]
    chosen = select(p, df)
    return df, chosen


def search_step(p: CombinationsParams, sweep_dir: Path, metrics_dir: Path, levers_dir: Path = Path("metrics")) -> dict[str, Any]:
    """The search's output (``data/combinations/wrn_search.json``): each lever's effect alone and the levels' picks,
    slots numbered after the sweep's selection."""
    selected = json.loads((sweep_dir / f"{p.task}_selected.json").read_text())["selected"]
    trained = []
    for c in selected:
        f = metrics_dir / f"{p.task}-{c['slot']}.json"
        if not f.exists():
            raise FileNotFoundError(f"{f} is missing: train the singles first (dvc repro combination_{p.task})")
        r = json.loads(f.read_text())
        if r["name"] != c["name"] or r["seeds"] != p.train_seeds:
            raise FileNotFoundError(f"{f} holds {r['name']} on seeds {r['seeds']}, not {c['name']} on {p.train_seeds}: "
                                    f"retrain it (dvc repro combination_{p.task})")
        trained.append(r)
    effects = lever_effects(p, trained, levers_dir)
    memory = pd.read_csv(sweep_dir / f"{p.task}_sweep.csv")
    picks = search(p, memory, {k: e for k, (e, _) in effects.items()}, [c["name"] for c in selected])
    return {"profile": p.profile, "seeds": p.train_seeds,
            "effects": [{"lever": d, "setting": v, "change": e.mean, "low": e.low, "high": e.high, "n": e.n, "from": src}
                        for (d, v), (e, src) in effects.items()],
            "selected": [{"slot": len(selected) + i, **c} for i, c in enumerate(picks)]}


def chosen_slots(p: CombinationsParams, sweep_dir: Path) -> list[dict[str, Any]]:
    """Every slot to train: the sweep's selection, then the search's picks where the search is on and has run."""
    chosen = selection(p.task, sweep_dir)["selected"]
    return chosen if p.search else [c for c in chosen if not c["role"].startswith("search")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("account", "sweep", "select", "search", "train"),
                    help="account: WRN's grid accounted into the sweep's memory cache only (resumable; the sweep then "
                         "times it); sweep: account (and time) the grid and select; select: select again from the "
                         "sweep's table (the grid unchanged); search: WRN's levels by predicted quality; train: one slot")
    ap.add_argument("task", choices=TASKS)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--slot", type=int, help="train: which chosen combination (0 = the baseline)")
    ap.add_argument("--sweep-dir", type=Path, default=Path("data/combinations"), help="the sweep's table and selection")
    ap.add_argument("--metrics-dir", type=Path, default=Path("metrics/combinations"), help="search: the trained slots' metrics")
    ap.add_argument("--levers-dir", type=Path, default=Path("metrics"), help="search: the levers stages' metrics (effects_from)")
    ap.add_argument("--data-dir", type=Path, default=translation.DATA, help="train: the translation stages' data")
    ap.add_argument("--data-root", default="data/raw", help="WRN: image datasets (the notebooks' ../data/raw, from the repository root)")
    ap.add_argument("--metrics", type=Path, help="train: write the run's metrics here")
    ap.add_argument("--results", type=Path, help="a copy of what the step wrote, kept in the DVC cache (dvc.yaml)")
    args = ap.parse_args(argv)
    try:
        p = resolve_task(args.task, yaml.safe_load(args.params.read_text()))
        if p.train:
            p.train["data_root"] = args.data_root
        if args.step == "account":
            if p.task != "wrn":
                raise ParamError("account: the memory cache is WRN's (DynamicConv's sweep accounts in one step)")
            wrn_memory_rows(p, grid(p), cache=args.sweep_dir / MEMORY_CACHE)
            return 0
        if args.step in ("sweep", "select"):
            table = args.sweep_dir / f"{p.task}_sweep.csv"
            if args.step == "sweep":
                df, chosen = sweep(p, cache=args.sweep_dir / MEMORY_CACHE if p.task == "wrn" else None)
                args.sweep_dir.mkdir(parents=True, exist_ok=True)
                df.to_csv(table, index=False)
            else:
                if not table.exists():
                    raise FileNotFoundError(f"{table} is missing: run the sweep (dvc repro combinations_sweep_{p.task})")
                df = pd.read_csv(table)
                if len(df) != len(grid(p)) or list(df.name) != [name(p, c) for c in grid(p)]:
                    raise ParamError(f"{table} is another grid than params.yaml's: run the sweep again")
                chosen = select(p, df)
            (args.sweep_dir / f"{p.task}_selected.json").write_text(json.dumps({"profile": p.profile, "selected": chosen}, indent=2) + "\n")
            if args.results:
                runs.write_json(args.results, {"profile": p.profile, "combinations": len(df), "selected": chosen})
            return 0
        if args.step == "search":
            if not p.search:
                raise ParamError(f"combinations_{p.task}.search is off: the levels were picked by the sweep")
            out = search_step(p, args.sweep_dir, args.metrics_dir, args.levers_dir)
            runs.write_json(args.sweep_dir / f"{p.task}_search.json", out)
            if args.results:
                runs.write_json(args.results, out)
            return 0
        if args.slot is None or args.metrics is None:
            raise ParamError("train needs --slot and --metrics")
        selected = chosen_slots(p, args.sweep_dir)
        if not 0 <= args.slot < len(selected):
            raise ParamError(f"slot {args.slot} is not among the {len(selected)} chosen combinations of {p.task}"
                             f"{' (the search picks slots from ' + str(p.slots - search_slots(p)) + ' on: run it first)' if p.search else ''}")
        chosen = selected[args.slot]
        cfg = chosen["config"]
        print(f"== {p.task} slot {args.slot}: {chosen['name']} ({chosen['role']})", flush=True)
        kept = kept_wrn(p, chosen, _previous(args.metrics)) if p.task == "wrn" else None
        if kept is not None:
            print(f"kept: {args.metrics} already holds {chosen['name']} trained with these run keys", flush=True)
            runs.write_json(args.metrics, kept)
            if args.results:
                runs.write_json(args.results, kept)
            return 0
        if p.task == "wrn":
            result = train_wrn(p, cfg)
        else:
            result = train_translation(p, cfg, args.data_dir)
    except (ParamError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = {"task": p.task, "profile": p.profile, **chosen, **result}
    runs.write_json(args.metrics, out)
    if args.results:
        runs.write_json(args.results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
