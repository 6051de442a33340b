"""Levers beyond the paper, trained on the combination study's proxy and seeds, each paired with the arms it changes.

Every arm on ``combinations_wrn.train_seeds`` with the training block of ``combinations_wrn`` (so the baseline and
the paper's arms are the combination study's own runs, from the run store where they have run). An arm is named by
its levers' short names joined by '+' (``lowmem.techniques.short_names.parse``: ``half-bf16+optimi-sgd``,
``microbatch-8+checkpoint-block+activations-2``; ``baseline`` is the recipe), so any lever the registry holds can be
trained without code here. The studies (params.yaml's ``levers.studies``) pair the arms:

- ``kahan``: 16-bit weights with a Kahan-compensated update (torch-optimi's SGD, ``lowmem.techniques.optimizers``):
  ``half-bf16`` (every tensor in bf16, the recipe's SGD, which rounds small updates away), ``optimi-sgd`` (fp32 with
  torch-optimi's SGD, which has no Nesterov momentum: that change alone) and ``half-bf16+optimi-sgd``.
- ``activations``: saved activations at 8, 4 and 2 bits (``lowmem.techniques.compress``), alone and on top of the
  paper's levers that the headline's mean and interval rules pick (microbatch 8 with block checkpointing).
- ``state``: momentum stored in 8 bits (bitsandbytes' SGD8bit, ``lowmem.techniques.optimizers``), against the same
  heavy-ball SGD in fp32 (``optimi-sgd``: both are tested equal to torch's SGD without Nesterov) and on top of the
  headline's paper levers.

Each arm's accuracy change is paired over seeds with Student's t (``lowmem.studies.quality.paired``) against the
baseline and against the arm it adds one lever to, which separates that lever's cost. Memory is accounted at full
size (WRN-28-2 at B = 128, ``combinations_wrn.wrn``). The frontier (``lowmem.studies.frontier``) takes the arms with
a lever beyond the paper into the headline's rows "the paper's and beyond".

    python -m lowmem.pipeline levers --metrics metrics/levers_train.json --tables figures --only ARM ...

The arms of ``--only`` are trained into a metrics file of their own: arms are paired only within one file, since
the same seed gives other accuracies on another CPU (oneDNN picks other kernels). ``machine`` is the CPU that ran
the command; runs it takes from the run store keep their own numbers, and run keys leave the machine out, so a study
is trained through an empty store on one machine (as levers_state_train was). A study's table is written where its
file has all of its arms. Stage levers_state_train:

    python -m lowmem.pipeline levers --metrics metrics/levers_state_train.json --tables figures --only baseline \
        optimi-sgd microbatch-8+checkpoint-block bnb-sgd8bit microbatch-8+checkpoint-block+bnb-sgd8bit
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from lowmem import config, runs
from lowmem.config import ParamError
from lowmem.memory.accounting import CATEGORIES
from lowmem.studies import quality
from lowmem.studies.combination_grid import CombinationsParams, wrn_shape
from lowmem.studies.quality_model import arm_change as change
from lowmem.techniques import short_names
from lowmem.techniques.step import Techniques
from lowmem.wrn import memory as wrn_memory
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.train import store_run, train

MIB = 2**20


def arm(name: str) -> Techniques:
    """An arm is named by its levers' short names joined by '+' (``lowmem.techniques.short_names.parse``):
    ``half-bf16+optimi-sgd``, ``microbatch-8+checkpoint-block+activations-2``; ``baseline`` is the recipe."""
    return Techniques(**short_names.parse(name))


def studies(params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """params.yaml's ``levers.studies``: per study, the bytes its table shows (``category``) and its comparisons,
    ``(arm, against): what it isolates``."""
    out = {}
    for name, study in params["levers"]["studies"].items():
        pairs = {(a, against): what for a, against, what in study["pairs"]}
        for a in {x for pair in pairs for x in pair}:
            arm(a)  # a misspelt arm stops here, before any training
        out[name] = {"category": study["category"], "pairs": pairs}
    return out


def memory(p: CombinationsParams, tech: Techniques) -> dict[str, Any]:
    """The accounted peak of one full-size step under ``tech``, by category at the peak, in MiB."""
    r = wrn_memory.account(tech, wrn_shape(p), p.seed)
    return {f"{c}_mib": r.at_peak[c] / MIB for c in CATEGORIES} | {"total_mib": r.peak / MIB}


def train_arms(p: CombinationsParams, names: list[str], progress: bool = True) -> dict[str, Any]:
    """Every arm named on every seed (through the run store), with its accounted memory."""
    base = BaselineParams(**p.train)
    arms = {}
    for name, tech in ((n, arm(n)) for n in names):
        print(f"== {name}", flush=True)
        store = [store_run(base, s, tech) for s in p.train_seeds]
        fresh = [r.result() is None for r in store]
        final = [train(base, s, tech, progress=progress)[-1] for s in p.train_seeds]
        arms[name] = {"techniques": {k: v for k, v in dataclasses.asdict(tech).items() if v != getattr(Techniques(), k)},
                      "runs": [{"key": r.key, "seed": s, "trained": t} for r, s, t in zip(store, p.train_seeds, fresh)],
                      "per_seed_acc": [r["test_acc"] for r in final], "step_s": [r["step_s"] for r in final],
                      "memory": memory(p, tech)}
    return {"profile": p.profile, "machine": quality.machine(), "model": base.model, "data": final[0]["data"], "epochs": base.epochs,
            "batch_size": base.batch_size, "seeds": list(p.train_seeds), "arms": arms}


def table(res: dict[str, Any], study: dict[str, Any]) -> pd.DataFrame:
    """Each comparison of the ``study`` (an entry of ``studies``): the paired accuracy change (points) with its 95%
    interval, and the accounted memory of the arm and its reduction against the baseline (WRN-28-2 at full size)."""
    arms, base_mib = res["arms"], res["arms"]["baseline"]["memory"]["total_mib"]
    category = study["category"]
    rows = []
    for (arm, against), what in study["pairs"].items():
        c = change(res, arm, against)
        m = arms[arm]["memory"]
        rows.append({"arm": arm, "against": against, "isolates": what, "accuracy_change": c.mean, "low": c.low,
                     "high": c.high, "seeds": c.n, f"{category}_mib": m[f"{category}_mib"],
                     "total_mib": m["total_mib"],
                     "reduction": base_mib / m["total_mib"],
                     "time_ratio": statistics.median(arms[arm]["step_s"]) / statistics.median(arms[against]["step_s"])})
    return pd.DataFrame(rows)


def caption(res: dict[str, Any]) -> str:
    return (f"Profile `{res['profile']}`: {res['model']} on {res['data']}, {res['epochs']} epochs at batch "
            f"{res['batch_size']}, seeds {res['seeds']} (every arm on each; changes paired by seed, Student's t, 95%). "
            f"Memory: WRN-28-2 at batch 128, full size, accounted; reduction against the fp32 baseline. Time: median "
            f"seconds per step of the arm over its against's, from the training runs themselves (one machine, one run "
            f"after another{', ' + res['machine'] if 'machine' in res else ''}).")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="its combinations_wrn and levers blocks are read")
    ap.add_argument("--data-root", default="data/raw", help="image datasets (Fashion-MNIST at the cpu profile)")
    ap.add_argument("--metrics", type=Path, required=True, help="write every arm's per-seed accuracy and memory here")
    ap.add_argument("--tables", type=Path, help="also write each study of levers.studies whose arms were all trained, "
                    "as Markdown into this folder (11_levers_<study>.md)")
    ap.add_argument("--studies", nargs="+", metavar="STUDY", help="with --tables, these studies' tables only (default: "
                    "every study whose arms were all trained)")
    ap.add_argument("--only", nargs="+", metavar="ARM", required=True,
                    help="the arms to train, each named by its levers' short names joined by '+' (baseline, half-bf16, "
                    "half-bf16+optimi-sgd, microbatch-8+checkpoint-block, ...): a study of their own, written to "
                    "--metrics (pair arms only within one file: one machine, one run store)")


def run(args: argparse.Namespace) -> int:
    try:
        params = yaml.safe_load(args.params.read_text())
        for name in args.only:
            try:
                arm(name)
            except (TypeError, ValueError) as e:
                raise ValueError(f"--only: arm {name!r}: {e}") from None
        found = studies(params)
        unknown = sorted(set(args.studies or ()) - set(found))
        if unknown:
            raise ValueError(f"--studies: no study {unknown} in params.yaml's levers.studies ({', '.join(found)})")
        p = config.load("combinations_wrn", params)
        p.train["data_root"] = args.data_root
        res = train_arms(p, args.only)
    except (ParamError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs.write_json(args.metrics, res)
    for name, study in found.items() if args.tables else ():
        if (args.studies is None or name in args.studies) and all(a in res["arms"] for pair in study["pairs"] for a in pair):
            (args.tables / f"11_levers_{name}.md").write_text(caption(res) + "\n\n" + table(res, study).round(3).to_markdown(index=False) + "\n")
    return 0
