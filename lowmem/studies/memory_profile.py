"""The memory profile of WRN training (Sohoni et al. 2019, Sec. 3, the baseline breakdown): one fp32 step of the
recipe's SGD at each batch size, accounted at full size on the meta device, and measured for real where asked."""

from __future__ import annotations

import time

import pandas as pd
import torch
import torch.nn.functional as F

from lowmem.config import resolve_device
from lowmem.memory.accounting import CATEGORIES, MIB, MemoryReport, Workspace, account_step, standard_step
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
