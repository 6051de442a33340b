"""How noisy is the WRN quality proxy (notebook 10)? The baseline trained on several seeds at a few proxy sizes,
tested on the full test split, and what its seed-to-seed spread allows an interval on a quality difference to be.

A configuration's quality change is a paired difference over seeds (``lowmem.studies.quality.paired``). Same-seed
runs of two configurations diverge completely (../shared/proxy-noise-notes.md), so the difference of one pair has
the variance of two independent runs: its sd is estimated as √2 times the baseline's seed sd, and the 95% interval
of the mean of n pairs has the half-width t(n-1) · √2 · sd / √n. Beside it, the per-example interval of two models
(``quality.per_example``) sees only the test split's sampling; how often it misses the zero difference between two
seeds of one configuration shows how much of the noise is training's.

    python -m lowmem.pipeline train proxy_noise --params data/params/proxy_noise.yaml --out metrics/proxy_noise_train.json
"""

from __future__ import annotations

import itertools
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import NullFormatter, ScalarFormatter
from scipy import stats

from lowmem.studies import quality
from lowmem.studies.quality import MAX_SEEDS, half_width, sd_interval, seeds_needed  # noqa: F401  (this study's API too)
from lowmem.studies.params import PROXY_FIELDS, ProxyNoiseParams
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.train import Techniques

# What reruns the frozen stage (docs/pipeline.md, "Left out of the default pipeline").
COMMAND = ("python -m lowmem.pipeline params && python -m lowmem.pipeline train proxy_noise "
           "--params data/params/proxy_noise.yaml --out metrics/proxy_noise_train.json")
SEEDS_SHOWN = (2, 3, 5, 8, 12, 20)  # seed counts of the half-width table


def proxy_params(p: ProxyNoiseParams, proxy: dict[str, Any]) -> BaselineParams:
    """The baseline block with the proxy's changes, tested on the full test split (the subset is drawn from it)."""
    return BaselineParams(**{**p.train, **{k: proxy[k] for k in PROXY_FIELDS if k in proxy}, "test_subset": 0})


def plan(p: ProxyNoiseParams) -> list[tuple[dict[str, Any], BaselineParams, int, Techniques]]:
    """Every (proxy, seed) run: the trained runs of stage ``proxy_noise_train`` (``lowmem.pipeline.train_stage``)."""
    return [({"proxy": px["name"]}, proxy_params(p, px), seed, Techniques()) for px in p.proxies for seed in p.seeds]


def subset_indices(test_examples: int, n: int) -> np.ndarray:
    """The indices of the ``n``-image test subset that a baseline block with ``test_subset: n`` tests on: the draw
    of ``lowmem.wrn.data.subset`` (seed 0)."""
    if n <= 0 or n >= test_examples:
        return np.arange(test_examples)
    return torch.randperm(test_examples, generator=torch.Generator().manual_seed(0))[:n].numpy()






def affordable_seeds(budget_s: float, seconds_per_run: float, configurations: int) -> int:
    """Seeds that ``configurations`` trained configurations and their baseline can each have in ``budget_s``: every
    configuration and the baseline train every seed, so a seed costs (configurations + 1) runs."""
    return int(budget_s // (seconds_per_run * (configurations + 1)))


def runs_table(p: ProxyNoiseParams, res: dict[str, Any]) -> pd.DataFrame:
    """One row per run: accuracy on the full test split and on the ``p.test_subset`` subset, test loss, seconds."""
    rows = []
    for r in res["runs"]:
        last = r["history"][-1]
        correct = quality.unpack_bits(r["test_correct"], last["test_examples"])
        sub = correct[subset_indices(len(correct), p.test_subset)]
        rows.append({"proxy": r["labels"]["proxy"], "seed": r["seed"], "test_acc": 100 * correct.mean(),
                     "test_acc_subset": 100 * sub.mean(), "test_loss": last["test_loss"],
                     "train_examples": last["train_examples"], "test_examples": len(correct),
                     "run_s": sum(h["epoch_s"] for h in r["history"])})
    return pd.DataFrame(rows)


def pairs_table(res: dict[str, Any]) -> pd.DataFrame:
    """Every two seeds of one proxy: their disagreement and the per-example interval of their accuracy difference,
    whose true value is 0 (one configuration), and whether the interval covers it."""
    by_proxy: dict[str, list[tuple[int, np.ndarray]]] = {}
    for r in res["runs"]:
        n = r["history"][-1]["test_examples"]
        by_proxy.setdefault(r["labels"]["proxy"], []).append((r["seed"], quality.unpack_bits(r["test_correct"], n)))
    rows = []
    for proxy, runs in by_proxy.items():
        for (s1, c1), (s2, c2) in itertools.combinations(runs, 2):
            d = quality.per_example(c1, c2)
            rows.append({"proxy": proxy, "seeds": f"{s1}-{s2}", "disagree_pct": 100 * float((c1 != c2).mean()),
                         "change": 100 * d.mean, "half_width": 100 * (d.high - d.mean), "covers_zero": d.low <= 0 <= d.high})
    return pd.DataFrame(rows)




def summary(p: ProxyNoiseParams, runs: pd.DataFrame, pairs: pd.DataFrame) -> pd.DataFrame:
    """One row per proxy: the seed spread on both test splits (points), the test loss's spread, time per run (the
    fastest seed's, training and the per-epoch test included: another job on the machine slows a run, never speeds
    it up), the
    per-example view, the seed interval's half-width at several seed counts, and the seeds each target needs."""
    rows = []
    for px in p.proxies:
        g, pp = runs[runs.proxy == px["name"]], pairs[pairs.proxy == px["name"]]
        sd = float(g.test_acc.std(ddof=1))
        low, high = sd_interval(sd, len(g))
        row = {"proxy": px["name"], "seeds": len(g), "train_examples": int(g.train_examples.iloc[0]),
               "test_acc_mean": g.test_acc.mean(), "sd_full_test": sd, "sd_low": low, "sd_high": high,
               "sd_subset_test": float(g.test_acc_subset.std(ddof=1)), "sd_test_loss": float(g.test_loss.std(ddof=1)),
               "run_s": g.run_s.min(), "disagree_pct": pp.disagree_pct.mean(),
               "per_example_half_width": pp.half_width.mean(), "per_example_coverage": pp.covers_zero.mean()}
        row |= {f"half_width_{n}_seeds": half_width(sd, n) for n in SEEDS_SHOWN}
        row |= {f"seeds_for_{t:g}": seeds_needed(sd, t) for t in p.targets}
        for c in p.configurations:
            n = affordable_seeds(60 * p.budget_minutes, row["run_s"], c)
            row |= {f"seeds_in_budget_{c}_configs": n, f"half_width_in_budget_{c}_configs": half_width(sd, n)}
        rows.append(row)
    return pd.DataFrame(rows)


def caption(p: ProxyNoiseParams, runs: pd.DataFrame) -> str:
    t = p.train
    n_test = int(runs.test_examples.iloc[0])
    return (f"Profile `{p.profile}`, data: {t['dataset']} ({n_test} test images), model and recipe of the baseline "
            f"block ({t['model']}, batch {t['batch_size']}, fp32, no technique) changed as each proxy says; "
            f"{len(p.seeds)} seeds per proxy. Accuracy in points. A seed interval is the {quality.LEVEL:.0%} t interval "
            "of a mean paired difference over n seeds, taking one pair's sd as √2 × the seed sd on the full test "
            f"split; the per-example interval is McNemar's for two models on the full test split. The budget columns "
            f"give the seeds that {p.budget_minutes:g} minutes of training buy when each configuration and the "
            "baseline train every seed, at the fastest seed's seconds per run. Not the paper's setting: a proxy for "
            "its CIFAR-10 runs.")


def figure(p: ProxyNoiseParams, runs: pd.DataFrame, table: pd.DataFrame) -> Figure:
    """Left: each seed's accuracy per proxy, on the full test split and on the subset. Right: the half-width of
    the seed interval against the number of seeds, per proxy, with the targets and the per-example half-width."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), width_ratios=[1, 1.3])
    names = [px["name"] for px in p.proxies]
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for i, name in enumerate(names):
        g = runs[runs.proxy == name]
        jitter = np.linspace(-0.12, 0.12, len(g))
        ax1.scatter(i - 0.18 + jitter, g.test_acc, color=colors[name], marker="o")
        ax1.scatter(i + 0.18 + jitter, g.test_acc_subset, color=colors[name], marker="x")
    ax1.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names])
    ax1.set_ylabel("test accuracy (%)")
    ax1.set_title("Baseline accuracy, one point per seed")
    ax1.legend(handles=[Line2D([], [], color="grey", marker="o", linestyle="", label="full test split"),
                        Line2D([], [], color="grey", marker="x", linestyle="", label=f"{p.test_subset}-image test subset")],
               loc="best", fontsize=8)
    n = np.arange(2, max(SEEDS_SHOWN) + 1)
    for _, row in table.iterrows():
        ax2.plot(n, [half_width(row.sd_full_test, k) for k in n], color=colors[row.proxy],
                 label=f"{row.proxy}: seed sd {row.sd_full_test:.2f}, {row.run_s:.0f} s/run")
    for t in p.targets:
        ax2.axhline(t, color="grey", linestyle=":", linewidth=1)
        ax2.annotate(f"target ±{t:g}", (2, t), xytext=(2, 2), textcoords="offset points", va="bottom", fontsize=8, color="grey")
    per_ex = table.per_example_half_width.mean()
    ax2.axhline(per_ex, color="black", linestyle="--", linewidth=1, label=f"per-example interval of one pair (±{per_ex:.2f})")
    ax2.set_yscale("log")
    ax2.set_ylim(min(min(p.targets), per_ex) / 1.5, max(4.0, half_width(table.sd_full_test.max(), 2) / 4))
    ax2.yaxis.set_major_formatter(ScalarFormatter())
    ax2.yaxis.set_minor_formatter(NullFormatter())  # plain numbers on the log axis: a reader compares them with ±0.4
    ax2.set_yticks([t for t in (0.1, 0.2, 0.25, 0.4, 0.5, 1, 2, 4, 8) if ax2.get_ylim()[0] <= t <= ax2.get_ylim()[1]])
    ax2.set_xlabel("seeds (each configuration and the baseline)")
    ax2.set_ylabel("95% half-width of a quality change (points)")
    ax2.set_title("What a paired seed interval can resolve")
    ax2.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


SHOWN = {"proxy": "proxy", "train_examples": "training images", "seeds": "seeds", "test_acc_mean": "accuracy, mean",
         "sd_full_test": "seed sd, full test", "sd_subset_test": "seed sd, test subset", "sd_test_loss": "seed sd of test loss",
         "disagree_pct": "two seeds disagree on (%)", "per_example_half_width": "per-example ±",
         "per_example_coverage": "per-example interval covers 0", "run_s": "s per run"}


def shown(p: ProxyNoiseParams, table: pd.DataFrame) -> pd.DataFrame:
    """The table as the reader sees it: spreads, the half-widths at the seed counts shown, the seeds each target
    needs ("over N" past ``MAX_SEEDS``) and what the budget buys."""
    out = table[list(SHOWN)].rename(columns=SHOWN).round(3)
    for n in SEEDS_SHOWN:
        out[f"± with {n} seeds"] = table[f"half_width_{n}_seeds"].round(2)
    for t in p.targets:
        out[f"seeds for ±{t:g}"] = [f"over {MAX_SEEDS}" if v is None or pd.isna(v) else int(v) for v in table[f"seeds_for_{t:g}"]]
    for c in p.configurations:
        out[f"{p.budget_minutes:g} min, {c} configs: seeds, ±"] = [
            f"{int(n)}, ±{h:.2f}" if n >= 2 else f"{int(n)}, no interval"
            for n, h in zip(table[f"seeds_in_budget_{c}_configs"], table[f"half_width_in_budget_{c}_configs"])]
    return out


def tables(p: ProxyNoiseParams, runs: pd.DataFrame, pairs: pd.DataFrame, table: pd.DataFrame, res: dict[str, Any]) -> dict[str, tuple[pd.DataFrame, str]]:
    """What ``lowmem.pipeline.outputs.save_tables`` writes: the summary, every run and every pair of seeds."""
    note = caption(p, runs)
    if res.get("current_keys", len(res["runs"])) < len(res["runs"]):
        note += (f" {len(res['runs']) - res['current_keys']} of the {len(res['runs'])} runs were made by an earlier "
                 f"version of the training code (the stage is frozen; rerun: `{COMMAND}`).")
    return {"10_proxy_noise": (shown(p, table), note),
            "10_proxy_noise_runs": (runs.round(4), "Every run of the proxy-noise study. " + note),
            "10_proxy_noise_pairs": (pairs.round(4), "Every two seeds of one proxy: the per-example interval of their "
                                     "accuracy difference, whose true value is 0. " + note)}


def metrics(p: ProxyNoiseParams, runs: pd.DataFrame, table: pd.DataFrame) -> dict[str, Any]:
    t = table.set_index("proxy")
    return {"profile": p.profile, "data": p.train["dataset"], "test_examples": int(runs.test_examples.iloc[0]),
            "proxies": {name: {"seeds": int(r.seeds), "run_s": round(float(r.run_s), 1),
                               "test_acc_mean": round(float(r.test_acc_mean), 3),
                               "sd_full_test": round(float(r.sd_full_test), 4), "sd_subset_test": round(float(r.sd_subset_test), 4),
                               "per_example_half_width": round(float(r.per_example_half_width), 4),
                               "per_example_coverage": round(float(r.per_example_coverage), 4),
                               **{f"half_width_{n}_seeds": round(float(r[f"half_width_{n}_seeds"]), 4) for n in SEEDS_SHOWN},
                               **{f"seeds_for_{x:g}": (None if pd.isna(r[f"seeds_for_{x:g}"]) else int(r[f"seeds_for_{x:g}"])) for x in p.targets}}
                        for name, r in t.iterrows()}}


def reading(p: ProxyNoiseParams, table: pd.DataFrame) -> str:
    """What the table says, from its numbers: the cheapest proxy per unit of resolution and what the budget buys."""
    lines = []
    for _, r in table.iterrows():
        need = {t: r[f"seeds_for_{t:g}"] for t in p.targets}
        needs = "; ".join(f"±{t:g} needs {'over ' + str(MAX_SEEDS) if n is None or pd.isna(n) else int(n)} seeds"
                          f"{'' if n is None or pd.isna(n) else f' ({int(n) * r.run_s / 60:.0f} min per configuration)'}"
                          for t, n in need.items())
        lines.append(f"- **{r.proxy}** ({r.run_s:.0f} s per run): seed sd {r.sd_full_test:.2f} points on the full "
                     f"test split ({quality.LEVEL:.0%} interval of the sd {r.sd_low:.2f}–{r.sd_high:.2f}), "
                     f"{r.sd_subset_test:.2f} on the {p.test_subset}-image subset; {needs}.")
    best = table.assign(cost=[r.run_s * r.sd_full_test ** 2 for _, r in table.iterrows()]).sort_values("cost").iloc[0]
    n_pairs = table.seeds.map(lambda n: n * (n - 1) // 2)
    covered, pairs = int(round(float((table.per_example_coverage * n_pairs).sum()))), int(n_pairs.sum())
    # A binomial test of the coverage against LEVEL: with ~15 pairs per proxy, a few misses are chance.
    p_value = stats.binomtest(covered, pairs, quality.LEVEL).pvalue
    verdict = (f"so it leaves out training's noise (binomial p = {p_value:.2g}), and only the seed interval may decide "
               "a quality budget" if p_value < 0.05 and covered < quality.LEVEL * pairs else
               f"which this many pairs cannot tell apart from {quality.LEVEL:.0%} (binomial p = {p_value:.2g})")
    lines.append(f"\nThe cost of a given half-width is proportional to (seconds per run) × sd²; by that measure the "
                 f"cheapest proxy is **{best.proxy}**. The per-example interval of two seeds of one configuration "
                 f"covered their true difference of zero in {covered} of {pairs} pairs, against the "
                 f"{quality.LEVEL:.0%} it would if the test split were the only noise, {verdict}.")
    return "\n".join(lines)
