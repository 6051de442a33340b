"""The four techniques combined (Sohoni et al. 2019, the combination study behind 60.7x and 8.7x), the stage command:
the sweep of the grid (``combination_grid``, accounted by ``combination_memory``), the choice of what trains
(``combination_search``), and the training of one chosen combination, a slot of a DVC ``matrix`` stage.

- WRN: every combination is a ``lowmem.wrn.train.Techniques``; memory is WRN-28-2's step at B = 128, step time is the
  profile's trained model at its batch, and a chosen combination trains with ``lowmem.wrn.train.train``.
- DynamicConv: every combination is a set of fairseq-train options of lowmem's plugin (``lowmem.studies.translation``);
  memory is the full-size model's update at the recipe's tokens, and a chosen combination trains with fairseq-train.

    python -m lowmem.pipeline combinations sweep wrn|dynamicconv [--params params.yaml]
    python -m lowmem.pipeline combinations account wrn   (the accounting alone, into data/combinations/wrn_memory.csv)
    python -m lowmem.pipeline combinations train wrn|dynamicconv --slot N [--params params.yaml]
    python -m lowmem.pipeline combinations search wrn   (then train the slots it picked)

A slot whose persisted metrics already hold its configuration trained with the same run keys is kept, so a search
whose picks moved retrains only what changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from lowmem import config, runs
from lowmem.config import ParamError
from lowmem.dynamicconv import translation
from lowmem.dynamicconv.params import TranslationEvaluateParams
from lowmem.studies import quality
from lowmem.studies.combination_grid import (TASKS, CombinationsParams, grid, name, translation_params,
                                             wrn_techniques)
from lowmem.studies.combination_memory import MEMORY_CACHE, sweep, wrn_memory_rows
from lowmem.studies.combination_search import chosen_slots, search_slots, search_step, select
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.train import store_run, summarize, train


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


def add_arguments(ap: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
    try:
        p = config.load(f"combinations_{args.task}", yaml.safe_load(args.params.read_text()))
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
