"""The baseline every technique is compared with (notebook 02): WRN trained with the recipe of the paper's sparsity
method, in fp32 with no memory technique, one run per seed; accuracy is reported as mean and spread over seeds.

The runs are trained by ``lowmem.pipeline.train_stage`` (stage ``baseline_train``); this module turns their
per-epoch history (``train_stage.histories``) into the notebook's metrics, caption, reading, tables and figure."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from lowmem.wrn.params import BaselineParams
from lowmem.wrn.train import summarize


def final(p: BaselineParams, history: pd.DataFrame) -> pd.DataFrame:
    """The last epoch of every seed's run."""
    return history[history.epoch == p.epochs]


def metrics(p: BaselineParams, history: pd.DataFrame) -> dict[str, Any]:
    """The metrics DVC tracks: what was trained on what, and the final accuracy over seeds (``summarize``)."""
    last = final(p, history)
    return {
        "profile": p.profile, "data": last.data.iloc[0], "model": p.model, "epochs": p.epochs,
        "batch_size": p.batch_size, "train_examples": int(last.train_examples.iloc[0]),
        "test_examples": int(last.test_examples.iloc[0]), "augment": p.augment, **summarize(last.to_dict("records")),
    }


def caption(p: BaselineParams, metrics: dict[str, Any]) -> str:
    """What the table and the figure show: model, data, seeds, profile, augmentation, how memory was measured."""
    return (
        f"{p.model} trained {p.epochs} epoch(s) at batch {p.batch_size} on {metrics['data']}: "
        f"{metrics['train_examples']} training / {metrics['test_examples']} test images, seeds {p.seeds}, profile `{p.profile}`. "
        f"Augmentation: {'crop + flip' if p.augment else 'none'}. fp32, no memory technique. "
        f"Peak memory: {metrics['peak_mem_method']}."
    )


def table(p: BaselineParams, history: pd.DataFrame) -> pd.DataFrame:
    """One row per seed: final accuracy and losses, throughput, peak memory and the run's wall-clock seconds."""
    return final(p, history)[["seed", "test_acc", "train_loss", "test_loss", "images_per_s", "step_s", "peak_mem_mib"]].assign(
        wall_s=history.groupby("seed").epoch_s.sum().values)


def tables(p: BaselineParams, history: pd.DataFrame, caption: str) -> dict[str, tuple[pd.DataFrame, str]]:
    """The tables written under figures/, by file name (without suffix): the final table and every epoch, with
    their caption."""
    return {
        "02_baseline": (table(p, history).round(5), caption),
        "02_baseline_history": (history.drop(columns=["data", "peak_mem_method"]).round(5), caption),
    }


def reading(p: BaselineParams, metrics: dict[str, Any]) -> str:
    """The result in words (Markdown): final accuracy as mean ± sd and range over seeds, and the throughput."""
    return (
        f"Final test accuracy: **{metrics['test_acc_mean']:.2%} ± {metrics['test_acc_std']:.2%}** (mean ± sd over "
        f"{len(p.seeds)} seed(s); range {metrics['test_acc_min']:.2%}–{metrics['test_acc_max']:.2%}), at "
        f"{metrics['images_per_s']:.0f} training images/s."
    )


def figure(p: BaselineParams, history: pd.DataFrame, metrics: dict[str, Any], caption: str) -> Figure:
    """Test accuracy and training loss per epoch, mean ± sd over seeds."""
    sns.set_theme(style="whitegrid")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    sns.lineplot(history, x="epoch", y="test_acc", errorbar="sd", marker="o", ax=ax1)
    ax1.set(ylabel="test accuracy", title="Test accuracy (mean ± sd over seeds)")
    sns.lineplot(history, x="epoch", y="train_loss", errorbar="sd", marker="o", ax=ax2)
    ax2.set(ylabel="training loss (cross-entropy)", title="Training loss (mean ± sd over seeds)")
    for ax in (ax1, ax2):
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"{p.model} baseline · profile: {p.profile} · data: {metrics['data']}", y=1.02)
    fig.text(0.5, -0.1, caption, ha="center", wrap=True, fontsize=8)
    return fig
