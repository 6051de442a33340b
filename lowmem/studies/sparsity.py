"""Sparsity of WRN (notebook 03): exact memory at full size with the sparse layers counted as CSR, the compressed
storage measured for real, accuracy of DSR and static sparse training, and the step-time ratio against dense."""

from __future__ import annotations

import statistics
import time
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure

from lowmem.config import resolve_device
from lowmem.memory.accounting import CATEGORIES, MIB, StepFn, account_step, dense, optimizer_tensors
from lowmem.memory.measure import measure_step
from lowmem.studies.params import SparsityParams
from lowmem.techniques import sparsity
from lowmem.wrn.models import build_model
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.recipe import make_optimizer
from lowmem.wrn.train import Techniques, summarize, train_step

FIXED = ("model", "gradients", "optimizer")  # what sparsity shrinks: weights, their gradients, momentum


def sparse_step(
    p: SparsityParams, level: float, batch_size: int, device: torch.device, method: str = "dsr"
) -> tuple[StepFn, torch.nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    """The trainer's step of ``p.model`` with its 3x3 block convs at ``level`` sparsity (0 = dense)."""
    torch.manual_seed(p.seed)
    with torch.device(device):
        model = build_model(p.model, p.num_classes, p.in_channels)
        x = torch.randn(batch_size, p.in_channels, p.image_size, p.image_size)
        y = torch.randint(0, p.num_classes, (batch_size,))
    if level:
        sparsity.sparsify(model, level, method, p.seed)
    opt = make_optimizer(model)
    return (lambda mark: train_step(model, opt, x, y, Techniques(), mark)), model, opt, (x, y)


def _label(vb: int, ib: int) -> str:
    return f"values {8 * vb}-bit, indices {8 * ib}-bit"


def memory(p: SparsityParams) -> pd.DataFrame:
    """Accounted breakdown at the step's peak, and the fixed part (weights, gradients, optimizer state: each
    category's own maximum) for each sparsity level and CSR format, at batch ``p.batch_size``."""
    rows = []
    for level in p.memory_levels:
        for vb, ib in ([[4, 4]] if level == 0 else p.formats):
            step, model, opt, batch = sparse_step(p, level, p.batch_size, torch.device("meta"))
            fmt = sparsity.CSRFormat(model, ib, vb) if level else dense
            r = account_step(step, model, opt, batch, fmt=fmt)
            widths = fmt.index_widths() if isinstance(fmt, sparsity.CSRFormat) else {}
            rows.append({
                "sparsity": level,
                "format": "dense fp32" if level == 0 else _label(vb, ib),
                **{f"{c}_mib": r.at_peak[c] / MIB for c in CATEGORIES},
                "peak_mib": r.peak / MIB,
                "fixed_mib": sum(r.category_max[c] for c in FIXED) / MIB,
                "layers_16bit_index": f"{sum(w == 2 for w in widths.values())} of {len(widths)}" if widths else "",
            })
    df = pd.DataFrame(rows)
    ref = df[df.sparsity == 0].iloc[0]
    df["peak_reduction"] = ref.peak_mib / df.peak_mib
    df["fixed_reduction"] = ref.fixed_mib / df.fixed_mib
    return df


def stored_bytes(p: SparsityParams, level: float) -> dict[str, float]:
    """The fixed part for real: after one step on the CPU, the bytes PyTorch holds for the weights (values and int32
    indices, other layers dense), the gradients and the optimizer state, against the same accounted as CSR with
    4-byte values and indices (which adds each layer's row pointers)."""
    step, model, opt, batch = sparse_step(p, level, 2, torch.device("cpu"))
    step(lambda _: None)
    names = {t: n for n, t in model.named_parameters()}
    groups = {
        "model": [*model.parameters(), *model.buffers()],
        "gradients": [t.grad for t in model.parameters() if t.grad is not None],
        "optimizer": [t for _, t in optimizer_tensors(opt, names)],
    }
    held = {k: sum(t.untyped_storage().nbytes() for t in v) for k, v in groups.items()}
    accounted = account_step(step, model, opt, batch, fmt=sparsity.CSRFormat(model, 4, 4) if level else dense)
    return {
        "sparsity": level,
        **{f"held_{k}_mib": v / MIB for k, v in held.items()},
        "held_fixed_mib": sum(held.values()) / MIB,
        "accounted_fixed_mib": sum(accounted.category_max[c] for c in FIXED) / MIB,
    }


def verified(p: SparsityParams) -> pd.DataFrame:
    """Measured peak of a real step at ``p.check_batch_size`` against the accounted one (tensors as stored), dense and
    at each sparsity: the compressed storage makes the measured peak fall too."""
    device = resolve_device(p.device)
    rows = []
    for level in p.memory_levels:
        step, model, opt, batch = sparse_step(p, level, p.check_batch_size, device)
        accounted = account_step(step, model, opt, batch).peak
        measured, how = measure_step(step, model, opt, batch)
        held = stored_bytes(p, level) if device.type == "cpu" else {}
        rows.append({
            "sparsity": level, "check_batch_size": p.check_batch_size, "accounted_mib": accounted / MIB,
            "measured_mib": measured / MIB, "gap_pct": 100 * (accounted - measured) / measured, "method": how,
            **{k: v for k, v in held.items() if k != "sparsity"},
        })
    df = pd.DataFrame(rows)
    df["measured_reduction"] = df.measured_mib.iloc[0] / df.measured_mib
    return df


def _tech(p: SparsityParams, level: float, method: str) -> Techniques:
    return Techniques(sparsity=level, sparse_method=method, dsr_periods=tuple(p.dsr_periods), dsr_reallocate=p.dsr_reallocate)


def plan(p: SparsityParams) -> list[tuple[dict[str, Any], BaselineParams, int, Techniques]]:
    """The trained runs: (labels, recipe, seed, techniques) for each (method, level, seed), with the baseline
    block's recipe and data; ``lowmem.pipeline.train_stage`` trains them through the run store."""
    base = BaselineParams(**p.train)
    configs = [("dsr", s) for s in p.train_levels] + [("static", s) for s in p.static_levels if s > 0]
    return [({"method": "dense" if level == 0 else method, "sparsity": level}, base, seed, _tech(p, level, method))
            for method, level in configs for seed in p.train_seeds]


def summary(acc: pd.DataFrame) -> pd.DataFrame:
    """Accuracy (mean, sd over seeds) per (method, level), and its change against dense."""
    rows = []
    for (method, level), g in acc.groupby(["method", "sparsity"], sort=False):
        rows.append({"method": method, "sparsity": level, **summarize(g.to_dict("records")), "rewirings": int(g.rewirings.max()),
                     "sparse_nnz": int(g.sparse_nnz.iloc[0])})
    out = pd.DataFrame(rows)
    out["acc_change_vs_dense"] = out.test_acc_mean - out.loc[out.method == "dense", "test_acc_mean"].iloc[0]
    return out.drop(columns=["seeds", "peak_mem_method", "peak_mem_mib"])


def step_times(p: SparsityParams) -> pd.DataFrame:
    """Seconds per training step of ``p.model`` on ``p.device``: dense, and per trained level static (the compressed
    layers alone) and DSR (the same plus a rewiring after every step, its most frequent), interleaved round by
    round so drift in the machine's speed hits all alike; the ratio is against dense in the same run."""
    device = resolve_device(p.device)
    setups: dict[tuple[str, float], tuple[StepFn, torch.nn.Module, torch.optim.Optimizer, sparsity.DSR | None]] = {}
    for method, level in [("dense", 0.0)] + [(m, s) for s in p.train_levels if s > 0 for m in ("static", "dsr")]:
        step, model, opt, _ = sparse_step(p, level, p.timing_batch_size, device, "static" if method == "dense" else method)
        dsr = None
        if method == "dsr":
            layers = sparsity.sparse_layers(model)
            dsr = sparsity.DSR(layers, 1, sparsity.scaled_reallocation(model, p.dsr_reallocate), (1,), (0.0,), stop=2.0)
        setups[(method, level)] = (step, model, opt, dsr)
    times: dict[tuple[str, float], list[float]] = {k: [] for k in setups}
    for step, _, opt, dsr in setups.values():
        step(lambda _: None)  # warm-up
    for _ in range(p.timing_repeats):
        for key, (step, _, opt, dsr) in setups.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step(lambda _: None).item()
            if dsr is not None:
                dsr.rewire(opt)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[key].append(time.perf_counter() - t0)
    med = {k: statistics.median(t) for k, t in times.items()}
    base = med[("dense", 0.0)]
    rows = []
    for (m, s), t in med.items():
        row = {"method": m, "sparsity": s, "step_s": t, "step_time_ratio": t / base, "device": device.type}
        if m == "dsr":
            # On its schedule DSR rewires at most every min(dsr_periods) steps: the rewiring cost spread over them.
            row["ratio_at_schedule"] = (med[("static", s)] + (t - med[("static", s)]) / min(p.dsr_periods)) / base
        rows.append(row)
    return pd.DataFrame(rows)


# --- what notebook 03 shows: captions, the reading, the figure, the tables and the metrics ---------------------------


def memory_caption(p: SparsityParams) -> str:
    """The caption of the memory table (``memory``)."""
    return (f"{p.model}, fp32 SGD with momentum, batch {p.batch_size}, 3x3 block convs at each sparsity; accounted at full "
            f"size (exact, the same in every profile). MiB at the step's peak by category; `fixed`: weights + gradients "
            f"+ optimizer state (each category's maximum in the step); the sparse layers counted as CSR in the format "
            f"given, every other tensor as stored (fp32). Reductions against dense fp32.")


def check_caption(p: SparsityParams, checks: pd.DataFrame) -> str:
    """The caption of the check table (``verified``), naming how its peaks were measured."""
    return (f"{p.model}: one real training step at batch {p.check_batch_size} ({checks.method.iloc[0]}), measured, against the "
            f"accounted peak (tensors as stored: fp32 values and int32 flat indices). `held_*`: bytes PyTorch holds after a "
            f"step for weights (with indices and BN buffers), gradients and optimizer state; `accounted_fixed`: the same as "
            f"CSR, 32-bit values and indices, which adds row pointers.")


def accuracy_caption(p: SparsityParams, base: BaselineParams, runs: pd.DataFrame) -> str:
    """The caption of the accuracy table (``summary`` of the trained ``runs``): recipe, data, seeds, profile."""
    return (f"{base.model} trained {base.epochs} epoch(s), batch {base.batch_size}, on {runs.data.iloc[0]}: "
            f"{int(runs.train_examples.iloc[0])} train / {int(runs.test_examples.iloc[0])} test images, seeds {p.train_seeds}, "
            f"profile `{p.profile}`; DSR rewiring every {p.dsr_periods} steps by phase.")


def step_time_caption(p: SparsityParams, times: pd.DataFrame) -> str:
    """The caption of the step-time table (``step_times``)."""
    return (f"Step time: {p.model} at batch {p.timing_batch_size} on {times.device.iloc[0]}, median of {p.timing_repeats}, all "
            f"interleaved, against dense; DSR rewires after every step there (`step_time_ratio`), and `ratio_at_schedule` "
            f"spreads that over its shortest period, {min(p.dsr_periods)} steps.")


def reading(p: SparsityParams, mem: pd.DataFrame, checks: pd.DataFrame, acc: pd.DataFrame, times: pd.DataFrame) -> str:
    """What the tables say, as Markdown bullets computed from them."""
    d = mem[mem.sparsity == 0].iloc[0]
    share = d.activations_mib / d.peak_mib
    lines = [f"- Dense: peak **{d.peak_mib:.1f} MiB**, of which activations {d.activations_mib:.1f} MiB "
             f"({share:.1%}) and the fixed part (weights, gradients, momentum) {d.fixed_mib:.1f} MiB."]
    for r in mem[mem.sparsity > 0].itertuples():
        lines.append(f"- {r.sparsity:.0%} sparse, {r.format} (16-bit indices in {r.layers_16bit_index or 'no'} layers): fixed "
                     f"part {r.fixed_mib:.2f} MiB (**{r.fixed_reduction:.1f}x** smaller), total peak {r.peak_mib:.1f} MiB "
                     f"(**{r.peak_reduction:.3f}x**).")
    lines.append("- So sparsity alone shrinks what it touches several-fold but leaves the total almost where it was: at "
                 f"batch {p.batch_size} the activations it does not touch are {share:.0%} of the step.")
    for r in checks[checks.sparsity > 0].itertuples():
        lines.append(f"- Measured at batch {r.check_batch_size}: {r.sparsity:.0%} sparse peaks at {r.measured_mib:.2f} MiB "
                     f"against dense {checks.measured_mib.iloc[0]:.2f} MiB ({r.measured_reduction:.2f}x); accounted within "
                     f"{r.gap_pct:+.2f}%.")
    for r in acc[acc.method != "dense"].itertuples():
        lines.append(f"- {r.method} {r.sparsity:.0%}: accuracy {r.test_acc_mean:.4f} ± {r.test_acc_std:.4f} "
                     f"({r.acc_change_vs_dense:+.4f} vs dense).")
    for r in times[times.method == "dsr"].itertuples():
        lines.append(f"- DSR {r.sparsity:.0%} step time: {r.step_time_ratio:.2f}x dense when it rewires every step, "
                     f"{r.ratio_at_schedule:.2f}x on its schedule.")
    return "\n".join(lines)


def figure(p: SparsityParams, base: BaselineParams, mem: pd.DataFrame, runs: pd.DataFrame, times: pd.DataFrame) -> Figure:
    """Four panels: the accounted peak by category (dense and the second format), the fixed part by format, accuracy
    against sparsity per method, and the step-time ratio against dense."""
    sns.set_theme(style="whitegrid")
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8), gridspec_kw={"wspace": 0.35})
    dense_fixed = mem[mem.sparsity == 0].iloc[0].fixed_mib
    first = mem[(mem.sparsity == 0) | (mem.format == mem.format.iloc[min(1, len(mem) - 1)])]
    cats = ["model_mib", "gradients_mib", "optimizer_mib", "activations_mib", "other_mib"]
    bars = first.set_index(first.sparsity.map(lambda s: f"{s:.0%}"))[cats]
    bars.columns = [c.removesuffix("_mib") for c in cats]
    bars.plot.bar(stacked=True, ax=axes[0], color=sns.color_palette("colorblind", len(cats)), width=0.7)
    axes[0].set(xlabel="sparsity of the 3x3 block convs", ylabel="MiB at the step's peak (accounted, exact)",
                title=f"{p.model}, batch {p.batch_size}: the total barely moves")
    axes[0].tick_params(axis="x", rotation=0)
    axes[0].legend(loc="center", framealpha=0.9)
    sns.lineplot(mem[mem.sparsity > 0], x="sparsity", y="fixed_mib", hue="format", marker="o", ax=axes[1])
    axes[1].axhline(dense_fixed, color="0.3", ls="--", lw=1, label="dense fp32")
    axes[1].set_yscale("log")
    axes[1].set_yticks([t for t in (0.25, 0.5, 1, 2, 5, 10, 20) if mem.fixed_mib.min() / 2 <= t <= dense_fixed * 2])
    axes[1].yaxis.set_major_formatter(plt.ScalarFormatter())
    axes[1].yaxis.set_minor_formatter(plt.NullFormatter())
    axes[1].set(xlabel="sparsity", ylabel="weights + gradients + optimizer (MiB, log)", title="What sparsity shrinks (CSR)")
    axes[1].legend(fontsize=8)
    # The dense runs start both curves, at sparsity 0.
    dense_runs = runs[runs.method == "dense"]
    methods = [m for m in runs.method.unique() if m != "dense"]
    curves = pd.concat([runs[runs.method != "dense"]] + [dense_runs.assign(method=m) for m in methods])
    sns.lineplot(curves, x="sparsity", y="test_acc", hue="method", style="method", markers=True, errorbar="sd", ax=axes[2])
    axes[2].set(xlabel="sparsity", ylabel="test accuracy (mean ± sd over seeds)", title=f"{base.model} on {base.dataset}")
    t = times.assign(label=[m if m == "dense" else f"{m} {s:.0%}" for m, s in zip(times.method, times.sparsity)])
    sns.barplot(t, x="label", y="step_time_ratio", ax=axes[3], color=sns.color_palette("colorblind")[0])
    axes[3].axhline(1, color="0.3", lw=1)
    axes[3].set(xlabel="", ylabel="step time / dense step time",
                title=f"{p.model} step, batch {p.timing_batch_size}, {times.device.iloc[0]}")
    axes[3].tick_params(axis="x", rotation=30)
    fig.suptitle(f"Sparsity · memory: full size, any profile · accuracy and time: profile {p.profile}, "
                 f"data: {runs.data.iloc[0]}", y=1.03)
    caption = " ".join([memory_caption(p), accuracy_caption(p, base, runs), step_time_caption(p, times)])
    fig.text(0.5, -0.16, caption, ha="center", wrap=True, fontsize=8)
    return fig


def tables(
    p: SparsityParams, base: BaselineParams, mem: pd.DataFrame, checks: pd.DataFrame, runs: pd.DataFrame,
    acc: pd.DataFrame, times: pd.DataFrame,
) -> dict[str, tuple[pd.DataFrame, str]]:
    """The tables written under figures/, by file name (no suffix): (rounded table, caption)."""
    trained = f"{accuracy_caption(p, base, runs)} {step_time_caption(p, times)}"
    return {
        "03_sparsity_memory": (mem.round(4), memory_caption(p)),
        "03_sparsity_check": (checks.round(4), check_caption(p, checks)),
        "03_sparsity_accuracy": (acc.round(5), trained),
        "03_sparsity_step_time": (times.round(4), trained),
    }


def metrics(
    p: SparsityParams, base: BaselineParams, mem: pd.DataFrame, checks: pd.DataFrame, runs: pd.DataFrame,
    acc: pd.DataFrame, times: pd.DataFrame,
) -> dict[str, Any]:
    """The stage's metrics JSON (metrics/sparsity.json): memory per (level, format), the check, accuracy and the
    step-time ratios."""
    def check_row(r: Any) -> dict[str, float]:
        row = {"measured_mib": round(r.measured_mib, 3), "gap_pct": round(r.gap_pct, 3)}
        if "held_fixed_mib" in checks:  # measured on the CPU only
            row.update(held_fixed_mib=round(r.held_fixed_mib, 3), accounted_fixed_mib=round(r.accounted_fixed_mib, 3))
        return row

    return {
        "profile": p.profile, "memory_model": p.model, "memory_batch_size": p.batch_size,
        "memory": {f"{r.sparsity}_{r.format}": {"peak_mib": round(r.peak_mib, 3), "fixed_mib": round(r.fixed_mib, 3),
                                                "peak_reduction": round(r.peak_reduction, 4),
                                                "fixed_reduction": round(r.fixed_reduction, 3)}
                   for r in mem.itertuples()},
        "check": {f"{r.sparsity}": check_row(r) for r in checks.itertuples()},
        "train_model": base.model, "train_data": runs.data.iloc[0], "train_batch_size": base.batch_size,
        "trained": {f"{r.method}_{r.sparsity}": {"test_acc_mean": r.test_acc_mean, "test_acc_std": r.test_acc_std,
                                                 "acc_change_vs_dense": round(float(r.acc_change_vs_dense), 5)}
                    for r in acc.itertuples()},
        "timing_device": times.device.iloc[0],
        "step_time_ratio": {f"{r.method}_{r.sparsity}": round(r.step_time_ratio, 3) for r in times.itertuples()},
        "dsr_ratio_at_schedule": {f"{r.sparsity}": round(r.ratio_at_schedule, 3)
                                  for r in times[times.method == "dsr"].itertuples()},
    }
