"""Microbatching of WRN (notebook 05): memory against the microbatch size b at full size on the meta device, and
accuracy and throughput of real training with per-microbatch BatchNorm and its remedies."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure

from lowmem.memory.accounting import CATEGORIES, MIB, account_step
from lowmem.studies.params import MicrobatchingParams
from lowmem.techniques.microbatch import convert_norm
from lowmem.wrn.models import build_model
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.recipe import make_optimizer
from lowmem.wrn.train import Techniques, summarize, train_step

# Stage microbatching_train is left out of `make repro` for time (twelve WRN runs, eight of them at microbatches of
# 4 and 8 images, the slowest steps of the default pipeline on an AVX2-only CPU): its runs are committed.
COMMAND = ("python -m lowmem.pipeline params && python -m lowmem.pipeline train microbatching --params "
           "data/params/microbatching.yaml --out metrics/microbatching_train.json")


def memory(p: MicrobatchingParams) -> pd.DataFrame:
    """Accounted breakdown at the step's peak for each normalization and microbatch size, at batch ``p.batch_size``."""
    rows = []
    for norm in p.norms:
        for b in p.memory_microbatches:
            torch.manual_seed(p.seed)
            with torch.device("meta"):
                model = convert_norm(build_model(p.model, p.num_classes, p.in_channels), norm)
                x = torch.empty(p.batch_size, p.in_channels, p.image_size, p.image_size)
                y = torch.zeros(p.batch_size, dtype=torch.long)
            opt = make_optimizer(model)
            tech = Techniques(microbatch=b if b < p.batch_size else 0, norm=norm)
            r = account_step(lambda mark: train_step(model, opt, x, y, tech, mark), model, opt, (x, y))
            row = {"norm": norm, "microbatch": b, **{f"{c}_mib": r.at_peak[c] / MIB for c in CATEGORIES}}
            rows.append({**row, "peak_mib": r.peak / MIB, "activations_max_mib": r.category_max["activations"] / MIB})
    return pd.DataFrame(rows)


def plan(p: MicrobatchingParams) -> list[tuple[dict[str, Any], BaselineParams, int, Techniques]]:
    """The trained runs: (labels, recipe, seed, techniques) for each (normalization, microbatch size, seed)."""
    base = BaselineParams(**p.train)
    out = []
    for norm in p.train_norms:
        for b in p.train_microbatches:
            size = b if 0 < b < base.batch_size else 0
            out += [({"norm": norm, "microbatch": size or base.batch_size}, base, seed, Techniques(microbatch=size, norm=norm))
                    for seed in p.train_seeds]
    return out


def summary(acc: pd.DataFrame) -> pd.DataFrame:
    """Accuracy (mean, sd over seeds) and throughput per (norm, b), throughput relative to b = B of the same norm."""
    rows = []
    for (norm, b), g in acc.groupby(["norm", "microbatch"], sort=False):
        rows.append({"norm": norm, "microbatch": b, **summarize(g.to_dict("records"))})
    out = pd.DataFrame(rows)
    full = out.groupby("norm").apply(lambda g: g.loc[g.microbatch.idxmax(), "images_per_s"], include_groups=False)
    out["throughput_vs_full_batch"] = out.images_per_s / out.norm.map(full)
    return out.drop(columns=["seeds", "peak_mem_method"])


# --- what notebook 05 shows: captions, the figure, the tables and the metrics ------------------------------------


def memory_caption(p: MicrobatchingParams) -> str:
    """The caption of the memory table (``memory``)."""
    return (f"{p.model}, fp32, SGD, minibatch B = {p.batch_size} split into microbatches of b; accounted at full size on "
            f"the meta device (exact, the same in every profile). MiB at the step's peak.")


def accuracy_caption(p: MicrobatchingParams, base: BaselineParams, runs: pd.DataFrame) -> str:
    """The caption of the accuracy table (``summary`` of the trained ``runs``): recipe, data, seeds, profile."""
    return (f"{base.model} trained {base.epochs} epoch(s), minibatch B = {base.batch_size}, on {runs.data.iloc[0]}: "
            f"{int(runs.train_examples.iloc[0])} train / {int(runs.test_examples.iloc[0])} test images, seeds {p.train_seeds}, "
            f"profile `{p.profile}`. Throughput: training images/s relative to b = B, same normalization, same run.")


def figure(p: MicrobatchingParams, base: BaselineParams, mem: pd.DataFrame, runs: pd.DataFrame, acc: pd.DataFrame) -> Figure:
    """Three panels against the microbatch size b, per normalization: accounted peak, test accuracy, and training
    throughput relative to b = B."""
    sns.set_theme(style="whitegrid")
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.6), gridspec_kw={"wspace": 0.35})
    sns.lineplot(mem, x="microbatch", y="peak_mib", hue="norm", style="norm", markers=True, dashes=True, ax=ax1)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.xaxis.set_major_formatter(plt.ScalarFormatter())
    ax1.yaxis.set_major_formatter(plt.ScalarFormatter())
    ax1.set(xlabel="microbatch size b", ylabel="peak memory (MiB, log)", title=f"{p.model}, B = {p.batch_size}: accounted peak")
    sns.lineplot(runs, x="microbatch", y="test_acc", hue="norm", style="norm", markers=True, errorbar="sd", ax=ax2)
    ax2.set_xscale("log", base=2)
    ax2.xaxis.set_major_formatter(plt.ScalarFormatter())
    ax2.set(xlabel="microbatch size b", ylabel="test accuracy (mean ± sd over seeds)",
            title=f"{base.model} on {base.dataset}, B = {base.batch_size}")
    sns.barplot(acc, x="microbatch", y="throughput_vs_full_batch", hue="norm", ax=ax3)
    ax3.set(xlabel="microbatch size b", ylabel="training throughput / throughput at b = B", title="Throughput cost")
    fig.suptitle(f"Microbatching · memory: full size, any profile · accuracy and time: profile {p.profile}, "
                 f"data: {runs.data.iloc[0]}", y=1.03)
    fig.text(0.5, -0.12, memory_caption(p) + " " + accuracy_caption(p, base, runs), ha="center", wrap=True, fontsize=8)
    return fig


def tables(p: MicrobatchingParams, base: BaselineParams, mem: pd.DataFrame, runs: pd.DataFrame,
           acc: pd.DataFrame) -> dict[str, tuple[pd.DataFrame, str]]:
    """The tables written under figures/, by file name (no suffix): (rounded table, caption)."""
    return {
        "05_microbatching_memory": (mem.round(4), memory_caption(p)),
        "05_microbatching_accuracy": (acc.round(5), accuracy_caption(p, base, runs)),
    }


def metrics(p: MicrobatchingParams, base: BaselineParams, mem: pd.DataFrame, runs: pd.DataFrame,
            acc: pd.DataFrame) -> dict[str, Any]:
    """The stage's metrics JSON (metrics/microbatching.json): BatchNorm's accounted peak per b, and accuracy and
    relative throughput per (norm, b)."""
    batchnorm = mem[mem.norm == "batch"].set_index("microbatch")
    return {
        "profile": p.profile, "memory_model": p.model, "memory_batch_size": p.batch_size,
        "peak_mib_batchnorm": {f"b{b}": round(float(v), 2) for b, v in batchnorm.peak_mib.items()},
        "train_model": base.model, "train_data": runs.data.iloc[0], "train_batch_size": base.batch_size,
        "accuracy": {f"{r.norm}_b{r.microbatch}": {"test_acc_mean": r.test_acc_mean, "test_acc_std": r.test_acc_std,
                                                   "throughput_vs_full_batch": round(float(r.throughput_vs_full_batch), 3)}
                     for r in acc.itertuples()},
    }
