"""Sparsity of WRN (notebook 03): exact memory at full size with the sparse layers counted as CSR, the compressed
storage measured for real, accuracy of DSR and static sparse training, and the step-time ratio against dense."""

from __future__ import annotations

import statistics
import time
from typing import Any

import pandas as pd
import torch

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
