"""Each technique alone on DynamicConv (Sohoni et al. 2019, the translation benchmark): the memory of one update of
the full-size model under each technique's fairseq-train options (accounted on meta), the BLEU of runs trained
side by side at the active profile, and step times measured by alternating short runs.

Every run is ``fairseq-train`` with translation_train's command, lowmem's plugin, and the technique's options
appended (``plugin_args``); the baseline runs through the same plugin with no option, so it is the same model.
Trained runs are evaluated on their last checkpoint without averaging, as a DSR run's checkpoints cannot be
averaged (its sparse patterns move). The captions, figures, tables and metrics of notebook 08 are at the end
(``results`` reads the training stage's result, or runs it where a notebook opens before ``dvc repro``).

    python -m lowmem.pipeline translation train --params data/params/translation_techniques.yaml --metrics FILE [--only NAME ...]

``--only`` trains and times the named techniques and the baseline into a metrics file of their own, with their
full-size memory (stages translation_levers_train, translation_activations_train and translation_kahan_train, the
levers beyond the paper): runs pair only within one file, one machine's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import multiprocessing
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
import yaml
from matplotlib.figure import Figure
from tqdm import tqdm

from lowmem import runs
from lowmem.config import PARAMS_YAML, ParamError, load, resolve
from lowmem.dynamicconv import commands, translation
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
from lowmem.studies import quality

PLUGIN = ["--user-dir", str(PLUGIN_DIR), "--task", TASK, "--arch", ARCH]
BOOTSTRAP = 1000  # sacreBLEU's default number of paired-bootstrap resamples


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


def memory_row(p: TranslationTechniquesParams, name: str) -> dict[str, Any]:
    """The accounted peak of technique ``name``'s update at full size, by category (a row of ``memory``)."""
    r = translation_memory.account([*p.recipe_args, *plugin_args(p, name)], p.src_vocab, p.tgt_vocab, p.max_tokens,
                                   p.reference_length, seed=p.seed)
    row: dict[str, Any] = {"technique": name, "options": " ".join(map(str, p.techniques[name])) or "(none)"}
    row.update({f"{c}_mib": r.at_peak[c] / MIB for c in CATEGORIES})
    row.update({f"{c}_max_mib": r.category_max[c] / MIB for c in ("model", "gradients", "optimizer")})
    row.update(total_mib=r.peak / MIB, peak_phase=r.peak_phase)
    return row


def memory(p: TranslationTechniquesParams, progress: bool = False, workers: int = 1) -> pd.DataFrame:
    """One row per technique: the accounted peak of one update of the full-size model (the recipe's arguments,
    no profile scaling) at ``max_tokens`` tokens in sentences of ``reference_length``, by category. ``progress``:
    a bar, for the combination sweep's hundreds of configurations (several seconds each), accounted on ``workers``
    processes (each account is PyTorch's dispatch in Python, one core; no number depends on how many)."""
    names = list(p.techniques)
    account = functools.partial(memory_row, p)
    with tqdm(total=len(names), desc=f"accounting DynamicConv updates at full size ({workers} process{'es' if workers > 1 else ''})",
              disable=not progress, mininterval=10) as bar:
        # Spawned: each worker imports torch and fairseq afresh, not a notebook kernel's threads; map keeps the order.
        pool = (ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
                if workers > 1 and len(names) > 1 else None)
        with pool or contextlib.nullcontext():
            rows = []
            for row in pool.map(account, names, chunksize=2) if pool else map(account, names):
                rows.append(row)
                bar.update()
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
                    "hypotheses": translation.detokenized(translation.hypotheses((save_dir / "generate" / "generate.txt").read_text())),
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
            r = commands.captured("train", args)
            if r.returncode != 0:
                raise RuntimeError(f"fairseq-train ({name}) failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
            ups = [rec["ups"] for rec in translation.parse_log(r.stdout.splitlines() + r.stderr.splitlines())
                   if rec["kind"] == "train_inner" and rec["num_updates"] > 2]
            rows.append({"technique": name, "repeat": rep, "seconds_per_update": statistics.median(1 / u for u in ups)})
            print(f"{name} (round {rep + 1}): {rows[-1]['seconds_per_update']:.3f} s/update", flush=True)
    return rows


def train_and_time(p: TranslationTechniquesParams, data_dir: Path = translation.DATA) -> dict[str, Any]:
    """Training, scoring and timing at the active profile: what the stage translation_techniques_train records."""
    trained = train_all(p, data_dir)
    timing = time_steps(p, data_dir)
    base = next(r for r in trained if r["technique"] == "baseline")
    per = pd.DataFrame(timing).groupby("technique").seconds_per_update.median()
    refs = translation.test_references(data_dir)
    for r in trained:
        r["bleu_change"] = round(r["bleu_tokenized"] - base["bleu_tokenized"], 2)
        r["sacrebleu_change"] = round(r["sacrebleu"] - base["sacrebleu"], 2)
        # One seed: the interval is the test set's sampling (sacreBLEU's paired bootstrap), not training's noise.
        change = quality.bleu_paired(r["hypotheses"], base["hypotheses"], refs, resamples=BOOTSTRAP, lowercase=translation.LOWERCASE)
        r["sacrebleu_change_low"], r["sacrebleu_change_high"] = round(change.low, 2), round(change.high, 2)
    for r in trained:
        del r["hypotheses"]  # kept in each run's generate.txt; the metrics stay small
    return {"profile": p.profile, "max_update": p.max_update, "seed": p.seed, "trained": trained, "timing": timing,
            "time_ratio": {n: round(float(per[n] / per["baseline"]), 3) for n in p.timed}}


def run_only(p: TranslationTechniquesParams, only: list[str], data_dir: Path = translation.DATA) -> dict[str, Any]:
    """``run`` for the baseline and the techniques ``only``, with the CPU it ran on (``machine``): a study of its
    own, since the same seed trains to another BLEU on another CPU, so runs pair only within one result. With each
    technique's full-size memory (``memory``, by category in MiB), so that a combination the DynamicConv grid does
    not hold has its reduction beside its BLEU."""
    unknown = sorted(set(only) - set(p.techniques))
    if unknown:
        raise ParamError(f"--only: unknown technique(s) {unknown}; techniques: {', '.join(p.techniques)}")
    names = ["baseline", *[n for n in only if n != "baseline"]]
    q = dataclasses.replace(p, trained=names, timed=names)
    mem = memory(dataclasses.replace(q, techniques={n: p.techniques[n] for n in names}))
    cols = [*(f"{c}_mib" for c in CATEGORIES), "total_mib", "peak_phase"]
    return {**train_and_time(q, data_dir), "machine": quality.machine(),
            "memory": {r["technique"]: {c: r[c] for c in cols} for r in mem.to_dict("records")}}


@dataclasses.dataclass
class Trained:
    """What stage translation_techniques_train recorded (``run``'s result) and the corpus the runs trained on."""

    runs: dict[str, Any]
    corpus: dict[str, Any]  # translation_binarize's bin/corpus.json


def results(p: TranslationTechniquesParams, data_dir: str | Path, train_path: str | Path) -> Trained:
    """The training stage's result; when ``train_path`` is missing (a notebook opened before ``dvc repro``), runs it
    here: the corpus prepared at ``p.profile`` (this checkout's params.yaml) if missing, then ``run``."""
    data_dir, train_path = Path(data_dir), Path(train_path)
    if not train_path.exists():
        if not (data_dir / "bin" / "corpus.json").exists():
            params = yaml.safe_load(PARAMS_YAML.read_text())
            params["base"].update(profile=p.profile, seed=p.seed)
            data = TranslationDataParams(**resolve("translation_data", params))
            translation.prepare(data, data_dir)
            translation.binarize(data, data_dir)
        runs.write_json(train_path, train_and_time(p, data_dir))
    return Trained(json.loads(train_path.read_text()), json.loads((data_dir / "bin" / "corpus.json").read_text()))


# --- what notebook 08 shows: captions, the figures, the tables and the metrics ---------------------------------------


@functools.cache
def _parameters(recipe_args: tuple[str, ...], src_vocab: int, tgt_vocab: int) -> int:
    return translation_memory.parameter_count(list(recipe_args), src_vocab, tgt_vocab)


def parameters_full_size(p: TranslationTechniquesParams) -> int:
    """Parameters of the full-size dense model (built on meta once per recipe)."""
    return _parameters(tuple(p.recipe_args), p.src_vocab, p.tgt_vocab)


def memory_caption(p: TranslationTechniquesParams) -> str:
    """The caption of the memory table (``memory``)."""
    return (
        f"lightconv_iwslt_de_en, full size ({parameters_full_size(p):,} parameters dense, vocabularies {p.src_vocab}/{p.tgt_vocab}), "
        f"one update of {p.max_tokens} tokens in sentences of {p.reference_length}; accounted on the meta device with random "
        f"tokens (memory depends only on shapes), the same in every profile. Reduction = baseline peak / technique's peak. "
        f"MiB = 2^20 bytes."
    )


def memory_shown(mem: pd.DataFrame) -> pd.DataFrame:
    """The memory table as the notebook shows it: the categories at the peak, the total, the reduction."""
    return mem[["technique", "options", *[f"{c}_mib" for c in CATEGORIES], "total_mib", "reduction", "peak_phase"]]


def memory_figure(p: TranslationTechniquesParams, mem: pd.DataFrame) -> Figure:
    """One stacked bar per technique: the accounted peak by category, labelled with its total and reduction."""
    sns.set_theme(style="whitegrid")
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(mem) + 1.5))
    left = pd.Series(0.0, index=mem.technique)
    for cat, color in zip(CATEGORIES, sns.color_palette("colorblind")):
        vals = mem.set_index("technique")[f"{cat}_mib"].reindex(mem.technique)
        ax.barh(mem.technique, vals, left=left, color=color, label=cat)
        left += vals
    for y, r in enumerate(mem.itertuples()):
        ax.text(r.total_mib + 20, y, f"{r.total_mib:,.0f} MiB ({r.reduction:.2f}x)", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="MiB at the update's peak (accounted)", ylabel="", xlim=(0, mem.total_mib.max() * 1.35),
           title=f"DynamicConv (full size), one update at {p.max_tokens} tokens · profile: {p.profile} · inputs: random tokens (shapes only)")
    # Beside the bars, not over them: a bar of any length may end at the legend's corner.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=True)
    fig.text(0.5, -0.02, memory_caption(p), ha="center", va="top", wrap=True, fontsize=8)
    return fig


def run_table(mem: pd.DataFrame, t: Trained) -> pd.DataFrame:
    """Per technique: its full-size memory beside the BLEU of its run and its time ratio (empty where not run)."""
    ratio = pd.Series(t.runs["time_ratio"], name="time_ratio")
    return mem[["technique", "options", "total_mib", "reduction"]].merge(pd.DataFrame(t.runs["trained"]), on="technique", how="left").merge(
        ratio, left_on="technique", right_index=True, how="left")


def run_caption(p: TranslationTechniquesParams, t: Trained) -> str:
    """The caption of the run table: corpus, run length, seed, and where the times were taken."""
    machine = "CPU" if p.device == "cpu" or not torch.cuda.is_available() else "GPU"
    return (
        f"BLEU: profile `{p.profile}`, corpus: {t.corpus['source']}; model as scaled for the profile, {t.runs['max_update']} "
        f"updates per run, seed {t.runs['seed']}, last checkpoint. sacrebleu_change_low/high: the 95% interval of the "
        f"sacreBLEU change by sacreBLEU's paired bootstrap over test sentences ({BOOTSTRAP} resamples; one seed, so it "
        f"leaves out training's own noise; notebook 09 and the headline widen it by the seed sd stage bleu_noise_train "
        f"measured, where it measured this profile and length). Only the paper profile is the paper's model on IWSLT'14. "
        f"Memory: the full-size model as above. Time ratio: seconds per update against the baseline's, on this machine "
        f"({machine}). Empty cells: not trained or not timed at this profile (params.yaml, translation_techniques)."
    )


def bleu_time_figure(p: TranslationTechniquesParams, t: Trained) -> Figure:
    """Left: each trained run's BLEU change against the baseline; right: each timed run's seconds per update against
    the baseline's of the same round (bars: median, lines: the rounds' span)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"wspace": 0.45})
    trained = pd.DataFrame(t.runs["trained"])
    sns.barplot(trained, y="technique", x="sacrebleu_change", hue="technique", palette="colorblind", legend=False, ax=ax1)
    ax1.axvline(0, color="black", lw=0.8)
    interval = "sacrebleu_change_low" in trained
    right = trained.sacrebleu_change.clip(lower=0)
    if interval:  # results recorded before the paired bootstrap have no interval
        ax1.errorbar(trained.sacrebleu_change, range(len(trained)), fmt="none", ecolor="black", capsize=3, lw=1,
                     xerr=[trained.sacrebleu_change - trained.sacrebleu_change_low, trained.sacrebleu_change_high - trained.sacrebleu_change])
        right = trained[["sacrebleu_change_high"]].assign(zero=0.0).max(axis=1)
    # Each value right of its bar, whisker and the zero line, so that no label sits on a bar or a whisker.
    pad = 0.03 * max(1.0, float(trained.sacrebleu_change.abs().max()))
    for i, (change, x) in enumerate(zip(trained.sacrebleu_change, right)):
        ax1.text(x + pad, i, f"{change:+.2f}", va="center", fontsize=8)
    ax1.margins(x=0.25)
    ax1.set(xlabel="sacreBLEU change against the baseline" + ("\n(whiskers: 95% paired bootstrap over test sentences, one seed)" if interval else ""),
            ylabel="")
    ax1.set_title(f"BLEU change · profile: {p.profile}\n{t.corpus['source']}", fontsize=9)
    timing = pd.DataFrame(t.runs["timing"])
    base = timing.query("technique == 'baseline'").groupby("repeat").seconds_per_update.median().rename("base")
    timing = timing.merge(base, left_on="repeat", right_index=True)
    timing["ratio"] = timing.seconds_per_update / timing.base
    sns.barplot(timing, y="technique", x="ratio", hue="technique", palette="colorblind", legend=False, estimator="median",
                errorbar=("pi", 100), ax=ax2)
    ax2.axvline(1, color="black", lw=0.8)
    ratios = timing.groupby("technique").ratio
    for i, name in enumerate(dict.fromkeys(timing.technique)):  # seaborn's row order: first appearance
        ax2.text(max(ratios.max()[name], 1.0) + 0.02, i, f"{ratios.median()[name]:.2f}x", va="center", fontsize=8)
    ax2.margins(x=0.15)
    ax2.set(xlabel="seconds per update / baseline's\n(median; lines span the repeats)", ylabel="")
    ax2.set_title(f"Time per update · profile: {p.profile}\non this machine", fontsize=9)
    fig.text(0.5, -0.1, run_caption(p, t), ha="center", va="top", wrap=True, fontsize=8)
    return fig


def tables(p: TranslationTechniquesParams, mem: pd.DataFrame, t: Trained) -> dict[str, tuple[pd.DataFrame, str]]:
    """The tables written under figures/, by file name (no suffix): (rounded table, caption)."""
    return {
        "08_translation_techniques_memory": (mem.round(4), memory_caption(p)),
        "08_translation_techniques": (run_table(mem, t).round(4), run_caption(p, t)),
    }


def metrics(p: TranslationTechniquesParams, mem: pd.DataFrame, t: Trained) -> dict[str, Any]:
    """The stage's metrics JSON (metrics/translation_techniques.json): memory per technique, BLEU and time ratios."""
    return {
        "profile": p.profile, "corpus": t.corpus["source"], "parameters_full_size": parameters_full_size(p),
        "max_tokens": p.max_tokens, "updates_per_run": t.runs["max_update"],
        "memory_mib": {r.technique: {**{c: round(getattr(r, f"{c}_mib"), 3) for c in CATEGORIES}, "total": round(r.total_mib, 3),
                                     "reduction": round(r.reduction, 4)} for r in mem.itertuples()},
        "bleu": {r["technique"]: {k: r[k] for k in ("bleu_tokenized", "sacrebleu", "bleu_change", "sacrebleu_change",
                                                    "sacrebleu_change_low", "sacrebleu_change_high") if k in r}
                 for r in t.runs["trained"]},
        "time_ratio": t.runs["time_ratio"],
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("step", choices=("train",))
    ap.add_argument("--params", type=Path, required=True, help="resolved parameters (python -m lowmem.pipeline params)")
    ap.add_argument("--data-dir", type=Path, default=translation.DATA)
    ap.add_argument("--metrics", type=Path, required=True, help="write the runs' BLEU and step times here as JSON")
    ap.add_argument("--results", type=Path, help="a copy of the metrics, kept in the DVC cache (dvc.yaml)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="train and time these techniques and the baseline only "
                    "(a study of its own, written to --metrics)")


def run(args: argparse.Namespace) -> int:
    try:
        p = load("translation_techniques", args.params)
        if args.only:
            result = run_only(p, args.only, args.data_dir)
        else:
            result = train_and_time(p, args.data_dir)
    except (ParamError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs.write_json(args.metrics, result)
    if args.results:
        runs.write_json(args.results, result)
    return 0
