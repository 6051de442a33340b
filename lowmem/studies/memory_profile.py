"""The memory profile of WRN training (Sohoni et al. 2019, Sec. 3, the baseline breakdown): one fp32 step of the
recipe's SGD at each batch size, accounted at full size on the meta device, and measured for real where asked.

``breakdown`` and ``summary`` compute the study; the functions after them are what notebook 01 shows and writes."""

from __future__ import annotations

import time

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

from lowmem.config import resolve_device
from lowmem.memory.accounting import CATEGORIES, MIB, MemoryReport, account_step, standard_step
from lowmem.memory.ledger import Workspace
from lowmem.memory.measure import CPUWorkspace, measure_step
from lowmem.studies.params import CheckpointingParams, MemoryProfileParams
from lowmem.techniques import checkpoint
from lowmem.wrn.models import build_model
from lowmem.wrn.recipe import SGDRecipe, make_optimizer


def wrn_step(p: MemoryProfileParams | CheckpointingParams, batch_size: int, device: torch.device, checkpoint_spec: str = "none"):  # type: ignore[no-untyped-def]
    """The recipe's fp32 step of ``p.model`` on a random batch, with a checkpoint strategy: (step, model, opt, batch)."""
    torch.manual_seed(p.seed)
    with torch.device(device):
        model = build_model(p.model, num_classes=p.num_classes, in_channels=p.in_channels)
        x = torch.randn(batch_size, p.in_channels, p.image_size, p.image_size)
        y = torch.randint(0, p.num_classes, (batch_size,))
    checkpoint.apply(model, checkpoint_spec, tuple(x.shape))
    opt = make_optimizer(model, SGDRecipe(lr=getattr(p, "lr", SGDRecipe.lr)))
    return standard_step(model, opt, (x, y), F.cross_entropy), model, opt, (x, y)


def account(
    p: MemoryProfileParams, batch_size: int, device: str | torch.device = "meta", workspace: Workspace | None = None
) -> tuple[MemoryReport, float]:
    """Accounted report of one step, and the seconds the accounting took."""
    t0 = time.perf_counter()
    step, model, opt, batch = wrn_step(p, batch_size, torch.device(device))
    report = account_step(step, model, opt, batch, workspace=workspace)
    return report, time.perf_counter() - t0


def measure(p: MemoryProfileParams, batch_size: int, device: torch.device) -> tuple[int, str]:
    step, model, opt, batch = wrn_step(p, batch_size, device)
    return measure_step(step, model, opt, batch)


def _row(batch_size: int, source: str, r: MemoryReport, seconds: float) -> dict:
    row: dict = {"batch_size": batch_size, "source": source}
    row.update({f"{c}_mib": r.at_peak[c] / MIB for c in CATEGORIES})
    row.update(total_mib=r.peak / MIB, peak_phase=r.peak_phase, seconds=seconds)
    return row


def breakdown(p: MemoryProfileParams) -> pd.DataFrame:
    """One row per accounted batch size (meta device), then one per measured batch size with its gap."""
    rows = []
    for b in p.accounted_batch_sizes:
        report, secs = account(p, b)
        rows.append(_row(b, "accounted", report, secs))
    device = resolve_device(p.device)
    workspace = CPUWorkspace() if device.type == "cpu" else None
    for b in p.measured_batch_sizes:
        report, _ = account(p, b)
        t0 = time.perf_counter()
        measured, how = measure(p, b, device)
        row = {"batch_size": b, "source": f"measured ({device.type})", "measured_mib": measured / MIB}
        row.update(accounted_mib=report.peak / MIB, gap_pct=100 * (report.peak - measured) / measured)
        if workspace is not None:
            # The same meta-device account plus each op's CPU workspace, measured once per op signature.
            with_ws, _ = account(p, b, workspace=workspace)
            row.update(accounted_ws_mib=with_ws.peak / MIB, gap_ws_pct=100 * (with_ws.peak - measured) / measured)
        row.update(method=how, seconds=time.perf_counter() - t0)
        rows.append(row)
    return pd.DataFrame(rows)


def summary(p: MemoryProfileParams, df: pd.DataFrame) -> dict:
    """The metrics DVC tracks: the breakdown at the reference batch, and the accounted-vs-measured gaps."""
    ref = df[(df.source == "accounted") & (df.batch_size == p.reference_batch_size)].iloc[0]
    measured = df[df.source != "accounted"]
    with torch.device("meta"):
        n_params = sum(t.numel() for t in build_model(p.model, p.num_classes, p.in_channels).parameters())
    return {
        "profile": p.profile,
        "model": p.model,
        "parameters": n_params,
        "reference_batch_size": p.reference_batch_size,
        "at_peak_mib": {**{c: round(float(ref[f"{c}_mib"]), 3) for c in CATEGORIES}, "total": round(float(ref.total_mib), 3)},
        "activation_share": round(float(ref.activations_mib / ref.total_mib), 4),
        "account_seconds": round(float(ref.seconds), 3),
        "measured": {
            "device": measured.source.iloc[0].removeprefix("measured (").rstrip(")"),
            "gap_pct": {f"b{int(r.batch_size)}": round(float(r.gap_pct), 3) for r in measured.itertuples()},
            "max_abs_gap_pct": round(float(measured.gap_pct.abs().max()), 3),
            **(
                {"max_abs_gap_with_cpu_workspace_pct": round(float(measured.gap_ws_pct.abs().max()), 3)}
                if "gap_ws_pct" in measured
                else {}
            ),
        },
    }


# --- what notebook 01 shows: tables, caption, reading and figure --------------------------------------------------


def accounted_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``breakdown`` accounted on the meta device."""
    return df[df.source == "accounted"]


def measured_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``breakdown`` measured for real, with their gaps to the account."""
    return df[df.source != "accounted"]


def caption(p: MemoryProfileParams, df: pd.DataFrame, metrics: dict) -> str:
    """What the tables and the figure show: model, optimizer, inputs, how each column was obtained, the unit."""
    return (
        f"{p.model}, fp32, SGD with Nesterov momentum, one training step; synthetic inputs (memory depends only on shapes). "
        f"Accounted: lowmem accountant on the meta device at full size. "
        f"Measured: {measured_rows(df).method.iloc[0]} on {metrics['measured']['device']}, profile `{p.profile}`. MiB = 2^20 bytes."
    )


def accounted_table(df: pd.DataFrame) -> pd.DataFrame:
    """The breakdown at the step's peak for each accounted batch size, as the notebook shows it (MiB, 2 decimals)."""
    return accounted_rows(df)[["batch_size", *[f"{c}_mib" for c in CATEGORIES], "total_mib", "peak_phase"]].round(2)


def measured_table(df: pd.DataFrame) -> pd.DataFrame:
    """Accounted against measured peak for each measured batch size, as the notebook shows it."""
    return measured_rows(df).dropna(axis=1, how="all").drop(columns=["source", "seconds"]).round(3)


def tables(df: pd.DataFrame, caption: str) -> dict[str, tuple[pd.DataFrame, str]]:
    """The tables written under figures/, by file name (without suffix): (table, caption)."""
    return {
        "01_memory_breakdown": (accounted_rows(df)
                                .drop(columns=["accounted_mib", "measured_mib", "gap_pct", "method"], errors="ignore")
                                .round(4), caption),
        "01_accounted_vs_measured": (measured_rows(df).dropna(axis=1, how="all").drop(columns=["source"]).round(4), caption),
    }


def reading(p: MemoryProfileParams, metrics: dict) -> str:
    """The result in words (Markdown): the peak at the reference batch, the activations' share, the accountant's gap."""
    ref, measured = metrics["at_peak_mib"], metrics["measured"]
    text = (
        f"At batch {p.reference_batch_size} the accounted peak is **{ref['total']:.1f} MiB**, of which activations are "
        f"**{metrics['activation_share']:.1%}** ({ref['activations']:.1f} MiB); the model's weights are {ref['model']:.2f} MiB. "
        f"Accounting it took {metrics['account_seconds']:.2f} s. Accounted and measured peaks differ by at most "
        f"**{measured['max_abs_gap_pct']:.2f}%** over the measured batch sizes: the accountant counts tensors, "
        f"and the rest is scratch memory inside ops."
    )
    if "max_abs_gap_with_cpu_workspace_pct" in measured:
        text += (
            f" Adding each op's CPU workspace (measured once per op signature, `lowmem.memory.measure.CPUWorkspace`) "
            f"leaves at most **{measured['max_abs_gap_with_cpu_workspace_pct']:.2f}%**."
        )
    return text


def figure(p: MemoryProfileParams, df: pd.DataFrame, metrics: dict, caption: str) -> Figure:
    """Left: each category's share of the peak per batch size. Right: accounted and measured peak against batch size."""
    accounted, measured = accounted_rows(df), measured_rows(df)
    sns.set_theme(style="whitegrid")
    long = accounted.melt(id_vars="batch_size", value_vars=[f"{c}_mib" for c in CATEGORIES], var_name="category", value_name="MiB")
    long["category"] = long.category.str.removesuffix("_mib")
    long["batch size"] = long.batch_size.astype(str)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"wspace": 0.7})
    sns.histplot(long, x="batch size", hue="category", weights="MiB", multiple="fill", shrink=0.8, ax=ax1,
                 hue_order=list(CATEGORIES), palette="colorblind")
    ax1.set(ylabel="share of peak memory", title="Breakdown at the step's peak (accounted)")
    sns.move_legend(ax1, "upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    sns.lineplot(accounted, x="batch_size", y="total_mib", marker="o", ax=ax2, label="accounted (meta device)")
    sns.scatterplot(measured, x="batch_size", y="measured_mib", marker="X", s=120, color="C3", ax=ax2,
                    label=f"measured ({metrics['measured']['device']})", zorder=3)
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.xaxis.set_major_formatter(plt.ScalarFormatter())
    ax2.yaxis.set_major_formatter(plt.ScalarFormatter())
    ax2.set(xlabel="batch size", ylabel="peak memory (MiB, log scale)", title="Peak memory of one step")
    fig.suptitle(f"{p.model} fp32 training memory · profile: {p.profile} · inputs: synthetic (shapes only)", y=1.02)
    fig.text(0.5, -0.1, caption, ha="center", wrap=True, fontsize=8)
    return fig
