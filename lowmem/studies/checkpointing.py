"""Gradient checkpointing of WRN compared across strategies (notebook 06): exact memory at full size on the meta
device, recompute FLOPs counted, and the step-time ratio measured against no checkpointing in one run.

``comparison`` and ``planner_frontier`` compute the study; ``caption``, ``reading``, ``figure`` and ``metrics`` are
what the notebook shows and writes."""

from __future__ import annotations

import statistics
import time

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure
from torch.utils.flop_counter import FlopCounterMode

from lowmem.config import resolve_device
from lowmem.memory.accounting import MIB, account_step
from lowmem.memory.measure import CPUWorkspace, measure_step
from lowmem.studies.memory_profile import wrn_step
from lowmem.studies.params import CheckpointingParams
from lowmem.techniques import checkpoint
from lowmem.wrn.models import build_model


def _step_flops(p: CheckpointingParams, spec: str) -> int:
    step, *_ = wrn_step(p, p.batch_size, torch.device("meta"), spec)
    with FlopCounterMode(display=False) as fc:
        step(lambda _: None)
    return fc.get_total_flops()


def accounted(p: CheckpointingParams) -> pd.DataFrame:
    """One row per strategy at ``p.batch_size``: accounted activations and peak, the planner's segments and model,
    and the recompute FLOPs counted over a whole step (conv and matmul FLOPs, as torch's FlopCounterMode counts)."""
    with torch.device("meta"):
        ref = build_model(p.model, num_classes=p.num_classes, in_channels=p.in_channels)
    costs = checkpoint.chain_costs(ref, (p.batch_size, p.in_channels, p.image_size, p.image_size))
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        ref(torch.empty(p.batch_size, p.in_channels, p.image_size, p.image_size, device="meta"))
    forward_flops = fc.get_total_flops()
    base_flops = _step_flops(p, "none")
    rows = []
    for spec in p.strategies:
        step, model, opt, batch = wrn_step(p, p.batch_size, torch.device("meta"), spec)
        r = account_step(step, model, opt, batch)
        segments = checkpoint.plan(spec, len(costs), costs)
        # The planner models segmentations only; a selective policy keeps part of each block, which it cannot see.
        planned_mem, planned_recompute = checkpoint.modelled(costs, segments) if spec != "selective" else (float("nan"),) * 2
        rows.append({
            "strategy": spec,
            "segments": len(segments),
            "recomputed_blocks": sum(e - s for s, e, ck in segments if ck),
            "activations_mib": r.category_max["activations"] / MIB,
            "peak_mib": r.peak / MIB,
            "peak_phase": r.peak_phase,
            "extra_forward_flops": (_step_flops(p, spec) - base_flops) / forward_flops,
            "planner_activations_mib": planned_mem / MIB,
            "planner_recompute": planned_recompute / forward_flops,
        })
    return pd.DataFrame(rows)


def planner_frontier(p: CheckpointingParams) -> pd.DataFrame:
    """The optimal strategy's memory-recompute curve, under the planner's model."""
    with torch.device("meta"):
        ref = build_model(p.model, num_classes=p.num_classes, in_channels=p.in_channels)
    shape = (p.batch_size, p.in_channels, p.image_size, p.image_size)
    costs = checkpoint.chain_costs(ref, shape)
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        ref(torch.empty(shape, device="meta"))
    pts = checkpoint.frontier(costs)
    return pd.DataFrame(
        [{"planner_activations_mib": m / MIB, "planner_recompute": r / fc.get_total_flops(), "segments": len(s)} for m, r, s in pts]
    )


def step_times(p: CheckpointingParams) -> pd.DataFrame:
    """Seconds per training step of each strategy on ``p.device``, interleaved round by round so that drift in the
    machine's speed hits every strategy alike; the ratio is against 'none' in the same run."""
    device = resolve_device(p.device)
    setups = {spec: wrn_step(p, p.timing_batch_size, device, spec)[0] for spec in p.strategies}
    for step in setups.values():
        step(lambda _: None)  # warm-up: allocations, lazy optimizer state
    times: dict[str, list[float]] = {spec: [] for spec in p.strategies}
    for _ in range(p.timing_repeats):
        for spec, step in setups.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step(lambda _: None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[spec].append(time.perf_counter() - t0)
    base = statistics.median(times["none"])
    return pd.DataFrame(
        [{"strategy": s, "step_s": statistics.median(t), "step_time_ratio": statistics.median(t) / base, "device": device.type} for s, t in times.items()]
    )


def verified(p: CheckpointingParams) -> pd.DataFrame:
    """Accounted against measured peak for each strategy, for real at ``p.timing_batch_size`` on ``p.device``. On the
    CPU the account is given twice: tensors only, and with each op's measured workspace added."""
    device = resolve_device(p.device)
    workspace = CPUWorkspace() if device.type == "cpu" else None
    rows = []
    for spec in p.strategies:
        step, model, opt, batch = wrn_step(p, p.timing_batch_size, device, spec)
        tensors_only = account_step(step, model, opt, batch).peak
        measured, how = measure_step(step, model, opt, batch)
        row = {"strategy": spec, "check_accounted_mib": tensors_only / MIB, "check_measured_mib": measured / MIB}
        row["check_gap_pct"] = 100 * (tensors_only - measured) / measured
        if workspace is not None:
            with_ws = account_step(step, model, opt, batch, workspace=workspace).peak
            row.update(check_accounted_ws_mib=with_ws / MIB, check_gap_ws_pct=100 * (with_ws - measured) / measured)
        rows.append(row)
    return pd.DataFrame(rows)


# --- what notebook 06 shows: the table, caption, reading, figure and metrics --------------------------------------


def comparison(p: CheckpointingParams) -> pd.DataFrame:
    """One row per strategy: ``accounted``, ``step_times`` and ``verified`` side by side."""
    return accounted(p).merge(step_times(p), on="strategy").merge(verified(p), on="strategy")


def caption(p: CheckpointingParams, table: pd.DataFrame) -> str:
    """What the table and the figure show: how memory, recompute, step time and the check were obtained."""
    device = table.device.iloc[0]
    return (
        f"{p.model}, fp32, SGD. Memory: lowmem accountant on the meta device at batch {p.batch_size} (exact, any profile). "
        f"Recompute: extra conv/matmul FLOPs per step, in forward passes. Step time: median of {p.timing_repeats} "
        f"interleaved step(s) at batch {p.timing_batch_size} on {device}, profile `{p.profile}`; synthetic inputs. "
        f"check_*: accounted vs measured peak at that batch on {device} (ws: with each op's measured CPU workspace)."
    )


def reading(p: CheckpointingParams, table: pd.DataFrame) -> str:
    """The result in words (Markdown): memory without checkpointing, the least, its cost, and the accountant's check."""
    none = table.set_index("strategy").loc["none"]
    best = table.loc[table.activations_mib.idxmin()]
    text = (
        f"Without checkpointing the step keeps **{none.activations_mib:.0f} MiB** of activations (peak {none.peak_mib:.0f} MiB). "
        f"The least is **{best.activations_mib:.0f} MiB** with `{best.strategy}` (peak {best.peak_mib:.0f} MiB), at "
        f"{best.extra_forward_flops:.2f} extra forward passes and a measured step-time ratio of **{best.step_time_ratio:.2f}x**. "
        f"Checked for real at batch {p.timing_batch_size}: the accounted peak is within "
        f"{table.check_gap_pct.abs().max():.2f}% of the measured one counting tensors only"
    )
    if "check_gap_ws_pct" in table:
        return text + f", and within {table.check_gap_ws_pct.abs().max():.2f}% with each op's CPU workspace added."
    return text + "."


def figure(p: CheckpointingParams, table: pd.DataFrame, front: pd.DataFrame, caption: str) -> Figure:
    """Left: each strategy against the planner's memory-recompute Pareto front. Right: accounted activations and
    peak per strategy, labelled with the measured step-time ratio."""
    sns.set_theme(style="whitegrid")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"wspace": 0.3})
    ax1.step(front.planner_recompute, front.planner_activations_mib, where="post", color="0.3",
             label="optimal (planner's Pareto front)")
    simple = table[table.strategy != "selective"]
    sns.scatterplot(simple, x="planner_recompute", y="planner_activations_mib", hue="strategy", s=90, ax=ax1, zorder=3)
    ax1.set(xlabel="recompute (forward passes of the model, planner's model)",
            ylabel="activation memory (MiB, planner's model)",
            title="Memory–recompute trade-off: strategies on or above the optimum")
    long = table.melt(id_vars=["strategy", "step_time_ratio"], value_vars=["activations_mib", "peak_mib"],
                      var_name="what", value_name="MiB")
    long["what"] = long.what.map({"activations_mib": "activations (max)", "peak_mib": "total peak"})
    sns.barplot(long, x="strategy", y="MiB", hue="what", ax=ax2, palette="colorblind")
    for i, r in enumerate(table.itertuples()):
        ax2.annotate(f"{r.step_time_ratio:.2f}x", (i, r.peak_mib), ha="center", va="bottom", fontsize=9)
    ax2.set(xlabel="", ylabel="MiB (accounted, exact)", title=f"Accounted memory at batch {p.batch_size}; label: step-time ratio")
    ax2.tick_params(axis="x", rotation=30)
    sns.move_legend(ax2, "upper right", title=None)
    fig.suptitle(f"{p.model} gradient checkpointing · profile: {p.profile} · inputs: synthetic (shapes only)", y=1.02)
    fig.text(0.5, -0.1, caption, ha="center", wrap=True, fontsize=8)
    return fig


def metrics(p: CheckpointingParams, table: pd.DataFrame) -> dict:
    """The metrics DVC tracks: each strategy's memory, recompute and step-time ratio, and the accountant's check."""
    out = {
        "profile": p.profile, "model": p.model, "batch_size": p.batch_size, "timing_batch_size": p.timing_batch_size,
        "timing_device": table.device.iloc[0],
        "strategies": {
            r.strategy: {"activations_mib": round(r.activations_mib, 2), "peak_mib": round(r.peak_mib, 2),
                         "extra_forward_flops": round(r.extra_forward_flops, 4), "step_time_ratio": round(r.step_time_ratio, 3)}
            for r in table.itertuples()
        },
        "check_max_abs_gap_pct": round(float(table.check_gap_pct.abs().max()), 3),
    }
    if "check_gap_ws_pct" in table:
        out["check_max_abs_gap_with_cpu_workspace_pct"] = round(float(table.check_gap_ws_pct.abs().max()), 3)
    return out
