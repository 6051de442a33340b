"""Low precision of WRN compared across modes (notebook 04): exact memory at full size, accuracy and skipped steps
of real training, and the step-time ratio against fp32 measured in one run."""

from __future__ import annotations

import statistics
import time
from typing import Any

import pandas as pd
import torch

from lowmem.config import resolve_device
from lowmem.memory.accounting import CATEGORIES, MIB, StepFn, account_step
from lowmem.memory.measure import CPUWorkspace, measure_step
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
