"""What the quality of a combination of levers is made of, for the search (``lowmem.studies.combinations``) and the
frontier (``lowmem.studies.frontier``): which levers are exact, a trained combination's paired change against the
baseline, the additive prediction of an untrained one's change from its levers' effects alone, and which
combinations were chosen to train (``selection``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from lowmem.studies import quality

DIMS = ("sparsity", "precision", "microbatch", "checkpoint")  # the paper's four levers, the dimensions of both grids
# Both grids add a lever beyond the paper: the bits each activation saved for backward is stored in
# (lowmem.techniques.compress; 0 = as computed; DynamicConv: the plugin's --activation-bits). WRN's adds a second, the
# optimizer (lowmem.techniques.optimizers), whose 8-bit momentum (bnb-sgd8bit) is beyond the paper; a table made
# before that dimension existed is read with it off ("sgd") on every row.
DIMS_OF = {"wrn": DIMS + ("activation_bits", "optimizer"), "dynamicconv": DIMS + ("activation_bits",)}
OPTIONAL_DIMS = {"optimizer": "sgd"}
# WRN's precision settings beyond the paper, and what each one trains with (the fields of a Techniques): 16-bit
# weights with torch-optimi's Kahan-compensated SGD, as DynamicConv's all-bf16-kahan. A precision setting, not an
# optimizer one: the compensation exists only where the weights are 16-bit, and the lever's effect is measured there.
KAHAN_PRECISIONS_WRN = {"half-bf16-kahan": {"precision": "half-bf16", "optimizer": "optimi-sgd"}}
# Levers whose step equals the plain step (bitwise), by the named test: their expected quality effect is zero, and a
# combination that differs from a trained one only by them gets that run's quality. WRN's run key drops them, so such
# a combination is that very run (lowmem.wrn.train.run_techniques); not with compressed activations, where
# checkpointing is not exact and the key keeps it.
EXACT = {"checkpoint": "tests/test_checkpoint.py::test_checkpointing_is_bit_equal_in_every_precision_and_with_sparse_layers"}
# DynamicConv's --checkpoint-activations, by fairseq's own Trainer stepping with and without it (dropout on), in the
# precisions the tests cover: a twin in another precision (fairseq's fp16, which trains only on a GPU) is not filled.
EXACT_DYNAMICCONV = {"checkpoint": "tests/test_translation_techniques.py::test_checkpointed_layers_give_identical_loss_and_gradients_with_dropout_on"}
EXACT_DYNAMICCONV_PRECISIONS = ("fp32", "mixed-bf16", "all-bf16", "adamw-8bit", "all-bf16-kahan")
# DynamicConv's exact microbatching (the plugin's --microbatches k: the baseline's own batches in k sub-batches): the
# gradient is the whole batch's up to the order of the sums, by the named test with dropout off; with dropout on the
# masks are other draws of the same distribution. Not exact, then, but "equal up to dropout draws": a combination that
# differs from a trained one only by it (and exact levers) takes that run's quality, and where that run is the
# baseline its interval is two seeds' noise. Only in the settings the test covers: fp32 gradients (bf16 gradients
# would accumulate the sub-batches in bf16). fairseq's --update-freq, which draws other batches, is never this.
EQUAL_UP_TO_DROPOUT_DYNAMICCONV = {"microbatch": "tests/test_translation_microbatch.py::test_microbatches_give_the_gradients_of_the_whole_batch_with_dropout_off"}
EQUAL_UP_TO_DROPOUT_PRECISIONS = ("fp32", "adamw-8bit")
EXACT_MICROBATCH_OPTION = "--microbatches"
# Fields of lowmem.techniques.step.Techniques that are levers beyond the paper, with their 'off' values.
BEYOND_PAPER = {"optimizer": "sgd", "activation_bits": 0}
# DynamicConv's levers beyond the paper that its precision dimension holds (what the training state is stored in),
# named as stage 08's techniques: 8-bit Adam moments, and all-bf16 with a Kahan-compensated AdamW. Its other lever
# beyond the paper is the activation_bits dimension, as WRN's.
BEYOND_PAPER_DYNAMICCONV = ("adamw-8bit", "all-bf16-kahan")
LEVERS_STAGES = ("levers_train", "levers_state_train")  # WRN's studies of levers beyond the paper, one machine each


def dims(task: str) -> tuple[str, ...]:
    """The dimensions of ``task``'s combination grid (``DIMS_OF``)."""
    return DIMS_OF[task]


def techniques_config(task: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A grid configuration as the fields of the run's ``lowmem.techniques.step.Techniques`` that it sets (WRN: a
    Kahan precision setting is 16-bit weights and torch-optimi's SGD, ``KAHAN_PRECISIONS_WRN``); DynamicConv's
    configurations are fairseq options, returned as they are."""
    if task != "wrn" or cfg.get("precision") not in KAHAN_PRECISIONS_WRN:
        return dict(cfg)
    return {**cfg, **KAHAN_PRECISIONS_WRN[cfg["precision"]]}


def grid_config(task: str, techniques: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``techniques_config``: a run's Techniques fields as a configuration of ``task``'s grid."""
    if task == "wrn":
        for name, fields in KAHAN_PRECISIONS_WRN.items():
            if all(techniques.get(k) == v for k, v in fields.items()):
                return {**{k: v for k, v in techniques.items() if k not in fields}, "precision": name}
    return dict(techniques)


def beyond_paper(techniques: dict[str, Any]) -> bool:
    """Whether a configuration (the non-default fields of a ``Techniques``) uses a lever beyond the paper."""
    return any(techniques.get(k, off) != off for k, off in BEYOND_PAPER.items())


def beyond_paper_rows(task: str, grid: pd.DataFrame) -> pd.Series:
    """Which rows of ``task``'s combination grid (a sweep table, with its ``config`` column) use a lever beyond the
    paper: WRN's and DynamicConv's ``BEYOND_PAPER`` fields (compressed activations, WRN's optimizers, so its Kahan
    precision settings too), and DynamicConv's precision settings beyond it (``BEYOND_PAPER_DYNAMICCONV``)."""
    beyond = grid.config.map(lambda c: beyond_paper(techniques_config(task, json.loads(c)))).astype(bool)
    if task == "dynamicconv":
        beyond |= grid.precision.isin(BEYOND_PAPER_DYNAMICCONV)
    return beyond


def paired_change(run: dict[str, Any], baseline: dict[str, Any]) -> quality.Paired:
    """A trained WRN combination's accuracy change in points against the baseline's runs of the same seeds
    (``lowmem.studies.quality.paired``)."""
    def by_seed(r: dict[str, Any]) -> dict[int, float]:
        return {s: 100 * a for s, a in zip(r["seeds"], r["per_seed_acc"])}

    return quality.paired(quality.seed_pairs(by_seed(run), by_seed(baseline)))


def arm_change(res: dict[str, Any], arm: str, against: str) -> quality.Paired:
    """In a study whose arms all trained on ``res["seeds"]`` (``res["arms"]``: lowmem.studies.levers), ``arm``'s
    accuracy change in points against ``against``, paired by seed."""
    return paired_change({"seeds": res["seeds"], **res["arms"][arm]}, {"seeds": res["seeds"], **res["arms"][against]})


def predict(memory: pd.DataFrame, effects: dict[tuple[str, Any], quality.Paired]) -> pd.Series:
    """Each combination's predicted quality change: the sum of its lossy levers' effects alone (exact levers add
    zero, by ``EXACT``'s tests). NaN where a lever's effect is unknown (its setting was not trained alone).
    Checkpointing adds zero with compressed activations too, where it is not exact (a recomputed segment's tensors are
    kept as computed, its inputs packed): the model's assumption there, which the trained picks test."""
    out = []
    for cfg in memory.config:
        total = 0.0
        for dim, value in json.loads(cfg).items():
            if dim in EXACT:
                continue
            if (dim, value) not in effects:
                total = math.nan
                break
            total += effects[(dim, value)].mean
        out.append(total)
    return pd.Series(out, index=memory.index, name="predicted_change")


def selection(task: str, sweep_dir: Path) -> dict[str, Any]:
    """The combinations chosen to train, one per slot: the sweep's selection (``<task>_selected.json``), then the
    search's picks and the lever effects they were predicted from (``<task>_search.json``, WRN) where it has run."""
    sel_file = Path(sweep_dir) / f"{task}_selected.json"
    if not sel_file.exists():
        raise FileNotFoundError(f"{sel_file} is missing: run the sweep first (dvc repro combinations_sweep_{task})")
    selected = json.loads(sel_file.read_text())
    search_file = Path(sweep_dir) / f"{task}_search.json"
    if search_file.exists():
        search = json.loads(search_file.read_text())
        selected = {**selected, "selected": selected["selected"] + search["selected"], "effects": search["effects"]}
    return selected
