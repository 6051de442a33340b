"""Gradient checkpointing of WRN compared across strategies (notebook 06): exact memory at full size on the meta
device, recompute FLOPs counted, and the step-time ratio measured against no checkpointing in one run."""

from __future__ import annotations

import statistics
import time

import pandas as pd
import torch
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
