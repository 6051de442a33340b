"""Low precision of WRN compared across modes (notebook 04): exact memory at full size, accuracy and skipped steps
of real training, and the step-time ratio against fp32 measured in one run."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
import yaml
from matplotlib.figure import Figure

from lowmem import runs
from lowmem.config import ParamError, resolve_device
from lowmem.memory.accounting import CATEGORIES, MIB, StepFn, account_step
from lowmem.memory.measure import CPUWorkspace, measure_step
from lowmem.studies import quality
from lowmem.studies.params import PrecisionParams
from lowmem.techniques import precision
from lowmem.wrn.models import build_model
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.recipe import make_optimizer
from lowmem.wrn.train import Techniques, summarize, train_step


def mode_step(
    p: PrecisionParams, mode: str, batch_size: int, device: torch.device, microbatch: int = 0, sync: bool = True
) -> tuple[StepFn, torch.nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    """The trainer's step of ``p.model`` in ``mode`` on a random batch: (step, model, optimizer, batch)."""
    prec = precision.parse(mode)
    torch.manual_seed(p.seed)
    with torch.device(device):
        model = precision.prepare(build_model(p.model, p.num_classes, p.in_channels), prec)
        x = precision.cast_batch(torch.randn(batch_size, p.in_channels, p.image_size, p.image_size), prec)
        y = torch.randint(0, p.num_classes, (batch_size,))
    opt = make_optimizer(model)
    scaler = precision.make_scaler(prec, device.type, sync=sync)
    tech = Techniques(precision=mode, microbatch=microbatch if microbatch < batch_size else 0)
    return (lambda mark: train_step(model, opt, x, y, tech, mark, scaler)), model, opt, (x, y)


def memory(p: PrecisionParams) -> pd.DataFrame:
    """Accounted breakdown at the step's peak for each mode and microbatch size, at batch ``p.batch_size``."""
    rows = []
    for b in p.memory_microbatches:
        for mode in p.modes:
            ctx, device = precision.shapes_only(precision.parse(mode))
            with ctx:
                step, model, opt, batch = mode_step(p, mode, p.batch_size, device, microbatch=b, sync=False)
                r = account_step(step, model, opt, batch)
            copies = r.at_peak_roles.get("weight-copy", 0)
            row = {"mode": mode, "microbatch": b, "weights_mib": (r.at_peak["model"] - copies) / MIB, "weight_copies_mib": copies / MIB}
            row.update({f"{c}_mib": r.at_peak[c] / MIB for c in CATEGORIES if c != "model"})
            rows.append({**row, "peak_mib": r.peak / MIB, "peak_phase": r.peak_phase})
    df = pd.DataFrame(rows)
    fp32 = df[df["mode"] == "fp32"].set_index("microbatch").peak_mib
    df["reduction_vs_fp32"] = df.microbatch.map(fp32) / df.peak_mib
    return df


def plan(p: PrecisionParams) -> list[tuple[dict[str, Any], BaselineParams, int, Techniques]]:
    """The trained runs: (labels, recipe, seed, techniques) for each (mode, seed), with the baseline block's recipe."""
    base = BaselineParams(**p.train)
    return [({"mode": mode}, base, seed, Techniques(precision=mode)) for mode in p.train_modes for seed in p.train_seeds]


def summary(acc: pd.DataFrame) -> pd.DataFrame:
    """Accuracy (mean, sd over seeds), its change against fp32, and steps skipped for non-finite gradients."""
    rows = []
    for mode, g in acc.groupby("mode", sort=False):
        rows.append({
            "mode": mode,
            **summarize(g.to_dict("records")),
            "skipped_steps_max": int(g.skipped_steps.max()),
            "final_loss_scale_min": float(g.loss_scale.min()),
        })
    out = pd.DataFrame(rows)
    out["acc_change_vs_fp32"] = out.test_acc_mean - out.loc[out["mode"] == "fp32", "test_acc_mean"].iloc[0]
    return out.drop(columns=["seeds", "peak_mem_method", "peak_mem_mib"])


def step_times(p: PrecisionParams) -> pd.DataFrame:
    """Seconds per training step of ``p.model`` in each trained mode on ``p.device``, interleaved round by round so
    drift in the machine's speed hits every mode alike; the ratio is against fp32 in the same run."""
    device = resolve_device(p.device)
    steps = {mode: mode_step(p, mode, p.timing_batch_size, device)[0] for mode in p.train_modes}
    for step in steps.values():
        step(lambda _: None)  # warm-up: allocations, lazy optimizer state, kernel selection
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    for _ in range(p.timing_repeats):
        for mode, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step(lambda _: None).item()  # .item() waits for the step, as training does
            times[mode].append(time.perf_counter() - t0)
    base = statistics.median(times["fp32"])
    return pd.DataFrame(
        [{"mode": m, "step_s": statistics.median(t), "step_time_ratio": statistics.median(t) / base, "device": device.type} for m, t in times.items()]
    )


def verified(p: PrecisionParams) -> pd.DataFrame:
    """Accounted against measured peak for each trained mode, for real at ``p.check_batch_size`` on ``p.device``
    (real tensors, so autocast acts in mixed modes). On the CPU, also with each op's measured workspace."""
    device = resolve_device(p.device)
    workspace = CPUWorkspace() if device.type == "cpu" else None
    rows = []
    for mode in p.train_modes:
        step, model, opt, batch = mode_step(p, mode, p.check_batch_size, device)
        tensors_only = account_step(step, model, opt, batch).peak
        measured, how = measure_step(step, model, opt, batch)
        row = {"mode": mode, "check_batch_size": p.check_batch_size, "accounted_mib": tensors_only / MIB, "measured_mib": measured / MIB}
        row["gap_pct"] = 100 * (tensors_only - measured) / measured
        if workspace is not None:
            with_ws = account_step(step, model, opt, batch, workspace=workspace).peak
            row.update(accounted_ws_mib=with_ws / MIB, gap_ws_pct=100 * (with_ws - measured) / measured)
        rows.append({**row, "method": how})
    return pd.DataFrame(rows)


# Stage precision_train is left out of `make repro` (bf16 steps are emulated, about 30 times slower, on a CPU without
# AVX-512's bf16 or AMX): it trains the runs and measures the step times and the check once, into committed files.
COMMAND = ("python -m lowmem.pipeline params && python -m lowmem.pipeline train precision --params "
           "data/params/precision.yaml --out metrics/precision_train.json && python -m lowmem.pipeline precision "
           "--params data/params/precision.yaml --out metrics/precision_timing.json")


def timing_settings(p: PrecisionParams) -> dict[str, Any]:
    """What the step times and the check depend on: a file measured at other settings is not this one's."""
    return {"model": p.model, "modes": p.train_modes, "timing_batch_size": p.timing_batch_size,
            "timing_repeats": p.timing_repeats, "check_batch_size": p.check_batch_size, "device": p.device}


def measure(p: PrecisionParams) -> dict[str, Any]:
    """``step_times`` and ``verified`` at ``p``, with the machine that measured them."""
    return {"profile": p.profile, "settings": timing_settings(p), "machine": quality.machine(),
            "times": step_times(p).to_dict("records"), "checks": verified(p).to_dict("records")}


def timing(p: PrecisionParams, path: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(step times with the machine that measured them, checks) from ``path``, stage precision_train's committed measurement, as it is; a missing
    file (a notebook opened alone) is measured here, and so is a smoke run where ``path`` holds another profile's,
    into a file beside it (as ``train_stage.frozen_results``)."""
    path = Path(path)

    def holds(f: Path) -> bool:
        r = runs.read_json(f)
        return r["profile"] == p.profile and r["settings"] == timing_settings(p)

    if path.exists() and not holds(path):
        beside = path.with_name(f"{path.stem}-{p.profile}{path.suffix}")
        if p.profile != "smoke" and not (beside.exists() and holds(beside)):
            raise ParamError(f"{path} was measured at other settings than params.yaml's precision block at profile "
                             f"{p.profile}; measure again: {COMMAND}")
        path = beside
    if not path.exists():
        runs.write_json(path, measure(p))
    r = runs.read_json(path)
    return pd.DataFrame(r["times"]).assign(machine=r["machine"]), pd.DataFrame(r["checks"])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--params", type=Path, required=True, help="the stage's resolved parameters (python -m lowmem.pipeline params)")
    ap.add_argument("--out", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    try:
        p = PrecisionParams(**yaml.safe_load(args.params.read_text()))
    except (ParamError, TypeError) as e:
        print(f"error: {args.params}: {e}; regenerate it with python -m lowmem.pipeline params", file=sys.stderr)
        return 2
    runs.write_json(args.out, measure(p))
    return 0


# --- what notebook 04 shows: the trained table, captions, the reading, the figure, the tables and the metrics --------

FIXED_PARTS = ["weights_mib", "weight_copies_mib", "gradients_mib", "optimizer_mib"]  # what activations' size leaves


def trained(acc: pd.DataFrame, times: pd.DataFrame, checks: pd.DataFrame) -> pd.DataFrame:
    """One row per trained mode: its accuracy (``summary``), its timed step (``step_times``) and its check
    (``verified``, columns prefixed ``check_``)."""
    acc = acc.merge(times[["mode", "step_s", "step_time_ratio"]].rename(columns={"step_s": "timed_step_s"}), on="mode")
    checked = checks.drop(columns=["check_batch_size"]).add_prefix("check_").rename(columns={"check_mode": "mode"})
    return acc.merge(checked, on="mode")


def memory_caption(p: PrecisionParams) -> str:
    """The caption of the memory table (``memory``)."""
    return (f"{p.model}, SGD with momentum, minibatch B = {p.batch_size} (split into microbatches of b where b < B); "
            f"accounted at full size (exact, the same in every profile). MiB at the step's peak. `weights`: the "
            f"parameters as stored (fp32 in fp32 and mixed modes, where they are the master copy; 16-bit in half "
            f"modes); `weight_copies`: autocast's 16-bit copies of them.")


def accuracy_caption(p: PrecisionParams, base: BaselineParams, runs: pd.DataFrame, times: pd.DataFrame) -> str:
    """The caption of the trained table (``trained``): recipe, data, seeds, profile, and where it was timed."""
    device = times.device.iloc[0] + (f" ({times.machine.iloc[0]})" if "machine" in times else "")
    return (f"{base.model} trained {base.epochs} epoch(s), batch {base.batch_size}, on {runs.data.iloc[0]}: "
            f"{int(runs.train_examples.iloc[0])} train / {int(runs.test_examples.iloc[0])} test images, seeds {p.train_seeds}, "
            f"profile `{p.profile}`. Skipped: steps skipped for non-finite gradients (max over seeds). Step time: "
            f"{p.model} at batch {p.timing_batch_size} on {device}, median of {p.timing_repeats}, modes interleaved, "
            f"ratio against fp32. Check: accounted vs measured peak at batch {p.check_batch_size} on {device}.")


def reading(p: PrecisionParams, mem: pd.DataFrame, acc: pd.DataFrame, times: pd.DataFrame) -> str:
    """What the tables say, as Markdown bullets computed from them (``acc`` is the ``trained`` table)."""
    full, small = max(p.memory_microbatches), min(p.memory_microbatches)
    m = mem.set_index(["mode", "microbatch"])
    lines = []
    for b in (full, small):
        best = m.xs(b, level="microbatch").reduction_vs_fp32
        lines.append(f"- b = {b}: fp32 peaks at **{m.loc[('fp32', b), 'peak_mib']:.1f} MiB**; "
                     + ", ".join(f"{mode} {r:.2f}x" for mode, r in best.items() if mode != "fp32") + ".")
    mixed = [x for x in p.modes if x.startswith("mixed")]
    if mixed:
        mx = mixed[0]
        lines.append(
            f"- Why mixed saves less: it halves the activations, but keeps fp32 weights, gradients and momentum and adds "
            f"a 16-bit copy of the weights: at b = {small} those come to {m.loc[(mx, small), FIXED_PARTS].sum():.1f} MiB "
            f"against fp32's {m.loc[('fp32', small), FIXED_PARTS].sum():.1f} MiB, so where activations are small "
            f"(microbatching) mixed precision saves {'nothing' if m.loc[(mx, small), 'reduction_vs_fp32'] <= 1 else 'little'}. "
            "Only half mode shrinks the weights, gradients and optimizer state too."
        )
    a = acc.set_index("mode")
    for mode in a.index:
        if mode == "fp32":
            continue
        lines.append(f"- {mode}: accuracy {a.loc[mode, 'test_acc_mean']:.4f} ± {a.loc[mode, 'test_acc_std']:.4f} "
                     f"({a.loc[mode, 'acc_change_vs_fp32']:+.4f} vs fp32), {int(a.loc[mode, 'skipped_steps_max'])} skipped "
                     f"steps, step time {a.loc[mode, 'step_time_ratio']:.2f}x fp32 ({p.model}, {times.device.iloc[0]}).")
    untrained = [x for x in p.modes if x not in p.train_modes]
    if untrained:
        lines.append(f"- Not trained in profile `{p.profile}`: {', '.join(untrained)} (memory accounted above only).")
    return "\n".join(lines)


def figure(p: PrecisionParams, base: BaselineParams, mem: pd.DataFrame, runs: pd.DataFrame, acc: pd.DataFrame,
           times: pd.DataFrame) -> Figure:
    """Four panels: the accounted peak by category per mode for the whole batch and the smallest microbatch,
    accuracy per trained mode, and the step-time ratio against fp32."""
    sns.set_theme(style="whitegrid")
    device = times.device.iloc[0]
    full, small = max(p.memory_microbatches), min(p.memory_microbatches)
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.8), gridspec_kw={"wspace": 0.45, "width_ratios": [1.2, 1.2, 1, 1]})
    parts = [*FIXED_PARTS, "activations_mib", "other_mib"]
    colors = sns.color_palette("colorblind", len(parts))
    for ax, b in zip(axes[:2], (full, small)):
        d = mem[mem.microbatch == b].set_index("mode")[parts]
        d.columns = [c.removesuffix("_mib").replace("_", " ") for c in parts]
        d.plot.barh(stacked=True, ax=ax, color=colors, legend=(b == small), width=0.7)
        for i, (_, r) in enumerate(mem[mem.microbatch == b].set_index("mode").iterrows()):
            ax.annotate(f" {r.peak_mib:.1f} ({r.reduction_vs_fp32:.2f}x)", (r.peak_mib, i), va="center", fontsize=9)
        ax.invert_yaxis()
        what = "whole batch" if b == p.batch_size else f"microbatches b = {b}"
        ax.set(xlabel="MiB at the step's peak (accounted, exact)", ylabel="", title=f"{p.model}: {what} of B = {p.batch_size}")
        ax.set_xlim(0, d.sum(axis=1).max() * 1.35)
    axes[1].legend(loc="lower right", fontsize=8)
    sns.pointplot(runs, x="mode", y="test_acc", errorbar="sd", linestyle="none", ax=axes[2], order=p.train_modes)
    axes[2].set(xlabel="", ylabel="test accuracy (mean ± sd over seeds)", title=f"{base.model} on {base.dataset}")
    sns.barplot(acc, x="mode", y="step_time_ratio", ax=axes[3], order=p.train_modes, color=colors[0])
    axes[3].axhline(1, color="0.3", lw=1)
    axes[3].set(xlabel="", ylabel="step time / fp32 step time", title=f"{p.model} step, batch {p.timing_batch_size}, {device}")
    for ax in axes[2:]:
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(f"Low precision · memory: full size, any profile · accuracy and time: profile {p.profile}, "
                 f"data: {runs.data.iloc[0]}", y=1.03)
    fig.text(0.5, -0.14, memory_caption(p) + " " + accuracy_caption(p, base, runs, times), ha="center", wrap=True, fontsize=8)
    return fig


def tables(p: PrecisionParams, base: BaselineParams, mem: pd.DataFrame, runs: pd.DataFrame, acc: pd.DataFrame,
           times: pd.DataFrame) -> dict[str, tuple[pd.DataFrame, str]]:
    """The tables written under figures/, by file name (no suffix): (rounded table, caption)."""
    return {
        "04_precision_memory": (mem.round(4), memory_caption(p)),
        "04_precision_accuracy": (acc.round(5), accuracy_caption(p, base, runs, times)),
    }


def metrics(p: PrecisionParams, base: BaselineParams, mem: pd.DataFrame, runs: pd.DataFrame, acc: pd.DataFrame,
            times: pd.DataFrame) -> dict[str, Any]:
    """The stage's metrics JSON (metrics/precision.json): peak and reduction per (mode, b), and per trained mode its
    accuracy, skipped steps, step-time ratio and check gap."""
    return {
        "profile": p.profile, "memory_model": p.model, "memory_batch_size": p.batch_size,
        "peak_mib": {f"{r.mode}_b{r.microbatch}": round(float(r.peak_mib), 2) for r in mem.itertuples()},
        "reduction_vs_fp32": {f"{r.mode}_b{r.microbatch}": round(float(r.reduction_vs_fp32), 3) for r in mem.itertuples()},
        "train_model": base.model, "train_data": runs.data.iloc[0], "train_batch_size": base.batch_size,
        "timing_device": times.device.iloc[0],
        "trained": {r.mode: {"test_acc_mean": r.test_acc_mean, "test_acc_std": r.test_acc_std,
                             "acc_change_vs_fp32": round(float(r.acc_change_vs_fp32), 5),
                             "skipped_steps_max": int(r.skipped_steps_max), "step_time_ratio": round(float(r.step_time_ratio), 3),
                             "check_gap_pct": round(float(r.check_gap_pct), 3)}
                    for r in acc.itertuples()},
    }
