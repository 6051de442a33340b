"""The accountant and the checkpoint planner against PyTorch's own tools, on the same model and step, all on fake CPU
tensors.

**MemTracker** (``torch.distributed._tools.mem_tracker``): total peaks and the breakdown at each one's peak.

The two categorize differently. MemTracker's ``Activation`` is every tensor made in the forward pass and still
alive, saved for backward or not; the accountant's ``activations`` are the tensors autograd saves (its other
forward tensors are ``other``). MemTracker files the batch and the loss's tensors as ``Temp`` or ``Input`` where the
accountant says ``other``. So the totals should agree where both see the same storages, and the categories need
not; ``TOTALS`` maps both to the accountant's five categories for the table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.ilp_utils import aggregate_stats, get_peak_memory_runtime_baseline, parse_module_info
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.runtime_estimator import RuntimeEstimator
from torch.distributed._tools.sac_estimator import SACEstimator
from torch.utils.flop_counter import flop_registry

from lowmem.cli import models
from lowmem.cli.profile import Request, account, chain_costs, chains, request, step_of
from lowmem.techniques import checkpoint
from lowmem.memory.accounting import CATEGORIES
from lowmem.techniques import precision
from lowmem.techniques.step import Techniques

# MemTracker's reference types, under the accountant's category names.
TOTALS = {"Parameter": "model", "Buffer": "model", "Gradient": "gradients", "Optstate": "optimizer",
          "Activation": "activations", "Temp": "other", "Input": "other", "Other": "other"}


def memtracker(req: Request, tech: Techniques = Techniques()) -> dict[str, Any]:
    """MemTracker's peak of one step (after a warm-up step, as the accountant's) and its breakdown at that peak,
    beside the accountant's, in bytes."""
    model = precision.prepare(models.build(req.spec, "meta"), precision.parse(tech.precision))
    with FakeTensorMode(allow_non_fake_inputs=True):
        models.to_empty(model, "cpu")
        step, model, opt, (x, y) = step_of(req, tech, "cpu", model=model)
        step(lambda _: None)  # optimizer state exists, as in every step but the first
        opt.zero_grad(set_to_none=True)
        mt = MemTracker()
        mt.track_external(model, opt, x, y)
        with mt:
            step(lambda _: None)
        snap = next(iter(mt.get_tracker_snapshot("peak").values()))
    theirs = dict.fromkeys(CATEGORIES, 0)
    for kind, b in snap.items():
        if kind in TOTALS:
            theirs[TOTALS[kind]] += b
    ours = account(req, tech)
    return {"model": req.model, "memtracker_peak": snap["Total"], "accountant_peak": ours.peak,
            "gap_pct": 100 * (ours.peak - snap["Total"]) / snap["Total"],
            **{f"memtracker_{c}": theirs[c] for c in CATEGORIES}, **{f"accountant_{c}": ours.at_peak[c] for c in CATEGORIES}}


# The families of docs/planner.md's table, small, each plain and with checkpointing where it has chains of blocks.
FAMILIES = {
    "residual CNN": Request("torchvision:resnet18", 8, (3, 64, 64), "adamw"),
    "depthwise + squeeze-excitation CNN": Request("torchvision:mobilenet_v3_small", 8, (3, 64, 64), "adamw"),
    "attention + embeddings": Request("lowmem.cli.examples:transformer", 8, (64,), "adamw", 1000),
    "recurrent (GRU)": Request("lowmem.cli.examples:gru", 8, (64,), "adamw", 1000),
    "recurrent (LSTM)": Request("lowmem.cli.examples:lstm", 8, (64,), "adamw", 1000),
    "1-d convolutions": Request("lowmem.cli.examples:conv1d", 8, (8, 256), "adamw"),
}


def table(families: list[str] | None = None) -> Any:
    """One row per family (``FAMILIES``, or those named) and checkpointing (none, sqrt), in MiB."""
    import pandas as pd

    rows = []
    for family, req in FAMILIES.items():
        if families is not None and family not in families:
            continue
        for ckpt in ("none", "sqrt"):
            if ckpt != "none" and not chains(models.build(req.spec, "meta")):
                continue
            r = memtracker(req, Techniques(checkpoint=ckpt))
            rows.append({"family": family, "checkpoint": ckpt, **{k: (v / 2**20 if isinstance(v, int) else v)
                                                                for k, v in r.items()}})
    return pd.DataFrame(rows)


CAPTION = ("The accountant against PyTorch's MemTracker (torch.distributed._tools.mem_tracker), one training step "
           "after a warm-up step, both on fake CPU tensors, AdamW; MiB. Peaks are totals; the categories are at each "
           "tool's own peak, MemTracker's under the accountant's names (lowmem.studies.crosscheck.TOTALS): MemTracker "
           "counts every live forward tensor as an activation and the optimizer step's temporaries as optimizer "
           "state, the accountant only tensors saved for backward, and the rest as other.")


# --- the DP checkpoint planner against PyTorch's SAC integer program ------------------------------------------


def _flops(func, args, kwargs):  # type: ignore[no-untyped-def]
    """A runtime estimate for PyTorch's estimators: the op's FLOPs (torch.utils.flop_counter's formulas), in MFLOP
    (sac_milp rounds its total to two decimals).
    Their own estimates need an accelerator (the roofline model asserts one) or time real kernels, so on the CPU
    both tools get the same FLOP count; ops without a formula (BatchNorm, activations, adds) cost nothing."""
    out = func(*args, **(kwargs or {}))
    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return out, 0.0
    shapes = pytree.tree_map(lambda t: t.shape if isinstance(t, torch.Tensor) else t, (args, kwargs or {}, out))
    return out, formula(*shapes[0], **shapes[1], out_val=shapes[2]) / 1e6


def sac_graph(req: Request) -> tuple[Any, list[str], int]:
    """(PyTorch's module graph for the SAC integer program, the fully qualified names of the chains' blocks, the
    graph's own peak without checkpointing): MemTracker, RuntimeEstimator and SACEstimator over one step (after a
    warm-up step), with FLOP-counted runtimes (``_flops``)."""
    model = models.build(req.spec, "meta")
    names = {id(m): n for n, m in model.named_modules()}
    top = type(model).__name__  # PyTorch's trackers name modules from the root's class
    blocks = [f"{top}.{names[id(chain)]}.{i}" for _, _, chain in chains(model) for i in range(len(chain))]
    with FakeTensorMode(allow_non_fake_inputs=True):
        models.to_empty(model, "cpu")
        step, model, opt, (x, y) = step_of(req, Techniques(), "cpu", model=model)
        step(lambda _: None)
        mt = MemTracker()
        mt.track_external(model, opt, x, y)
        with mt:
            step(lambda _: None)
        rt = RuntimeEstimator()
        rt._estimate, rt._estimate_mode_type = _flops, "FLOP count, MFLOP"  # in place of __call__'s two GPU modes
        with contextlib.redirect_stdout(io.StringIO()), rt:  # its exit prints a total
            step(lambda _: None)
        sac = SACEstimator()
        sac._estimate_runtime = _flops
        with sac:
            step(lambda _: None)
        # The SAC estimator fits each block's trade-off curve with pwlf, whose differential evolution draws from
        # NumPy's global generator: seeded here (and restored after), so the table is the same on every run.
        state = np.random.get_state()
        np.random.seed(0)
        try:
            info = aggregate_stats(model, mt, rt, sac, torch.device("cpu"))
        finally:
            np.random.set_state(state)
    # A module called twice in a forward pass (a torchvision Bottleneck's one ReLU, three times) is listed each time
    # in the execution orders, but its stats are one entry, which parse_module_info asserts; keep its first call.
    # Such modules are leaves, which the program never checkpoints.
    leaves = {f"{top}.{n}" if n else top for n, m in model.named_modules() if not any(True for _ in m.children())}
    for order in ("fw_pre_order", "fw_post_order"):
        names = info["mod_order"][order]  # type: ignore[literal-required]
        twice = {n for n in names if names.count(n) > 1}
        if not twice <= leaves:
            raise ValueError(f"modules {sorted(twice - leaves)} run twice in one forward pass and are not leaves; "
                             "PyTorch's SAC graph cannot place them")
        info["mod_order"][order] = list(dict.fromkeys(names))  # type: ignore[literal-required]
    graph = parse_module_info(info)
    return graph, blocks, get_peak_memory_runtime_baseline(graph)[0]


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


FREED = (0.1, 0.2, 0.3, 0.4, 0.5)  # the share of the chains' saved activations each planner is asked to free


def sac_ilp(req: Request, freed: tuple[float, ...] = FREED) -> list[dict[str, Any]]:
    """At equal budgets, the recompute of lowmem's DP planner (segments of whole blocks, ``checkpoint.frontier``)
    and of PyTorch's SAC integer program (``sac_ilp.sac_milp``: per block, a share of its activations discarded
    by recomputing ops), both choosing among the same units, the blocks of the model's chains, and both with
    FLOP-counted runtimes. A budget is each tool's own peak without checkpointing less the same bytes: a share of
    the chains' saved activations (the accountant's). The DP's placement is accounted on the real step too."""
    try:
        from torch.distributed._tools.sac_ilp import sac_milp  # needs pulp (and SACEstimator's fit, pwlf)
        import pwlf  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the SAC integer program needs pulp and pwlf ({e}); `make setup` installs both, pinned "
                          "in requirements-2.txt") from None
    graph, blocks, sac_peak = sac_graph(req)
    costs, lengths, _ = chain_costs(req, Techniques(), req.batch)
    chain_bytes = sum(c.saved_bytes for c in costs)
    plain = account(req).peak
    dp_front = checkpoint.frontier(costs, lengths)
    unplaced = checkpoint.modelled(costs, [(0, len(costs), False)])[0]
    rows = []
    for share in freed:
        free = int(share * chain_bytes)
        fits = [p for p in dp_front if unplaced - p[0] >= free]
        dp = min(fits, key=lambda p: (p[1], p[0])) if fits else None
        with _quiet("torch.distributed._tools.sac_ilp"):  # an infeasible budget is a NaN in the table, not a log line
            decisions, sac_rec, sac_bound = sac_milp(graph, memory_budget=(sac_peak - free) / 2**30, ac_units=blocks)
        rows.append({
            "model": req.model, "batch": req.batch, "freed_share": share, "freed_mib": free / 2**20,
            "dp_recompute_gflop": dp[1] / 1e9 if dp else math.nan,
            "dp_segments": sum(on for _, _, on in dp[2]) if dp else 0,
            "dp_accounted_freed_mib": (plain - account(req, segments=checkpoint.split(dp[2], lengths)).peak) / 2**20 if dp else math.nan,
            "sac_recompute_gflop": sac_rec / 1e3 if sac_bound >= 0 else math.nan,
            "sac_blocks": len(decisions), "sac_mean_discarded": sum(decisions.values()) / len(decisions) if decisions else 0.0,
        })
    return rows


def sac_table(requests: list[Request] | None = None) -> Any:
    """``sac_ilp``'s rows for ``requests`` (default: the planner stage's ``sac_models`` at the cpu profile, from
    params.yaml: one list of models for the stage and this command)."""
    import pandas as pd
    import yaml

    from lowmem.config import PARAMS_YAML, resolve

    if requests is None:
        all_params = yaml.safe_load(PARAMS_YAML.read_text())
        block = resolve("planner", {**all_params, "base": {**all_params["base"], "profile": "cpu"}})
        requests = [request(m) for m in block["sac_models"]]
    return pd.DataFrame([r for req in requests for r in sac_ilp(req)])


SAC_CAPTION = ("lowmem's DP checkpoint planner against PyTorch's SAC integer program (torch.distributed._tools.sac_ilp, "
               "CBC through pulp) at equal budgets: each tool's own peak without checkpointing less the same bytes, "
               "a share of the accountant's saved activations of the model's chains of blocks. Both choose among the "
               "same units (the blocks) and both count runtime as FLOPs (torch.utils.flop_counter; PyTorch's own "
               "runtime estimators need an accelerator), so ops without a FLOP formula (BatchNorm, activations, adds) "
               "recompute for free. Recompute in GFLOP per step. The budgets are equal in each tool's own model of "
               "the peak, which differ: the DP's counts what every block stores plus the largest segment's "
               "recomputed internals (a cautious bound: one checkpointed segment alone frees nothing in it); the "
               "ILP's frees a discarded block's activations from its forward until its own backward. The DP's "
               "placement is accounted on the real step (dp_accounted_freed_mib: the accountant's peak of the plain "
               "step less that of the placement); the ILP's is not applied. The DP recomputes whole segments of "
               "blocks; the ILP discards a share of each block's activations, cheapest first (sac_mean_discarded), "
               "and is solved to within 5% of its optimum (sac_milp's gapRel). Blank: no placement frees that much "
               "under the tool's own model.")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--table", type=Path, help="write the MemTracker table here as Markdown (and a CSV beside it)")
    ap.add_argument("--sac-table", type=Path, help="write the SAC integer program table here (and a CSV beside it)")


def run(a: argparse.Namespace) -> int:
    if not (a.table or a.sac_table):
        raise SystemExit("error: give --table, --sac-table or both")
    for out, make, caption in ((a.table, table, CAPTION), (a.sac_table, sac_table, SAC_CAPTION)):
        if out:
            t = make()
            t.to_csv(out.with_suffix(".csv"), index=False)
            out.write_text(caption + "\n\n" + t.round(2).to_markdown(index=False) + "\n")
    return 0


# --- FSDPMemTracker: the per-device account of a sharded step --------------------------------------------------


def fsdp_memtracker(req: Request) -> int:
    """The peak of one device's step of ``req`` (an FSDP2 mode, ``req.devices`` > 1) by PyTorch's FSDPMemTracker
    (``torch.distributed._tools.fsdp2_mem_tracker``), on fake CPU tensors with the fake process group, after one
    warm-up step (so the optimizer state exists, as in the accountant's step)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from lowmem.techniques import sharding

    shard = req.sharding
    if shard.mode not in sharding.FSDP_MODES or not shard.active:
        raise ValueError(f"FSDPMemTracker tracks FSDP2 modules: use devices > 1 and one of {sharding.FSDP_MODES}")
    model = models.build(req.spec, "meta")
    with FakeTensorMode(allow_non_fake_inputs=True), sharding.fake_group(shard.devices):
        models.to_empty(model, "cpu")
        step, model, opt, batch = step_of(req, Techniques(), "cpu", model=model)  # the step the accountant follows
        step(lambda _: None)
        opt.zero_grad(set_to_none=True)
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs(batch)
        with tracker:
            step(lambda _: None)
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def fsdp_table(requests: list[Request]) -> Any:
    """The accountant's per-device peak against FSDPMemTracker's, per request."""
    import pandas as pd

    rows = []
    for req in requests:
        ours, theirs = account(req).peak, fsdp_memtracker(req)
        rows.append({"model": req.model, "batch": req.batch, "devices": req.devices, "mode": req.shard,
                     "accountant_mib": ours / 2**20, "fsdpmemtracker_mib": theirs / 2**20,
                     "gap_pct": 100 * (ours - theirs) / theirs})
    return pd.DataFrame(rows)
