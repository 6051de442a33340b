"""How far DynamicConv's BLEU moves from seed to seed, at several run lengths, and what that means for the paired
bootstrap's interval.

Every DynamicConv quality change in this study is one seed of a configuration against one seed of the baseline,
with sacreBLEU's paired bootstrap over test sentences as its interval. That interval sees the test set's sampling
only. This trains the baseline (stage 08's command and data) on ``translation_techniques.noise_seeds``, each seed
once to the last of ``noise_updates``, decodes the checkpoint it saved at each of them, and asks, at each length,
the questions notebook 10 asks for WRN:

- the seed sd of sacreBLEU, with its chi-square interval, and the paired half-width t(n-1) · √2 · sd / √n that n
  seeds would give (``lowmem.studies.quality.half_width``), with the seeds needed for the paper's 0.15 BLEU
  and for ±0.3;
- for every two seeds of the same configuration, whose true difference is zero, whether the bootstrap interval
  covers zero. If it often does not, a one-seed bootstrap interval understates the noise.

fairseq seeds each update from the seed and the update's number, so the checkpoint a longer run saves at update u
is the model a u-update run ends with (tests/test_translation.py checks the parameters bit for bit): one run per
seed gives every length. The stage is left out of ``make repro``; its result is committed
(metrics/bleu_noise_train.json). Notebook 08 reads it, and notebook 09 and the headline widen DynamicConv's
one-seed intervals by its seed sd (``frontier.widen_by_seed_noise``).

    python -m lowmem.pipeline bleu-noise --params data/params/translation_techniques.yaml --metrics FILE
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter
from scipy import stats

from lowmem import runs
from lowmem.config import ParamError, load
from lowmem.dynamicconv import translation
from lowmem.dynamicconv.params import TranslationEvaluateParams, TranslationTechniquesParams, TranslationTrainParams
from lowmem.studies import quality
from lowmem.studies import translation as translation_study
from lowmem.studies.quality import MAX_SEEDS, half_width, sd_interval, seeds_needed

COMMAND = ("python -m lowmem.pipeline params && python -m lowmem.pipeline bleu-noise "
           "--params data/params/translation_techniques.yaml --metrics metrics/bleu_noise_train.json")
TARGETS = (0.15, 0.3)  # BLEU: the paper's budget, and the aim for the proxy
SEEDS_SHOWN = (2, 3, 5, 8)


def run_params(p: TranslationTechniquesParams, seed: int) -> TranslationTrainParams:
    """Seed ``seed``'s baseline run to the last of ``p.noise_updates``, saving a checkpoint at every multiple of
    their greatest common divisor."""
    every = math.gcd(*p.noise_updates)
    t = translation_study.train_params(dataclasses.replace(p, seed=seed, max_update=max(p.noise_updates)), "baseline")
    return dataclasses.replace(t, scale_args=[*t.scale_args, "--save-interval-updates", str(every)])


def wall_seconds(checkpoint: Path) -> float:
    """Seconds from a run's start to the update ``checkpoint`` was saved at: fairseq's own clock, which it keeps in
    the checkpoint (``extra_state.previous_training_time``; the validations and checkpoint saves before it included),
    exact at any update, where its log has a record only every ``--log-interval`` updates."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    return float(state["extra_state"]["previous_training_time"])


def train(p: TranslationTechniquesParams, data_dir: Path = translation.DATA) -> dict[str, Any]:
    """The baseline on every seed of ``p.noise_seeds`` (from the run store where it has run), scored at each of
    ``p.noise_updates``, and the paired bootstrap of every two seeds at each."""
    if len(p.noise_seeds) < 2:
        raise ParamError(f"translation_techniques.noise_seeds needs at least 2 seeds for a spread, got {p.noise_seeds}")
    refs = translation.test_references(data_dir)
    last = max(p.noise_updates)
    rows, hyps = [], {}
    for seed in p.noise_seeds:
        print(f"== baseline, seed {seed}, to {last} updates", flush=True)
        res = translation.train_result(run_params(p, seed), data_dir)
        save_dir = Path(res["dir"])
        scores = []
        for u in p.noise_updates:
            out = save_dir / "generate" / str(u)
            checkpoint = translation.update_checkpoint(save_dir, u, last)
            ev = translation.evaluate(TranslationEvaluateParams(profile=p.profile, device=p.device), data_dir, save_dir,
                                      out, tuple(translation_study.PLUGIN[:2]), checkpoint=checkpoint)
            hyps[seed, u] = translation.detokenized(translation.hypotheses((out / "generate.txt").read_text()))
            scores.append({"updates": u, "sacrebleu": ev["sacrebleu"], "bleu_tokenized": ev["bleu_tokenized"],
                           "wall_s": wall_seconds(checkpoint)})
        rows.append({"seed": seed, "key": res["key"], "trained": res["trained"], "scores": scores})
    pairs = []
    for u in p.noise_updates:
        for a, b in itertools.combinations(p.noise_seeds, 2):
            c = quality.bleu_paired(hyps[b, u], hyps[a, u], refs, resamples=translation_study.BOOTSTRAP,
                                    lowercase=translation.LOWERCASE)
            pairs.append({"updates": u, "seeds": f"{a}-{b}", "change": round(c.mean, 3), "low": round(c.low, 3),
                          "high": round(c.high, 3)})
    return {"profile": p.profile, "max_update": p.max_update, "updates": list(p.noise_updates),
            "bootstrap_resamples": translation_study.BOOTSTRAP, "machine": quality.machine(), "runs": rows, "pairs": pairs}


def results(p: TranslationTechniquesParams, data_dir: str | Path, path: str | Path) -> dict[str, Any]:
    """Stage bleu_noise_train's committed result when it holds ``p``'s seeds and update counts at ``p``'s profile;
    else, at the smoke profile, runs trained here (seconds) into a file beside it. At another profile a missing or
    other result says how to run the stage."""
    path = Path(path)

    def holds(f: Path) -> bool:
        res = runs.read_json(f)
        return (res["profile"], res["max_update"], res.get("updates"), [r["seed"] for r in res["runs"]]) == \
            (p.profile, p.max_update, p.noise_updates, p.noise_seeds)

    if p.profile != "smoke" and not (path.exists() and holds(path)):
        # Minutes per seed: a notebook never trains them behind the reader's back.
        raise ParamError(f"{path} {'holds other runs than' if path.exists() else 'is missing, with'} "
                         f"translation_techniques.noise_seeds and noise_updates at profile {p.profile}; run them: {COMMAND}")
    if path.exists() and not holds(path):
        path = path.with_name(f"{path.stem}-smoke{path.suffix}")
    if not (path.exists() and holds(path)):
        runs.write_json(path, train(p, Path(data_dir)))
    return runs.read_json(path)


def summary_row(res: dict[str, Any], updates: int) -> dict[str, Any]:
    """At ``updates``: the seed spread of sacreBLEU, the paired half-width for a few seed counts, the seeds each
    target needs, and how often the one-seed bootstrap interval covered a true zero."""
    bleu = quality.seed_scores(res, updates)
    n, sd = len(bleu), statistics.stdev(bleu)
    low, high = sd_interval(sd, n)
    pairs = pd.DataFrame([q for q in res["pairs"] if q["updates"] == updates])
    covered = int(((pairs.low <= 0) & (pairs.high >= 0)).sum())
    row: dict[str, Any] = {"updates": updates, "seeds": n, "sacrebleu_mean": statistics.mean(bleu),
                           "seed_sd": sd, "seed_sd_low": low, "seed_sd_high": high,
                           "bootstrap_half_width": float(((pairs.high - pairs.low) / 2).median()),
                           "pairs_covering_zero": f"{covered}/{len(pairs)}",
                           # Each interval is 95%: under a true zero it misses with chance 0.05 (pairs share seeds, so
                           # this binomial p is indicative, not exact).
                           "coverage_p": float(stats.binomtest(covered, len(pairs), quality.LEVEL).pvalue)}
    row |= {f"half_width_{k}_seeds": half_width(sd, k) for k in SEEDS_SHOWN}
    row |= {f"seeds_for_{t:g}": seeds_needed(sd, t) for t in TARGETS}
    # What a seed costs at this length, and what each target costs one configuration (its own seeds; the baseline's
    # are shared by every configuration): the run budget that decides the length.
    walls = [next(s for s in r["scores"] if s["updates"] == updates).get("wall_s") for r in res["runs"]]
    minutes = statistics.median(walls) / 60 if None not in walls else math.nan
    row["minutes_per_seed"] = minutes
    row |= {f"minutes_for_{t:g}": row[f"seeds_for_{t:g}"] * minutes if row[f"seeds_for_{t:g}"] else math.nan
            for t in TARGETS}
    return row


def summary(res: dict[str, Any]) -> pd.DataFrame:
    """``summary_row`` at each decoded update count."""
    return pd.DataFrame([summary_row(res, u) for u in res["updates"]])


def caption(p: TranslationTechniquesParams, res: dict[str, Any]) -> str:
    return (f"DynamicConv baseline (stage 08's command) at profile `{res['profile']}`, seeds "
            f"{', '.join(str(r['seed']) for r in res['runs'])}, each trained once to {max(res['updates'])} updates and "
            f"decoded at {', '.join(map(str, res['updates']))} (the checkpoint it saved there); the techniques train "
            f"{res['max_update']}. sacreBLEU on the test split; scored on {res.get('machine', 'an unrecorded CPU')}, where the runs "
            f"were trained unless the run store already held them. "
            f"Seed sd: the sample sd over seeds, with its 95% chi-square interval. half_width_k_seeds: t(k-1)·√2·sd/√k, "
            f"the 95% half-width of a mean paired change over k seeds. seeds_for_T: the fewest seeds whose half-width "
            f"is at most T BLEU (empty: more than {MAX_SEEDS}). minutes_per_seed: the median over seeds of fairseq's wall "
            f"clock to that update (its validations and checkpoint saves on the way included); minutes_for_T: seeds_for_T x minutes_per_seed, "
            f"one configuration's training for T. bootstrap_half_width: the median half-width of "
            f"sacreBLEU's paired bootstrap ({res['bootstrap_resamples']} resamples) between two seeds; "
            f"pairs_covering_zero: how many of those intervals hold the true zero difference of two seeds of one "
            f"configuration.")


def figure(res: dict[str, Any]) -> Figure:
    """Left: each seed's sacreBLEU against updates. Middle: the bootstrap interval of every two seeds at each length,
    against their true difference of zero. Right: the paired seed interval's half-width against the number of seeds,
    one line per length, with the targets."""
    updates = res["updates"]
    colors = dict(zip(updates, plt.get_cmap("viridis")(np.linspace(0.0, 0.8, len(updates)))))
    sd = {u: summary_row(res, u)["seed_sd"] for u in updates}
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 5), width_ratios=[1.0, 1.2, 1.2])
    for r in res["runs"]:
        ax1.plot(updates, [s["sacrebleu"] for s in r["scores"]], marker="o", label=f"seed {r['seed']}")
    ax1.set_xticks(updates)
    ax1.set_xlabel("updates")
    ax1.set_ylabel("sacreBLEU (test split)")
    ax1.set_title("Baseline, one line per seed\nsd " + ", ".join(
        f"{sd[u]:.2f}" for u in updates) + " at these lengths", fontsize=10)
    ax1.legend(fontsize=8, loc="lower right")
    pairs = pd.DataFrame(res["pairs"])
    covers = ((pairs.low <= 0) & (pairs.high >= 0)).to_numpy()
    groups = {u: i for i, u in enumerate(updates)}
    per = len(pairs) // len(updates)
    # One block of rows per length, a blank row between blocks.
    y = np.array([groups[u] * (per + 1) + i % per for i, u in enumerate(pairs.updates)])
    for ok, color, label in ((True, "tab:green", "holds 0"), (False, "tab:red", "excludes 0")):
        sel = pairs[covers == ok]
        if len(sel):
            ax2.errorbar(sel.change, y[covers == ok], xerr=[sel.change - sel.low, sel.high - sel.change], fmt="o",
                         color=color, capsize=2, markersize=3, label=f"{label}: {len(sel)} of {len(pairs)} (all lengths)")
    ax2.axvline(0, color="black", linewidth=1)
    ax2.set_yticks(y, [f"{u} upd., seeds {s}" for u, s in zip(pairs.updates, pairs.seeds)], fontsize=7)
    ax2.invert_yaxis()
    ax2.set_xlabel("BLEU difference, second seed minus first")
    ax2.set_title("Paired bootstrap of two seeds of one configuration\n(the true difference is 0)", fontsize=10)
    # Below the panels, in a strip of its own: the rows fill the axes, and the x label is under them.
    fig.legend(*ax2.get_legend_handles_labels(), fontsize=8, loc="lower center", bbox_to_anchor=(0.45, 0.0), ncol=2)
    n = np.arange(2, max(SEEDS_SHOWN) + 1)
    for u in updates:
        ax3.plot(n, [half_width(sd[u], k) for k in n], color=colors[u], marker=".",
                 label=f"{u} updates")
    for t in TARGETS:
        ax3.axhline(t, color="grey", linestyle=":", linewidth=1)
        ax3.annotate(f"±{t:g}", (n[-1], t), xytext=(0, 2), textcoords="offset points", ha="right", va="bottom",
                     fontsize=8, color="grey")
    ax3.set_yscale("log")
    ax3.yaxis.set_major_formatter(ScalarFormatter())
    ax3.yaxis.set_minor_formatter(NullFormatter())  # plain numbers on the log axis: a reader compares them with ±0.15
    ax3.set_xlabel("seeds (each configuration and the baseline)")
    ax3.set_ylabel("95% half-width of a paired BLEU change")
    ax3.set_title("What a paired seed interval can resolve", fontsize=10)
    ax3.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"DynamicConv baseline, profile {res['profile']}: BLEU over seeds and updates", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def tables(p: TranslationTechniquesParams, res: dict[str, Any]) -> dict[str, tuple[pd.DataFrame, str]]:
    """The table written under figures/ (``lowmem.pipeline.outputs.save_tables``)."""
    return {"08_bleu_noise": (summary(res).round(3), caption(p, res))}


def metrics(res: dict[str, Any]) -> dict[str, Any]:
    """What notebook 08's metrics JSON says of the spread: at the techniques' run length, and at each length."""

    def short(row: dict[str, Any]) -> dict[str, Any]:
        return {"sacrebleu_mean": round(row["sacrebleu_mean"], 3), "seed_sd": round(row["seed_sd"], 3),
                "pairs_covering_zero": row["pairs_covering_zero"], "minutes_per_seed": None if math.isnan(row["minutes_per_seed"]) else round(row["minutes_per_seed"], 2),
                **{f"seeds_for_{t:g}": row[f"seeds_for_{t:g}"] for t in TARGETS}}

    rows = {u: summary_row(res, u) for u in res["updates"]}
    table = pd.DataFrame(rows.values())  # summary(res)
    row = rows[res["max_update"]]
    return {"seeds": row["seeds"], "updates": res["updates"], **short(row),
            "by_updates": {str(u): short(rows[u]) for u in res["updates"]},
            # The length at which each target costs one configuration the least training (point estimates of the sd).
            **{f"cheapest_length_for_{t:g}": cheapest(table, t) for t in TARGETS}}


def cheapest(table: pd.DataFrame, target: float) -> int | None:
    """The update count of ``summary``'s rows whose ``minutes_for_<target>`` is least; None where no length reaches
    the target within the seeds searched, or the minutes are unknown."""
    col = table[f"minutes_for_{target:g}"].astype(float)
    return None if col.isna().all() else int(table.updates[col.idxmin()])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--params", type=Path, required=True, help="resolved translation_techniques (data/params/translation_techniques.yaml)")
    ap.add_argument("--data-dir", type=Path, default=translation.DATA)
    ap.add_argument("--metrics", type=Path, required=True, help="write the runs' sacreBLEU and the pairs' intervals here")


def run(args: argparse.Namespace) -> int:
    try:
        result = train(load("translation_techniques", args.params), args.data_dir)
    except (ParamError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs.write_json(args.metrics, result)
    return 0
