"""Notebook 09's words and its picture: the caption or prose of each table (``overview``, ``budget_caption``,
``comparison_caption``, ``predicted_caption``), the decision rules as every "within budget" states them
(``rules_text``), the frontier's figure with its caption drawn in (``figure``), and ``tables``, each table of
``lowmem.studies.frontier_tables`` beside its caption as the notebook writes them under figures/.

Apart from the tables because the words are edited for the reader, not for the numbers: a caption's change touches
no computation, and the numbers never need the words.
"""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from lowmem.studies import known, quality
from lowmem.studies.frontier import LEVERS_STAGES_DYNAMICCONV
from lowmem.studies.frontier_tables import (MEMORY_AT, QUALITY, RULES, Study, budget_table, effects_table,
                                            paper_comparison, predicted_table)


def overview(s: Study) -> str:
    """One line per task (Markdown): how many combinations were accounted and trained, and the largest reduction."""
    def line(task: str, r: pd.DataFrame) -> str:
        g = s.grid.get(task, r)
        return (f"**{task}**: {s.accounted[task]} combinations accounted ({len(r)} of the paper's levers alone), "
                f"{int(g.quality_change.notna().sum())} with a quality ({int(r.quality_change.notna().sum())} of the "
                f"paper's levers alone); best accounted reduction {g.reduction.max():.1f}x "
                f"({g.loc[g.reduction.idxmax(), 'name']}), {r.reduction.max():.1f}x with the paper's levers alone.")
    return "\n\n".join(line(task, r) for task, r in s.results.items())


FRONTIER_CAPTION = (
    "Memory: accounted peak of one full-size training step (exact; the same in every profile). Quality: runs at "
    "the stated profile, never the paper's CIFAR-10 or IWSLT'14 unless the profile is `paper`. Error bars: the 95% "
    "interval of the paired change (WRN: over seeds; DynamicConv: one seed's paired bootstrap of the test set, where "
    "computed, widened by the baseline's seed-to-seed sd where measured at that length, as the setting says). Diamonds: combinations that differ from a trained one only by checkpointing, which is exact by test, "
    "or also by DynamicConv's exact microbatching, equal up to dropout draws by test (two seeds' noise as the interval "
    "where the trained one is the baseline), so they carry its quality. White points: time per step not measured at this profile. The black line: the Pareto "
    "frontier of the paper's levers alone. Stars: configurations with a lever beyond the paper. WRN: the grid's "
    "compressed activations, 8-bit momentum and Kahan-compensated bf16, timed by the same sweep; compressed activations "
    "trained alone and in the search's picks beside the same baseline, 8-bit momentum and Kahan alone beside their own "
    "stages' baselines on the same seeds, and those stages' arms on top of other levers, timed by those runs. DynamicConv: 8-bit Adam moments and Kahan-compensated all-bf16 (settings of the grid's precision) and "
    "compressed activations (a dimension of the grid), one seed beside each study's own "
    "baseline, their intervals as the other DynamicConv points', timed by those runs. One machine per study; a white "
    "star is the twin of a trained one.")


def figure(s: Study) -> Figure:
    """Figures/09_frontier.png: per task, memory reduction (log) against quality change (symlog) of every combination
    with a quality (trained, or exact by test), coloured by time per step, with 95% intervals, the Pareto frontier,
    the paper's budget and a rug of every accounted reduction. Labels: the trained points on the frontier and the
    search's picks, staggered so that they do not overlap."""
    sns.set_theme(style="whitegrid")
    fig, axes = plt.subplots(1, len(s.results), figsize=(16, 6.4), gridspec_kw={"wspace": 0.25})
    norm = plt.Normalize(0.5, 2.5)
    cmap = sns.color_palette("flare", as_cmap=True)
    # Before anything is placed: the colour bar takes its width from the axes, which would move the labels' points.
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes,
                 label="time per step / baseline (active profile)", shrink=0.8)
    key_lines = 0
    for ax, (task, r) in zip(axes, s.results.items()):
        t = r[r.quality_change.notna()].sort_values("reduction")
        exact = t.quality_from.str.startswith("exact")
        twin = exact | t.quality_from.str.startswith(known.DROPOUT)  # a trained run's quality, carried
        for mask, marker, size in ((~twin, "o", 70), (twin, "D", 28)):
            timed = mask & t.time_ratio.notna()
            ax.scatter(t.reduction[timed], t.quality_change[timed], c=t.time_ratio[timed], cmap=cmap, norm=norm,
                       s=size, marker=marker, edgecolor="black", linewidth=0.6, zorder=3)
            untimed = mask & t.time_ratio.isna()
            if untimed.any():
                ax.scatter(t.reduction[untimed], t.quality_change[untimed], facecolor="white", edgecolor="black",
                           s=size, marker=marker, zorder=3, label="time not measured" if marker == "o" else None)
        b = s.beyond.get(task, pd.DataFrame())
        if not b.empty:  # apart from the paper's levers: another marker, and out of the paper's Pareto frontier
            timed = b.time_ratio.notna()
            ax.scatter(b.reduction[timed], b.quality_change[timed], c=b.time_ratio[timed], cmap=cmap, norm=norm, s=150,
                       marker="*", edgecolor="black", linewidth=0.6, zorder=4, label="with a lever beyond the paper")
            if (~timed).any():  # exact twins of a trained one (checkpointing added): quality by test, time not measured
                ax.scatter(b.reduction[~timed], b.quality_change[~timed], facecolor="white", s=150, marker="*",
                           edgecolor="black", linewidth=0.6, zorder=4)
            ax.errorbar(b.reduction, b.quality_change, fmt="none", ecolor="tab:green", lw=0.9, capsize=2, zorder=2,
                        yerr=[b.quality_change - b.quality_low, b.quality_high - b.quality_change])
        bars = t[~exact & t.quality_low.notna()]
        if not bars.empty:
            ax.errorbar(bars.reduction, bars.quality_change, fmt="none", ecolor="grey", lw=0.9, capsize=2, zorder=2,
                        yerr=[bars.quality_change - bars.quality_low, bars.quality_high - bars.quality_change])
        front = t[t.pareto].sort_values("reduction")
        ax.plot(front.reduction, front.quality_change, color="black", lw=1.2, zorder=1, label="Pareto frontier")
        # symlog: losses of tenths of a point and a collapsed run of tens of points on one axis
        ax.set_yscale("symlog", linthresh=1)
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo * 1.8 if lo < -1 else lo - 0.8, hi + 1)
        g = s.grid.get(task, r)  # every accounted combination, levers beyond the paper included
        ax.plot(g.reduction, np.full(len(g), ax.get_ylim()[0]), "|", color="grey", alpha=0.4, ms=8)
        ref = s.reference["tasks"][task]
        ax.axhline(ref["quality_change"], color="tab:blue", ls=":", lw=1)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xscale("log")
        ax.text(ax.get_xlim()[1], ref["quality_change"], f"paper's budget ({ref['quality_change']:+g}) ", color="tab:blue",
                fontsize=7, va="top", ha="right")
        # Numbers at the points and the names in a key under the axes: long names at crowded points overlap. Once
        # the scales are set, a number whose box (in points: 5 per digit and 3 apart wide, 8 high) would overlap
        # one already placed goes up a line until it is clear.
        labelled = pd.concat([t[t.pareto | t.role.str.startswith("search")], b])
        key, boxes = [], []
        for k, row in enumerate(labelled.itertuples(), start=1):
            x, y = ax.transData.transform((row.reduction, row.quality_change)) * 72 / fig.dpi
            box = [x + 4, x + 7 + 5 * len(str(k)), y + 4, y + 12]
            while any(box[0] < b1 and b0 < box[1] and box[2] < c1 and c0 < box[3] for b0, b1, c0, c1 in boxes):
                box[2:] = [box[2] + 9, box[3] + 9]
            boxes.append(box)
            ax.annotate(str(k), (row.reduction, row.quality_change), textcoords="offset points",
                        xytext=(4, box[2] - y), fontsize=7, fontweight="bold", zorder=6,  # over the stars (zorder 4)
                        bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.75})
            key.append(f"{k}: {row.name} ({row.reduction:.1f}x, {row.quality_change:+.2f})")
        ax.text(0.0, -0.2, "\n".join(key), transform=ax.transAxes, va="top", ha="left", fontsize=7)
        key_lines = max(key_lines, len(key))
        ax.set(xlabel=f"memory reduction (x, log scale)\n{MEMORY_AT[task]}", ylabel=f"{QUALITY[task]} (symlog)",
               title=f"{task}\n" + textwrap.fill(f"quality: {s.trained_on[task]}", 90))
        ax.title.set_fontsize(8)
        ax.legend(loc="lower left", fontsize=7)
    # Under the longest key: a line of the key at 7 pt is about 0.019 of the figure's 6.4-inch height.
    fig.text(0.5, -0.1 - 0.019 * key_lines, textwrap.fill(FRONTIER_CAPTION, 180), ha="center", va="top", fontsize=8)
    return fig


def predicted_caption(s: Study) -> str:
    return (f"WRN, the quality-aware search: a combination's predicted accuracy change (points) is the sum of its "
            f"lossy levers' paired changes alone (checkpointing adds zero: exact by test, and assumed zero with compressed "
            f"activations, where it is not exact); measured: its own paired "
            f"change with the {quality.LEVEL:.0%} interval over the seeds. Quality: {s.trained_on['wrn']}.")


def budget_caption(s: Study, task: str) -> str:
    """The caption of ``budget_table``: what memory, quality and time mean for ``task``."""
    return (f"{task}: best memory reduction within each budget of {QUALITY[task]}, by each rule. Memory: "
            f"{MEMORY_AT[task]}, MiB = 2^20 bytes at the step's peak. Quality: {s.trained_on[task]}; low/high: its "
            f"{quality.LEVEL:.0%} interval. Time ratio: per step against the baseline, measured at profile "
            f"`{s.profile[task]}`. {rules_text()}")


def rules_text() -> str:
    """The decision rules, as every table and figure that says "within budget" states them."""
    return "Rules: " + "; ".join(f"**{r}**: {quality.RULES[r]}" for r in RULES) + "."



def comparison_caption(s: Study) -> str:
    """The caption of ``paper_comparison``: where the paper's numbers and ours come from."""
    return (f"Paper: {s.reference['citation']}. Ours: memory reduction accounted at full size, quality change from the "
            "stated profile, with its 95% interval (low, high) over n seeds (DynamicConv: one seed, its interval as its "
            "setting says). At the cpu profile the quality is measured "
            "on a smaller model and offline data, not CIFAR-10 or IWSLT'14. The rows \"the paper's and beyond\" add "
            "the configurations with a lever beyond the paper, each paired with the baseline trained beside it in its "
            f"own study, on that study's machine ({', '.join(quality_sources(s))}).{paper_arms_text(s)} {rules_text()}")


def paper_arms_text(s: Study) -> str:
    """What ``paper_arms_dynamicconv`` added to DynamicConv's rows "the paper's", as a sentence (empty if nothing)."""
    r = s.results.get("dynamicconv")
    stages = [] if r is None else sorted({q.removeprefix("stage ") for q in r.quality_from
                                          if q.removeprefix("stage ") in LEVERS_STAGES_DYNAMICCONV})
    if not stages:
        return ""
    return (" DynamicConv's rows \"the paper's\" also take the runs of the paper's levers alone that a levers stage "
            f"trained beside its own baseline (stage {', '.join(stages)}).")


def quality_sources(s: Study) -> list[str]:
    """The studies whose runs give the levers beyond the paper their quality, and the CPU each ran on."""
    b = pd.concat(list(s.beyond.values()), ignore_index=True) if s.beyond else pd.DataFrame(columns=["study", "machine"])
    return [f"stage {st}: {m}" for st, m in b[["study", "machine"]].drop_duplicates().itertuples(index=False)]


def tables(s: Study) -> dict[str, tuple[pd.DataFrame, str]]:
    """The tables notebook 09 writes under figures/, by file name (no suffix): (rounded table, caption)."""
    out = {f"09_{task}_budgets": (budget_table(s, task).round(4), budget_caption(s, task)) for task in s.results}
    out["09_wrn_predicted"] = (predicted_table(s).round(4), predicted_caption(s))
    out["09_wrn_levers"] = (effects_table(s).round(4), "WRN: each lossy lever alone, its paired accuracy change "
                            f"(points) and {quality.LEVEL:.0%} interval. Quality: {s.trained_on['wrn']}.")
    out["09_paper_comparison"] = (paper_comparison(s).round(3), comparison_caption(s))
    return out
