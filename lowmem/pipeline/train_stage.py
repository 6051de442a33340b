"""The training half of each WRN study: its runs trained (or taken from the run store), their results as one small
JSON that the study's notebook reads.

    python -m lowmem.pipeline train STAGE --params data/params/STAGE.yaml --out data/results/STAGE_train.json

STAGE is ``baseline``, ``sparsity``, ``precision``, ``microbatching`` or ``proxy_noise``; the resolved parameters come from
``python -m lowmem.pipeline params``. Each run is keyed by what changes it (``lowmem.wrn.train.run_fields``), so a run that
two studies share (the fp32 reference of every study) is trained once, by whichever stage asks first.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from lowmem import runs
from lowmem.config import STAGES, ParamError
from lowmem.studies import microbatching
from lowmem.studies import params as _study_params  # noqa: F401  (registers the stages' dataclasses)
from lowmem.studies import precision as precision_study
from lowmem.studies import sparsity as sparsity_study
from lowmem.wrn.params import BaselineParams
from lowmem.studies import proxy_noise, quality
from lowmem.wrn.train import Techniques, correct_per_example, store_run, train

Planned = tuple[dict[str, Any], BaselineParams, int, Techniques]


def _baseline_plan(p: BaselineParams) -> list[Planned]:
    return [({}, p, seed, Techniques()) for seed in p.seeds]


PLANS: dict[str, Callable[[Any], list[Planned]]] = {
    "baseline": _baseline_plan,
    "sparsity": sparsity_study.plan,
    "precision": precision_study.plan,
    "microbatching": microbatching.plan,
    "proxy_noise": proxy_noise.plan,
}


def plan(stage: str, p: Any) -> list[Planned]:
    if stage not in PLANS:
        raise ValueError(f"stage {stage!r} trains no WRN runs; the ones that do: {', '.join(PLANS)}")
    return PLANS[stage](p)


def collect(stage: str, p: Any, progress: bool = True) -> dict[str, Any]:
    """Every planned run of ``stage``, trained where the store lacks it; what its notebook reads."""
    planned = plan(stage, p)
    out = []
    for i, (labels, base, seed, tech) in enumerate(planned):
        run = store_run(base, seed, tech)
        trained = run.result() is None
        if progress:
            what = ", ".join(f"{k}={v}" for k, v in labels.items()) or "baseline"
            print(f"[{i + 1}/{len(planned)}] {what}, seed {seed}: {'training' if trained else 'in the store'} ({run.key})", flush=True)
        history = train(base, seed, tech, progress=progress)
        record = {"key": run.key, "labels": labels, "seed": seed, "trained": trained, "history": history}
        correct = correct_per_example(run, history[-1]["test_examples"])
        if correct is not None:  # every run trained since the store kept it; paired per-example statistics read it
            record["test_correct"] = quality.pack_bits(correct)
        out.append(record)
    n = sum(r["trained"] for r in out)
    if progress:
        print(f"{stage}: {len(out)} runs, {n} trained, {len(out) - n} taken from the store", flush=True)
    return {"stage": stage, "profile": p.profile, "runs": out}


def keys(stage: str, p: Any) -> list[str]:
    return [store_run(base, seed, tech).key for _, base, seed, tech in plan(stage, p)]


def results(stage: str, p: Any, path: str | Path, progress: bool = True) -> dict[str, Any]:
    """The results of ``stage`` at parameters ``p``: read from ``path`` (what the ``<stage>_train`` stage wrote)
    when it holds exactly the runs ``p`` plans, else collected and written there (a notebook opened on its own)."""
    path = Path(path)
    if path.exists():
        res = runs.read_json(path)
        if [r["key"] for r in res["runs"]] == keys(stage, p):
            return res
    res = collect(stage, p, progress)
    runs.write_json(path, res)
    return res


def frozen_results(stage: str, p: Any, path: str | Path, command: str, progress: bool = True) -> dict[str, Any]:
    """The results of a stage left out of ``make repro`` (frozen in dvc.yaml, its output committed): read from
    ``path`` as they are, even where the training code has changed since (a frozen result is not retrained by the
    default pipeline; ``current_keys`` says how many runs today's code would key alike). They must hold the runs
    ``p`` plans, by labels and seed; a missing file (a notebook opened alone) is collected here, and so are smoke
    runs where ``path`` holds another profile's, into a file beside it."""
    path = Path(path)
    planned = [(labels, seed) for labels, _, seed, _ in plan(stage, p)]

    def holds_the_plan(f: Path) -> bool:
        res = runs.read_json(f)
        return res["profile"] == p.profile and [(r["labels"], r["seed"]) for r in res["runs"]] == planned

    if path.exists() and not holds_the_plan(path):
        # The committed file is another profile's (a smoke `dvc exp run`, say): the smoke runs take seconds and go
        # beside it, never over it; at any other profile the stage must be rerun on purpose.
        beside = path.with_name(f"{path.stem}-{p.profile}{path.suffix}")
        if p.profile != "smoke" and not (beside.exists() and holds_the_plan(beside)):
            raise ParamError(f"{path} holds other runs than stage {stage} plans at profile {p.profile} (params.yaml "
                             f"changed since it was made); rerun them: {command}")
        path = beside
    if not path.exists():
        runs.write_json(path, collect(stage, p, progress))
    res = runs.read_json(path)
    if not holds_the_plan(path):
        raise ParamError(f"{path} holds other runs than stage {stage} plans at profile {p.profile}; rerun them: {command}")
    res["current_keys"] = sum(r["key"] == k for r, k in zip(res["runs"], keys(stage, p)))
    return res


def final_rows(res: dict[str, Any]) -> pd.DataFrame:
    """One row per run: its last epoch's metrics and its labels (method, mode, norm, ...)."""
    return pd.DataFrame([{**r["history"][-1], **r["labels"]} for r in res["runs"]])


def histories(res: dict[str, Any]) -> pd.DataFrame:
    """Every epoch of every run, with its labels."""
    return pd.DataFrame([{**row, **r["labels"]} for r in res["runs"] for row in r["history"]])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("stage", choices=tuple(PLANS))
    ap.add_argument("--params", type=Path, required=True, help="the stage's resolved parameters (python -m lowmem.pipeline params)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data-root", default="data/raw", help="image datasets, from where this runs (the notebooks' ../data/raw)")


def run(args: argparse.Namespace) -> int:
    resolved = yaml.safe_load(args.params.read_text())
    try:
        if "train" in resolved:
            resolved["train"]["data_root"] = args.data_root
        else:
            resolved["data_root"] = args.data_root
        p = STAGES[args.stage](**resolved)
    except (ParamError, TypeError) as e:
        print(f"error: {args.params}: {e}; regenerate it with python -m lowmem.pipeline params", file=sys.stderr)
        return 2
    runs.write_json(args.out, collect(args.stage, p))
    return 0
