"""How far DynamicConv's BLEU moves from seed to seed, and what that means for the paired bootstrap's interval.

Every DynamicConv quality change in this study is one seed of a configuration against one seed of the baseline,
with sacreBLEU's paired bootstrap over test sentences as its interval. That interval sees the test set's sampling
only. This trains the baseline (stage 08's command, updates and data) on ``translation_techniques.noise_seeds``
and asks two questions, as notebook 10 does for WRN:

- the seed sd of sacreBLEU, with its chi-square interval, and the paired half-width t(n-1) · √2 · sd / √n that n
  seeds would give (``lowmem.studies.quality.half_width``), with the seeds needed for the paper's 0.15 BLEU
  and for ±0.3;
- for every two seeds of the same configuration, whose true difference is zero, whether the bootstrap interval
  covers zero. If it often does not, a one-seed bootstrap interval understates the noise.

Seed 0's run is stage 08's baseline (same key), so it is trained once. The stage is left out of ``make repro``;
its result is committed (metrics/bleu_noise_train.json) and notebook 08 reads it.

    python -m lowmem.studies.bleu_noise --params data/params/translation_techniques.yaml --metrics FILE
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter
from scipy import stats

from lowmem import runs
from lowmem.config import ParamError, load
from lowmem.dynamicconv import translation
from lowmem.dynamicconv.params import TranslationEvaluateParams, TranslationTechniquesParams
from lowmem.studies import quality
from lowmem.studies import translation as translation_study
from lowmem.studies.quality import MAX_SEEDS, half_width, sd_interval, seeds_needed

COMMAND = ("python -m lowmem.pipeline.stage_params && python -m lowmem.studies.bleu_noise "
           "--params data/params/translation_techniques.yaml --metrics metrics/bleu_noise_train.json")
TARGETS = (0.15, 0.3)  # BLEU: the paper's budget, and the aim for the proxy
SEEDS_SHOWN = (2, 3, 5, 8)


def train(p: TranslationTechniquesParams, data_dir: Path = translation.DATA) -> dict[str, Any]:
    """The baseline on every seed of ``p.noise_seeds`` (from the run store where it has run), scored, and the
    paired bootstrap of every two seeds."""
    if len(p.noise_seeds) < 2:
        raise ParamError(f"translation_techniques.noise_seeds needs at least 2 seeds for a spread, got {p.noise_seeds}")
    refs = translation.test_references(data_dir)
    rows, hyps = [], {}
    for seed in p.noise_seeds:
        print(f"== baseline, seed {seed}", flush=True)
        res = translation.train_result(translation_study.train_params(dataclasses.replace(p, seed=seed), "baseline"), data_dir)
        save_dir = Path(res["dir"])
        ev = translation.evaluate(TranslationEvaluateParams(profile=p.profile, device=p.device), data_dir, save_dir,
                                  save_dir / "generate", tuple(translation_study.PLUGIN[:2]))
        hyps[seed] = translation.detokenized(translation.hypotheses((save_dir / "generate" / "generate.txt").read_text()))
        rows.append({"seed": seed, "key": res["key"], "trained": res["trained"], "sacrebleu": ev["sacrebleu"],
                     "bleu_tokenized": ev["bleu_tokenized"]})
    pairs = []
    for a, b in itertools.combinations(p.noise_seeds, 2):
        c = quality.bleu_paired(hyps[b], hyps[a], refs, resamples=translation_study.BOOTSTRAP, lowercase=translation.LOWERCASE)
        pairs.append({"seeds": f"{a}-{b}", "change": round(c.mean, 3), "low": round(c.low, 3), "high": round(c.high, 3)})
    return {"profile": p.profile, "max_update": p.max_update, "bootstrap_resamples": translation_study.BOOTSTRAP,
            "runs": rows, "pairs": pairs}


def results(p: TranslationTechniquesParams, data_dir: str | Path, path: str | Path) -> dict[str, Any]:
    """Stage bleu_noise_train's committed result when it holds ``p``'s seeds at ``p``'s profile; else, at the smoke
    profile, runs trained here (seconds) into a file beside it. At another profile a missing or other result says
    how to run the stage."""
    path = Path(path)

    def holds(f: Path) -> bool:
        res = runs.read_json(f)
        return (res["profile"], res["max_update"], [r["seed"] for r in res["runs"]]) == (p.profile, p.max_update, p.noise_seeds)

    if p.profile != "smoke" and not (path.exists() and holds(path)):
        # Minutes per seed: a notebook never trains them behind the reader's back.
        raise ParamError(f"{path} {'holds other runs than' if path.exists() else 'is missing, with'} "
                         f"translation_techniques.noise_seeds at profile {p.profile}; run them: {COMMAND}")
    if path.exists() and not holds(path):
        path = path.with_name(f"{path.stem}-smoke{path.suffix}")
    if not (path.exists() and holds(path)):
        runs.write_json(path, train(p, Path(data_dir)))
    return runs.read_json(path)


def summary_row(res: dict[str, Any]) -> dict[str, Any]:
    """The seed spread of sacreBLEU, the paired half-width for a few seed counts, the seeds each target
    needs, and how often the one-seed bootstrap interval covered a true zero."""
    scores = [r["sacrebleu"] for r in res["runs"]]
    n, sd = len(scores), statistics.stdev(scores)
    low, high = sd_interval(sd, n)
    pairs = pd.DataFrame(res["pairs"])
    covered = int(((pairs.low <= 0) & (pairs.high >= 0)).sum())
    row: dict[str, Any] = {"updates": res["max_update"], "seeds": n, "sacrebleu_mean": statistics.mean(scores),
                           "seed_sd": sd, "seed_sd_low": low, "seed_sd_high": high,
                           "bootstrap_half_width": float(((pairs.high - pairs.low) / 2).median()),
                           "pairs_covering_zero": f"{covered}/{len(pairs)}",
                           # Each interval is 95%: under a true zero it misses with chance 0.05 (pairs share seeds, so
                           # this binomial p is indicative, not exact).
                           "coverage_p": float(stats.binomtest(covered, len(pairs), quality.LEVEL).pvalue)}
    row |= {f"half_width_{k}_seeds": half_width(sd, k) for k in SEEDS_SHOWN}
    row |= {f"seeds_for_{t:g}": seeds_needed(sd, t) for t in TARGETS}
    return row


def summary(res: dict[str, Any]) -> pd.DataFrame:
    """``summary_row`` as a one-row table."""
    return pd.DataFrame([summary_row(res)])


def caption(p: TranslationTechniquesParams, res: dict[str, Any]) -> str:
    return (f"DynamicConv baseline (stage 08's command) at profile `{res['profile']}`, {res['max_update']} updates, "
            f"seeds {', '.join(str(r['seed']) for r in res['runs'])}; sacreBLEU on the test split. Seed sd: the sample sd "
            f"over seeds, with its 95% chi-square interval. half_width_k_seeds: t(k-1)·√2·sd/√k, the 95% half-width of a "
            f"mean paired change over k seeds. seeds_for_T: the fewest seeds whose half-width is at most T BLEU (empty: "
            f"more than {MAX_SEEDS}). bootstrap_half_width: the median half-width of sacreBLEU's paired bootstrap "
            f"({res['bootstrap_resamples']} resamples) between two seeds; pairs_covering_zero: how many of those "
            f"intervals hold the true zero difference of two seeds of one configuration.")


def figure(res: dict[str, Any]) -> Figure:
    """Left: each seed's sacreBLEU. Middle: the bootstrap interval of every two seeds, against their true difference
    of zero. Right: the paired seed interval's half-width against the number of seeds, with the targets and the
    bootstrap's own half-width."""
    row = summary_row(res)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 4.2), width_ratios=[0.6, 1.2, 1.2])
    scores = [r["sacrebleu"] for r in res["runs"]]
    ax1.scatter(np.zeros(len(scores)), scores, color="tab:blue")
    for r in res["runs"]:
        ax1.annotate(f"seed {r['seed']}", (0, r["sacrebleu"]), xytext=(8, 0), textcoords="offset points", va="center", fontsize=8)
    ax1.set_xticks([])
    ax1.set_xlim(-0.5, 1)
    ax1.set_ylabel("sacreBLEU (test split)")
    ax1.set_title(f"Baseline, one point per seed\nsd {row['seed_sd']:.2f}", fontsize=10)
    pairs = pd.DataFrame(res["pairs"])
    covers = (pairs.low <= 0) & (pairs.high >= 0)
    y = np.arange(len(pairs))
    for ok, color, label in ((True, "tab:green", "holds 0"), (False, "tab:red", "excludes 0")):
        sel = pairs[covers == ok]
        if len(sel):
            ax2.errorbar(sel.change, y[covers == ok], xerr=[sel.change - sel.low, sel.high - sel.change], fmt="o",
                         color=color, capsize=3, label=f"{label}: {len(sel)} of {len(pairs)}")
    ax2.axvline(0, color="black", linewidth=1)
    ax2.set_yticks(y, [f"seeds {s}" for s in pairs.seeds])
    ax2.set_xlabel("BLEU difference, second seed minus first")
    ax2.set_title("Paired bootstrap of two seeds of one configuration\n(the true difference is 0)", fontsize=10)
    ax2.legend(fontsize=8, loc="best")
    n = np.arange(2, max(SEEDS_SHOWN) + 1)
    ax3.plot(n, [half_width(row["seed_sd"], k) for k in n], color="tab:blue", marker=".", label="paired seed interval")
    ax3.axhline(row["bootstrap_half_width"], color="black", linestyle="--", linewidth=1,
                label=f"bootstrap of one pair (±{row['bootstrap_half_width']:.2f})")
    for t in TARGETS:
        ax3.axhline(t, color="grey", linestyle=":", linewidth=1)
        ax3.annotate(f"±{t:g}", (n[-1], t), xytext=(0, 2), textcoords="offset points", ha="right", va="bottom", fontsize=8, color="grey")
    ax3.set_yscale("log")
    ax3.yaxis.set_major_formatter(ScalarFormatter())
    ax3.yaxis.set_minor_formatter(NullFormatter())  # plain numbers on the log axis: a reader compares them with ±0.15
    ax3.set_xlabel("seeds (each configuration and the baseline)")
    ax3.set_ylabel("95% half-width of a BLEU change")
    ax3.set_title("What a paired seed interval can resolve", fontsize=10)
    ax3.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"DynamicConv baseline, profile {res['profile']}, {res['max_update']} updates", fontsize=10)
    fig.tight_layout()
    return fig


def tables(p: TranslationTechniquesParams, res: dict[str, Any]) -> dict[str, tuple[pd.DataFrame, str]]:
    """The table written under figures/ (``lowmem.pipeline.outputs.save_tables``)."""
    return {"08_bleu_noise": (summary(res).round(3), caption(p, res))}


def metrics(res: dict[str, Any]) -> dict[str, Any]:
    """What notebook 08's metrics JSON says of the spread."""
    row = summary_row(res)
    return {"seeds": row["seeds"], "seed_sd": round(row["seed_sd"], 3), "pairs_covering_zero": row["pairs_covering_zero"],
            **{f"seeds_for_{t:g}": row[f"seeds_for_{t:g}"] for t in TARGETS}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=Path, required=True, help="resolved translation_techniques (data/params/translation_techniques.yaml)")
    ap.add_argument("--data-dir", type=Path, default=translation.DATA)
    ap.add_argument("--metrics", type=Path, required=True, help="write the runs' sacreBLEU and the pairs' intervals here")
    args = ap.parse_args(argv)
    try:
        result = train(load("translation_techniques", args.params), args.data_dir)
    except (ParamError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs.write_json(args.metrics, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
