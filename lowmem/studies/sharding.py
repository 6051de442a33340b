"""Notebook 13's study: sharded data parallelism as a memory lever, per device, for WRN-28-2 and DynamicConv.

- ``accounted``: each track's per-device peak over 1..N devices in each mode of ``lowmem.techniques.sharding``,
  with PyTorch's fake process group (nothing trained; the same on any machine). WRN also under the paper's levers.
  The global batch stays fixed: each device steps on its share. Each row carries the bytes a device sends per step
  and, from them, a time estimate at each named interconnect's nominal bandwidth (an estimate, labelled so).
- ``measured``: WRN trained for real on two gloo processes of this machine (``lowmem.studies.shard_run``), each rank's
  measured peak against the account with the CPU's workspaces, the step time on localhost, and the largest
  parameter difference from one process stepping on the whole batch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
from tqdm.auto import tqdm

from lowmem.studies import crosscheck, shard_run
from lowmem.studies.planner_params import ShardingParams
from lowmem.cli.profile import Request, account, request
from lowmem.studies.planner import _num
from lowmem.dynamicconv import memory as fairseq_memory
from lowmem.memory.accounting import CATEGORIES, MIB
from lowmem.memory.measure import CPUWorkspace, GlooWorkspace, workspaces
from lowmem.techniques import sharding
from lowmem.techniques.step import Techniques

GAP_GOAL_PCT = 2.0  # the goal for measured against accounted, per rank


def _row(track: str, levers: str, shard: sharding.Sharding, report: Any, param_bytes: int, p: ShardingParams) -> dict[str, Any]:
    traffic = sharding.traffic_bytes(param_bytes, shard)
    return {"track": track, "levers": levers, "mode": shard.mode, "devices": shard.devices, "peak_bytes": report.peak,
            **{f"at_peak_{c}": report.at_peak[c] for c in CATEGORIES}, "traffic_bytes": traffic,
            **{f"est_comm_s {name}": traffic / bw for name, bw in p.interconnects.items()}}


def _param_bytes(report: Any) -> int:
    """The parameters' bytes in a single-device report (always live, so all at the peak): what each step
    all-reduces as gradients, or gathers as weights."""
    return report.at_peak_roles.get("param", 0)


def accounted(p: ShardingParams) -> pd.DataFrame:
    """Per-device peaks of both tracks over ``p.devices`` and ``p.modes`` (one row for 1 device: nothing to shard)."""
    rows: list[dict[str, Any]] = []
    devices = sorted(p.devices)  # 1 first: the parameter bytes come from the single-device step
    configs = [(levers, d, m) for levers in p.wrn_levers for d in devices for m in (p.modes if d > 1 else p.modes[:1])]
    dc = [(d, m) for d in devices for m in (p.modes if d > 1 else p.modes[:1])]
    with tqdm(total=len(configs) + len(dc), desc="accounting per device", disable=None) as bar:
        base = request(p.wrn)
        params: dict[str, int] = {}  # each setting's parameter bytes, from its single-device step (devices start at 1)
        for levers, d, m in configs:
            shard = sharding.Sharding(d, m)
            r = account(Request(base.model, base.batch, base.input, base.optimizer, devices=d, shard=m),
                        Techniques(**p.wrn_levers[levers]))
            params.setdefault(levers, _param_bytes(r))
            rows.append(_row(p.wrn["name"], levers, shard, r, params[levers], p))
            bar.update()
        for d, m in dc:
            shard = sharding.Sharding(d, m)
            r = fairseq_memory.account(p.recipe_args, p.src_vocab, p.tgt_vocab, p.max_tokens // d, p.reference_length, shard=shard)
            params.setdefault("DynamicConv", _param_bytes(r))
            rows.append(_row("DynamicConv", "plain", shard, r, params["DynamicConv"], p))
            bar.update()
    df = pd.DataFrame(rows)
    single = df[df.devices == 1].set_index(["track", "levers"]).peak_bytes
    df["reduction"] = [single[(t, lv)] / pk for t, lv, pk in zip(df.track, df.levers, df.peak_bytes)]
    return df


def measured(p: ShardingParams, out: Path) -> pd.DataFrame:
    """The gloo run: each rank's measured peak, the account of the same step (and with the CPU's op and gloo
    workspaces, as ``lowmem profile --measure`` compares), the step time, and the difference from one process."""
    base = request(p.wrn)
    req = Request(base.model, p.run_batch, base.input, base.optimizer, devices=p.run_devices)
    rows = pd.DataFrame(shard_run.launch(req, p.modes, out, steps=p.run_steps))
    acc, acc_cpu, acc_ws = {}, {}, {}
    for m in p.modes:
        r = Request(base.model, p.run_batch, base.input, base.optimizer, devices=p.run_devices, shard=m)
        acc[m] = account(r).peak
        acc_cpu[m] = account(r, workspace=CPUWorkspace()).peak
        acc_ws[m] = account(r, workspace=workspaces(CPUWorkspace(), GlooWorkspace())).peak
    one = {m: shard_run.one_process_peak(Request(base.model, p.run_batch, base.input, base.optimizer, devices=p.run_devices,
                                                 shard=m), p.run_steps) for m in p.modes if m in sharding.FSDP_MODES}
    rows["one_process_measured_bytes"] = rows["mode"].map(one)
    rows["accounted_bytes"] = rows["mode"].map(acc)
    rows["accounted_with_workspace_bytes"] = rows["mode"].map(acc_ws)
    rows["gap_pct"] = 100 * (rows.accounted_with_workspace_bytes - rows.measured_peak_bytes) / rows.measured_peak_bytes
    # Without what gloo's collectives allocate (their copies live until gloo's thread finishes them): the account of
    # the step's own tensors, with the CPU's op workspace only, against the measured peak less those copies.
    rows["accounted_cpu_workspace_bytes"] = rows["mode"].map(acc_cpu)
    rows["gap_less_collectives_pct"] = 100 * (rows.accounted_cpu_workspace_bytes - (rows.measured_peak_bytes - rows.measured_collective_bytes)) / (rows.measured_peak_bytes - rows.measured_collective_bytes)
    rows["one_process_gap_pct"] = 100 * (rows.accounted_with_workspace_bytes - rows.one_process_measured_bytes) / rows.one_process_measured_bytes
    if "ledger_peak_bytes" in rows:
        rows["ledger_gap_pct"] = 100 * (rows.ledger_peak_bytes - rows.measured_peak_bytes) / rows.measured_peak_bytes
    rows["within_goal"] = rows.gap_pct.abs() <= GAP_GOAL_PCT
    return rows


def run(p: ShardingParams) -> dict[str, pd.DataFrame]:
    """{accounted, measured, fsdpmemtracker}. The gloo run's per-rank files go to a temporary folder: their rows
    are in ``measured``."""
    base = request(p.wrn)
    fsdp = [Request(base.model, base.batch, base.input, base.optimizer, devices=d, shard=m)
            for d in p.devices if d > 1 for m in p.modes if m in sharding.FSDP_MODES]
    with tempfile.TemporaryDirectory(prefix="lowmem-gloo-") as tmp:
        gloo = measured(p, Path(tmp))
    return {"accounted": accounted(p), "measured": gloo,
            "fsdpmemtracker": crosscheck.fsdp_table(fsdp)}


def _source(p: ShardingParams) -> str:
    return (f"Profile {p.profile}; accounted at full size on fake CPU tensors with PyTorch's fake process group: "
            "nothing trained, no dataset read. DynamicConv is the recipe's full-size model "
            f"({p.max_tokens} tokens per update in all, split over the devices).")


def tables(p: ShardingParams, res: dict[str, pd.DataFrame]) -> dict[str, tuple[pd.DataFrame, str]]:
    a = res["accounted"].copy()
    shown = a[["track", "levers", "mode", "devices"]].assign(
        peak_mib=(a.peak_bytes / MIB).round(2), reduction=a.reduction.round(2),
        **{c: (a[f"at_peak_{c}"] / MIB).round(2) for c in CATEGORIES},
        traffic_mib=(a.traffic_bytes / MIB).round(2),
        **{c: (a[c] * 1e3).round(3) for c in a.columns if c.startswith("est_comm_s")})
    shown = shown.rename(columns={c: c.replace("est_comm_s", "est. comm ms,") for c in shown.columns})
    m = res["measured"]
    keep = [c for c in ["mode", "rank", "devices", "batch", "batch_per_device", "measured_peak_bytes", "measured_peak_max_bytes",
                        "accounted_bytes", "accounted_with_workspace_bytes", "gap_pct", "within_goal",
                        "measured_collective_bytes", "gap_less_collectives_pct", "ledger_peak_bytes", "ledger_gap_pct",
                        "one_process_measured_bytes", "one_process_gap_pct",
                        "step_seconds", "max_abs_diff", "max_abs_step"] if c in m]
    shown_m = m[keep].copy()
    for c in [c for c in keep if c.endswith("_bytes")]:
        shown_m[c.replace("_bytes", "_mib")] = (shown_m.pop(c) / MIB).round(3)
    return {
        "13_sharding_fsdpmemtracker": (res["fsdpmemtracker"].round(3), f"Profile {p.profile}; {p.wrn['name']}'s "
                                       "plain step per device in the FSDP2 modes: lowmem's accountant against PyTorch's "
                                       "FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker), both on fake CPU "
                                       "tensors with the fake process group, after one warm-up step."),
        "13_sharding_per_device": (shown, f"{_source(p)} Per-device peak of one step, MiB, by category at the peak; "
                                   "reduction = the single device's peak over this one. traffic = bytes each device "
                                   "sends per step with ring collectives (lowmem.techniques.sharding.traffic_bytes). "
                                   "est. comm ms = traffic over each link's nominal bandwidth: an estimate, not a "
                                   "measurement, with no overlap and no latency."),
        "13_sharding_gloo_run": (shown_m.round(4), f"Profile {p.profile}; {p.wrn['name']} trained for real on "
                                 f"{p.run_devices} gloo processes on this machine (random batch of {p.run_batch} in "
                                 "all, torchrun). measured = the CPU allocator's peak (torch.profiler), the lowest of "
                                 "the steps after the first (measured_peak_max: the highest); "
                                 "accounted_with_workspace = the accountant's per-device peak plus the CPU's op and "
                                 f"gloo workspaces; within_goal: |gap| <= {GAP_GOAL_PCT}%. measured_collective_bytes = "
                                 "the part of the measured peak allocated inside collectives (gloo's copies, alive "
                                 "until its thread finishes them); gap_less_collectives = the account with the CPU's "
                                 "op workspace against the measured peak less those bytes. ledger = the accountant run "
                                 "on the real processes (FSDP2 modes). one_process_measured = the same step measured the "
                                 "same way in one process beside the fake process group (real tensors and wrappers, "
                                 "collectives that move nothing; FSDP2 modes, DDP's reducer refuses the fake group's "
                                 "results). step_seconds = median step on localhost, "
                                 "the processes sharing this machine's cores: not an interconnect's time. "
                                 "max_abs_diff = largest parameter difference from one process stepping on the whole "
                                 "batch in the ranks' shares as microbatches; max_abs_step = how far that step moved "
                                 "the parameters."),
    }


def figure(p: ShardingParams, res: dict[str, pd.DataFrame]) -> Figure:
    """(a) WRN and (b) DynamicConv per-device peak against devices, per mode; (c) the gloo run: measured against
    accounted, per mode and rank."""
    a = res["accounted"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    colors = dict(zip(sharding.MODES, plt.get_cmap("tab10").colors))
    styles = ["-", "--", ":"]
    for ax, track in zip(axes[:2], [p.wrn["name"], "DynamicConv"]):
        t = a[a.track == track]
        for j, (levers, g) in enumerate(t.groupby("levers", sort=False)):
            one = g[g.devices == 1]
            for mode in p.modes:
                gm = pd.concat([one, g[(g["mode"] == mode) & (g.devices > 1)]]).sort_values("devices")
                ax.plot(gm.devices, gm.peak_bytes / MIB, styles[j % 3], marker="o", ms=4, color=colors[mode],
                        label=f"{mode}: {sharding.MODES[mode]}" if j == 0 else None)
            ax.annotate(levers, (g.devices.max(), g[g.devices == g.devices.max()].peak_bytes.min() / MIB),
                        xytext=(4, 0), textcoords="offset points", fontsize=7, va="center")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(p.devices, [str(d) for d in p.devices])
        ax.set_xlabel("devices (global batch fixed, split among them)")
        ax.set_ylabel("peak memory per device, MiB (log)")
        ax.margins(x=0.3)
    axes[0].set_title(f"(a) {p.wrn['name']}, batch {p.wrn['batch']} (one line style per setting of the levers)")
    axes[1].set_title(f"(b) DynamicConv, {p.max_tokens} tokens per update")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.35, 0.02), ncol=2)
    m = res["measured"]
    y = np.arange(len(m))
    axes[2].barh(y + 0.2, m.measured_peak_bytes / MIB, height=0.4, color="0.6", label="measured (CPU allocator)")
    axes[2].barh(y - 0.2, m.accounted_with_workspace_bytes / MIB, height=0.4, color=colors["replicate"],
                 label="accounted (+ CPU op and gloo workspace)")
    for i, r in enumerate(m.itertuples()):
        axes[2].annotate(f"{r.gap_pct:+.1f}% ({r.gap_less_collectives_pct:+.1f}%)", (max(r.measured_peak_bytes, r.accounted_with_workspace_bytes) / MIB, i),
                         xytext=(3, -3), textcoords="offset points", fontsize=8)
    axes[2].set_yticks(y, [f"{r.mode}, rank {r.rank}" for r in m.itertuples()], fontsize=8)
    axes[2].invert_yaxis()
    axes[2].set_xlabel("peak of a step, MiB; the account's gap in % (in brackets: without gloo's copies)")
    axes[2].set_title(f"(c) Real run: {p.run_devices} gloo processes, batch {p.run_batch}")
    axes[2].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
    axes[2].margins(x=0.2)
    fig.text(0.01, -0.12, f"{_source(p)} (c): {p.wrn['name']} trained on this machine; gap goal {GAP_GOAL_PCT}%.", fontsize=8)
    fig.tight_layout()
    return fig


def metrics(p: ShardingParams, res: dict[str, pd.DataFrame]) -> dict[str, Any]:
    a, m = res["accounted"], res["measured"]
    out: dict[str, Any] = {"profile": p.profile, "per_device": {}}
    for (track, levers), g in a.groupby(["track", "levers"], sort=False):
        out["per_device"][f"{track}, {levers}"] = {
            "single_device_peak_bytes": int(g[g.devices == 1].peak_bytes.iloc[0]),
            "by_mode": {mode: {str(r.devices): {"peak_bytes": int(r.peak_bytes), "reduction": round(float(r.reduction), 3)}
                               for r in gm.itertuples()} for mode, gm in g[g.devices > 1].groupby("mode", sort=False)}}
    out["fsdpmemtracker_worst_gap_pct"] = float(res["fsdpmemtracker"].gap_pct.abs().max())
    out["gloo_run"] = [{"mode": r.mode, "rank": int(r.rank), "measured_peak_bytes": int(r.measured_peak_bytes),
                        "accounted_with_workspace_bytes": int(r.accounted_with_workspace_bytes),
                        "gap_pct": round(float(r.gap_pct), 3), "gap_less_collectives_pct": round(float(r.gap_less_collectives_pct), 3),
                        "one_process_gap_pct": _num(r.one_process_gap_pct, 4),
                        "max_abs_diff": float(r.max_abs_diff),
                        "max_abs_step": float(r.max_abs_step)} for r in m.itertuples()]
    return out

