"""Each technique alone on DynamicConv (Sohoni et al. 2019, the translation benchmark): the memory of one update of
the full-size model under each technique's fairseq-train options (accounted on meta), the BLEU of runs trained
side by side at the active profile, and step times measured by alternating short runs.

Every run is ``fairseq-train`` with translation_train's command, lowmem's plugin, and the technique's options
appended (``plugin_args``); the baseline runs through the same plugin with no option, so it is the same model.
Trained runs are evaluated on their last checkpoint without averaging, as a DSR run's checkpoints cannot be
averaged (its sparse patterns move).

    python -m lowmem.studies.translation train --params data/params/translation_techniques.yaml --metrics FILE
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from lowmem import runs
from lowmem.config import ParamError, load, resolve
from lowmem.dynamicconv import corpus, translation
from lowmem.dynamicconv import memory as translation_memory
from lowmem.dynamicconv.params import (
    TranslationDataParams,
    TranslationEvaluateParams,
    TranslationTechniquesParams,
    TranslationTrainParams,
)
from lowmem.dynamicconv.plugin import ARCH, TASK
from lowmem.dynamicconv.translation import PLUGIN_DIR
from lowmem.memory.accounting import CATEGORIES, MIB

PLUGIN = ["--user-dir", str(PLUGIN_DIR), "--task", TASK, "--arch", ARCH]


def plugin_args(p: TranslationTechniquesParams, name: str) -> list[str]:
    """What a technique appends to translation_train's command: the plugin, the DSR periods, its own options."""
    return [*PLUGIN, "--dsr-periods", json.dumps(p.dsr_periods, separators=(",", ":")), *map(str, p.techniques[name])]


def train_params(p: TranslationTechniquesParams, name: str) -> TranslationTrainParams:
    """The run of technique ``name``; a technique's ``--max-tokens`` (microbatching's T/k) becomes the run's batch
    size, which ``translation.train_args`` places after the options."""
    args = plugin_args(p, name)
    max_tokens = p.max_tokens
    if "--max-tokens" in args:
        i = args.index("--max-tokens")
        max_tokens, args = int(args[i + 1]), args[:i] + args[i + 2:]
    return TranslationTrainParams(profile=p.profile, seed=p.seed, recipe_args=p.recipe_args, device=p.device,
                                  scale_args=[*p.scale_args, *args], max_tokens=max_tokens,
                                  max_update=p.max_update, warmup_updates=p.warmup_updates, lr=p.lr)


def memory(p: TranslationTechniquesParams) -> pd.DataFrame:
    """One row per technique: the accounted peak of one update of the full-size model (the recipe's arguments,
    no profile scaling) at ``max_tokens`` tokens in sentences of ``reference_length``, by category."""
    rows = []
    for name in p.techniques:
        r = translation_memory.account([*p.recipe_args, *plugin_args(p, name)], p.src_vocab, p.tgt_vocab, p.max_tokens,
                                       p.reference_length, seed=p.seed)
        row: dict[str, Any] = {"technique": name, "options": " ".join(map(str, p.techniques[name])) or "(none)"}
        row.update({f"{c}_mib": r.at_peak[c] / MIB for c in CATEGORIES})
        row.update({f"{c}_max_mib": r.category_max[c] / MIB for c in ("model", "gradients", "optimizer")})
        row.update(total_mib=r.peak / MIB, peak_phase=r.peak_phase)
        rows.append(row)
    df = pd.DataFrame(rows)
    df["reduction"] = float(df.loc[df.technique == "baseline", "total_mib"].iloc[0]) / df.total_mib
    return df


def train_all(p: TranslationTechniquesParams, data_dir: Path = translation.DATA) -> list[dict[str, Any]]:
    """Trains and scores each technique of ``p.trained``; a finished run is not trained again."""
    out = []
    for name in p.trained:
        print(f"== {name}", flush=True)
        res = translation.train_result(train_params(p, name), data_dir)
        records, save_dir = res["records"], Path(res["dir"])
        ev = translation.evaluate(TranslationEvaluateParams(profile=p.profile, device=p.device), data_dir, save_dir,
                                  save_dir / "generate", tuple(PLUGIN[:2]))
        last_valid = [r for r in records if r["kind"] == "valid"][-1:]
        out.append({"technique": name, "key": res["key"], "trained": res["trained"], "bleu_tokenized": ev["bleu_tokenized"], "sacrebleu": ev["sacrebleu"],
                    "valid_loss": last_valid[0]["valid_loss"] if last_valid else None,
                    "updates": max(int(r["num_updates"]) for r in records if "num_updates" in r)})
    return out


def time_steps(p: TranslationTechniquesParams, data_dir: Path = translation.DATA) -> list[dict[str, Any]]:
    """Seconds per update of each technique of ``p.timed`` at the active profile: ``timing_repeats`` rounds, each
    running every technique for ``timing_updates`` updates in turn, so that load on the machine hits all alike.
    The first two updates of a run (allocation, first-call overheads) are not timed."""
    rows = []
    for rep in range(p.timing_repeats):
        for name in p.timed:
            t = train_params(p, name)
            args = translation.train_args(dataclasses.replace(t, max_update=p.timing_updates), data_dir / "bin", data_dir / "timing")
            args += ["--no-save", "--disable-validation", "--log-interval", "1"]
            r = subprocess.run([*corpus.fairseq_cli("train"), *args], capture_output=True, text=True, env=corpus.fairseq_env())
            if r.returncode != 0:
                raise RuntimeError(f"fairseq-train ({name}) failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
            ups = [rec["ups"] for rec in translation.parse_log(r.stdout.splitlines() + r.stderr.splitlines())
                   if rec["kind"] == "train_inner" and rec["num_updates"] > 2]
            rows.append({"technique": name, "repeat": rep, "seconds_per_update": statistics.median(1 / u for u in ups)})
            print(f"{name} (round {rep + 1}): {rows[-1]['seconds_per_update']:.3f} s/update", flush=True)
    return rows


def run(p: TranslationTechniquesParams, data_dir: Path = translation.DATA) -> dict[str, Any]:
    """Training, scoring and timing at the active profile: what the stage translation_techniques_train records."""
    trained = train_all(p, data_dir)
    timing = time_steps(p, data_dir)
    base = next(r for r in trained if r["technique"] == "baseline")
    per = pd.DataFrame(timing).groupby("technique").seconds_per_update.median()
    for r in trained:
        r["bleu_change"] = round(r["bleu_tokenized"] - base["bleu_tokenized"], 2)
        r["sacrebleu_change"] = round(r["sacrebleu"] - base["sacrebleu"], 2)
    return {"profile": p.profile, "max_update": p.max_update, "seed": p.seed, "trained": trained, "timing": timing,
            "time_ratio": {n: round(float(per[n] / per["baseline"]), 3) for n in p.timed}}


def run_at_profile(params: dict[str, Any], data_dir: Path) -> dict[str, Any]:
    """What the stages do, for a notebook opened where the pipeline has not run: the corpus prepared if missing,
    then ``run`` at the profile of ``params`` (a parsed params.yaml)."""

    if not (data_dir / "bin" / "corpus.json").exists():
        data = TranslationDataParams(**resolve("translation_data", params))
        translation.prepare(data, data_dir)
        translation.binarize(data, data_dir)
    return run(TranslationTechniquesParams(**resolve("translation_techniques", params)), data_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("train",))
    ap.add_argument("--params", type=Path, required=True, help="resolved parameters (python -m lowmem.dynamicconv.params translation_techniques)")
    ap.add_argument("--data-dir", type=Path, default=translation.DATA)
    ap.add_argument("--metrics", type=Path, required=True, help="write the runs' BLEU and step times here as JSON")
    ap.add_argument("--results", type=Path, help="a copy of the metrics, kept in the DVC cache (dvc.yaml)")
    args = ap.parse_args(argv)
    try:
        result = run(load("translation_techniques", args.params), args.data_dir)
    except (ParamError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs.write_json(args.metrics, result)
    if args.results:
        runs.write_json(args.results, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
