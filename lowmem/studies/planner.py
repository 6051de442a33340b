"""Notebook 12's study: ``lowmem plan`` on models no one here wrote, at realistic sizes and several budgets, with each
model's breakdown and the two cross-checks against PyTorch's own tools (``lowmem.studies.crosscheck``).

``run`` computes everything (accounting only: nothing is trained, so the numbers are the same on any machine);
``tables``, ``figure`` and ``metrics`` present it.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from functools import partial
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from lowmem.studies import crosscheck
from lowmem.cli.models import SpecError
from lowmem.studies.planner_params import PlannerParams, levers
from lowmem.cli.plan import budget_bytes, make_plan
from lowmem.cli.profile import account, request
from lowmem.memory.accounting import CATEGORIES

GIB = 2**30


def run(p: PlannerParams) -> dict[str, pd.DataFrame]:
    """{breakdown, plans, memtracker, sac}: each model's plain step by category (bytes), the Pareto set that fits
    each budget (or the smallest peak when nothing does), and the cross-check tables. ``p.workers`` processes share
    the work, one model's plans or one cross-check at a time (``_jobs``); the tables do not depend on how many
    (tests/test_cli.py)."""
    jobs = _jobs(p)
    if p.workers == 1:
        done = [job() for job in tqdm(jobs, desc="planning", disable=None)]
    else:
        # Accounting on tensors without values is Python dispatch on one core, so each core takes a job of its own.
        # Spawned, not forked: the workers import torch afresh rather than inherit the notebook kernel's threads.
        pool = ProcessPoolExecutor(p.workers, mp_context=multiprocessing.get_context("spawn"))
        futures = [pool.submit(job) for job in jobs]
        try:
            for f in tqdm(as_completed(futures), total=len(futures), desc=f"planning ({p.workers} processes)", disable=None):
                f.result()  # a job's error stops the stage without starting the jobs still waiting
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # the jobs already running finish before the process exits
            raise
        pool.shutdown()
        done = [f.result() for f in futures]  # in the jobs' order, whichever finished first
    plans = done[:len(p.models)]
    return {"breakdown": pd.DataFrame([b for b, _ in plans]), "plans": pd.DataFrame([r for _, rows in plans for r in rows]),
            "memtracker": done[len(p.models)], "sac": done[len(p.models) + 1].assign(
                name=[m["name"] for m in p.sac_models for _ in crosscheck.FREED])}


def _jobs(p: PlannerParams) -> list[Callable[[], Any]]:
    """Each model's breakdown and plans (the budgets of one model share its accounted configurations, so they stay in
    one job), then the MemTracker and SAC cross-checks, as calls a worker process can take (picklable)."""
    return ([partial(model_plans, m, p.budgets) for m in p.models]
            + [partial(crosscheck.table, p.memtracker_families),
               partial(crosscheck.sac_table, [request(m) for m in p.sac_models])])


def model_plans(m: dict[str, Any], budgets: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the plain step's breakdown, the plan rows at each of ``budgets``) of model entry ``m``."""
    req = request(m)
    r = account(req)
    breakdown = {"model": m["name"], "spec": m["model"], "batch": m["batch"], "input": m["input"], "optimizer": m["optimizer"],
                 "peak_bytes": r.peak, "peak_phase": r.peak_phase, **{f"at_peak_{c}": r.at_peak[c] for c in CATEGORIES}}
    plans: list[dict[str, Any]] = []
    cache: dict[Any, Any] = {}  # the accounted configurations, shared by the budgets
    for b in budgets:
        try:
            front = make_plan(req, budget_bytes(b), progress=False, cache=cache, levers=levers(m)).fitting
            plans += [{"model": m["name"], "budget": b, "fits": True, **row} for row in front.drop(columns=["tech"]).to_dict("records")]
        except SpecError as e:  # nothing fits: the message names the smallest peak and its configuration
            plans.append({"model": m["name"], "budget": b, "fits": False, "quality_risk": str(e)})
    return breakdown, plans


def _source(p: PlannerParams) -> str:
    return (f"Profile {p.profile}; accounted at full size on tensors without values (fake CPU tensors), nothing "
            "trained, no dataset read: the models' own shapes and a random batch.")


def tables(p: PlannerParams, res: dict[str, pd.DataFrame]) -> dict[str, tuple[pd.DataFrame, str]]:
    b = res["breakdown"]
    shown_b = b.assign(**{c: (b[c] / GIB).round(3) for c in b.columns if c.endswith("_bytes") or c.startswith("at_peak_")})
    plans = res["plans"].copy()
    if "peak_bytes" in plans:
        plans.insert(2, "peak_gib", (plans.pop("peak_bytes") / GIB).round(3))
    # The step column only where a model's plan tried the fused step (planner.models' "step"); else it says "plain" alone.
    fused = "step" in plans and (plans["step"] == "fused").any()
    keep = [c for c in ["model", "budget", "fits", "peak_gib", "precision", "checkpoint", "microbatch", "activation_bits",
                        "optimizer", "step", "recompute", "time", "time_source", "quality_risk", "how_to_apply"]
            if c in plans and (c != "step" or fused)]
    return {
        "12_planner_breakdown": (shown_b, f"{_source(p)} One training step of each model without any lever: its peak and "
                                 "the bytes of each category at the peak, GiB (lowmem profile)."),
        "12_planner_fitting": (plans[keep], f"{_source(p)} lowmem plan at each budget: the Pareto set over peak, time and "
                               "quality risk of the configurations that fit (the largest microbatch that fits per "
                               "setting of the other levers), or, where nothing fits, the smallest peak reachable. "
                               "time is the FLOP ratio (an estimate). Quality risks were measured on WRN, never on these "
                               "models."),
        "12_memtracker_crosscheck": (res["memtracker"].round(3), crosscheck.CAPTION),
        "12_sac_ilp_crosscheck": (res["sac"].round(3), crosscheck.SAC_CAPTION),
    }


def figure(p: PlannerParams, res: dict[str, pd.DataFrame]) -> Figure:
    """(a) each model's plain step by category against the budgets; (b) the accountant's peak over MemTracker's per
    family; (c) recompute against memory freed, the DP planner and the SAC integer program."""
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [1.2, 1, 1]})
    b = res["breakdown"]
    left = np.zeros(len(b))
    colors = plt.get_cmap("tab10").colors
    for i, c in enumerate(CATEGORIES):
        vals = b[f"at_peak_{c}"].to_numpy() / GIB
        axes[0].barh(b.model, vals, left=left, color=colors[i], label=c)
        left += vals
    for budget in p.budgets:
        x = budget_bytes(budget) / GIB
        axes[0].axvline(x, color="k", ls=":", lw=1)
        axes[0].annotate(budget, (x, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -12),
                         textcoords="offset points", fontsize=8)
    axes[0].set_xlabel("GiB at the peak of one plain step")
    axes[0].set_title("(a) What each model's step holds, against the budgets")
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=len(CATEGORIES))
    mt = res["memtracker"]
    labels = [f"{f}\n(checkpoint {c})" for f, c in zip(mt.family, mt.checkpoint)]
    y = np.arange(len(mt))
    axes[1].barh(y + 0.2, mt.memtracker_peak, height=0.4, color=colors[7], label="MemTracker")
    axes[1].barh(y - 0.2, mt.accountant_peak, height=0.4, color=colors[0], label="lowmem's accountant")
    for i, r in enumerate(mt.itertuples()):
        axes[1].annotate(f"{r.gap_pct:+.2f}%", (max(r.memtracker_peak, r.accountant_peak), i), xytext=(3, -3),
                         textcoords="offset points", fontsize=8)
    axes[1].set_yticks(y, labels, fontsize=8)
    axes[1].invert_yaxis()
    axes[1].set_xscale("log")
    axes[1].set_xlabel("peak of one step, MiB (log); the accountant's gap in %")
    axes[1].set_title("(b) The accountant against MemTracker")
    axes[1].legend(fontsize=8, loc="lower right")
    axes[1].margins(x=0.25)
    sac = res["sac"]
    for i, (name, g) in enumerate(sac.groupby("name", sort=False)):
        axes[2].plot(g.freed_mib, g.dp_recompute_gflop, "o-", color=colors[i], label=f"{name}: DP planner (blocks)")
        axes[2].plot(g.freed_mib, g.sac_recompute_gflop, "s--", color=colors[i], label=f"{name}: SAC integer program")
    axes[2].set_xlabel("memory freed from each tool's plain peak, MiB")
    axes[2].set_ylabel("recompute per step, GFLOP (FLOP-counted)")
    axes[2].set_title("(c) Checkpoint placement against PyTorch's SAC ILP")
    axes[2].legend(fontsize=8)
    fig.text(0.01, -0.08, f"{_source(p)} (c): a missing point is a budget the tool finds no placement for.", fontsize=8)
    fig.tight_layout()
    return fig


def metrics(p: PlannerParams, res: dict[str, pd.DataFrame]) -> dict[str, Any]:
    plans, sac, mt = res["plans"], res["sac"], res["memtracker"]
    out: dict[str, Any] = {"profile": p.profile, "models": {}}
    for r in res["breakdown"].itertuples():
        mine = plans[plans.model == r.model]
        out["models"][r.model] = {
            "spec": r.spec, "batch": r.batch, "peak_bytes": int(r.peak_bytes),
            "at_peak_bytes": {c: int(getattr(r, f"at_peak_{c}")) for c in CATEGORIES},
            "budgets": {b: {"fits": bool(g.fits.iloc[0]), "pareto": int(g.fits.sum()),
                            "least_peak_bytes": int(g.peak_bytes.min()) if g.fits.iloc[0] else None}
                        for b, g in mine.groupby("budget", sort=False)}}
    out["memtracker_worst_gap_pct"] = float(mt.gap_pct.abs().max())
    out["sac"] = [{"model": r.name, "freed_share": r.freed_share, "dp_gflop": _num(r.dp_recompute_gflop),
                   "sac_gflop": _num(r.sac_recompute_gflop)} for r in sac.itertuples()]
    return out


def _num(x: float, digits: int = 3) -> float | None:
    """``x`` rounded for a metrics JSON, None where it is missing (NaN)."""
    return None if np.isnan(x) else round(float(x), digits)
