"""``lowmem plan``: which combinations of levers fit a memory budget for any model, and what each costs.

For every combination of precision x checkpointing x activation bits x optimizer state x step (plain or fused), the
largest microbatch whose step fits the budget is found by bisection over batch/1, batch/2, ... (the peak falls with
the microbatch; the fused step takes the whole batch only), each step accounted at full size on tensors without
values (``lowmem.cli.profile``). Of those that fit, the Pareto set is printed, each with how to apply it, over these
costs, and over being lossy at all and being fused (``pareto``):

- **peak bytes**, accounted;
- **recompute**: the forward FLOPs that checkpointing runs again, counted by ``torch.utils.flop_counter`` on meta,
  as a fraction of the plain step's FLOPs; the **time** column is that FLOP ratio (an estimate, labelled so: it
  leaves out microbatching's smaller kernels, packing's passes, and the fused step's one optimizer call per
  parameter in place of torch's multi-tensor kernels), or with ``--time`` the measured seconds per
  step against the plain step's on this machine;
- **quality risk**: ``exact`` for levers proven exact (checkpointing: tests/test_checkpoint.py; microbatching when
  the model has no BatchNorm: gradient accumulation of a mean loss), else the sum of the lossy levers' effects
  measured in this project, each labelled with the task and profile it was measured on, or ``unmeasured``.

The step lever fuses the optimizer step into backward (``lowmem.techniques.fused_step``: each parameter steps, and
its gradient is freed, as soon as its gradient is complete), exact by test (tests/test_fused_step.py). It applies
where nothing needs every gradient first: the whole batch (no accumulation), fp32 (no loss scaler), one device.
It lowers the peak only where the peak falls at the optimizer step (Adam's state beside every gradient, say), and
it rules out clipping by the global norm, so the plan counts it as a cost of its own.

The optimizer-state lever swaps the request's optimizer for its counterpart that keeps the same update with other
state (``STATE``): bitsandbytes' block-wise 8-bit state (heavy-ball SGD's momentum, AdamW's moments), or, under
16-bit weights, torch-optimi's SGD with Kahan summation (a 16-bit compensation buffer beside the momentum). For a
fairseq architecture the settings are the plugin's optimizers (``lowmem.cli.plan_fairseq``: 8-bit AdamW, and
torch-optimi's Kahan AdamW for lightconv under the plugin's bf16 weights).

Checkpointing cuts the model's chains of blocks (``lowmem.cli.profile.chains``) into segments placed by the DP
planner (``lowmem.techniques.checkpoint.frontier``, over every chain at once): the placement of least recompute that
frees what the step under the other levers lacks of the budget, checked by the accountant (``make_plan.placed``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

from lowmem.cli import hf, models, plan_fairseq, plan_output
from lowmem.cli.models import SpecError
from lowmem.cli.plan_rules import ROOT, first_fitting, measured_effects, risk
from lowmem.cli.profile import STEPS, Request, account, chain_costs, chains, step_of
from lowmem.memory.accounting import MemoryReport
from lowmem.techniques import checkpoint, fused_step
from lowmem.techniques.checkpoint import Segment
from lowmem.techniques.step import Techniques

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
PRECISIONS = ("fp32", "mixed-bf16", "half-bf16")
CHECKPOINTS = ("none", "planned")  # planned: the DP planner's placement for the budget (make_plan)
ACTIVATION_BITS = (0, 8, 2)
OPTIMIZER_STATE = ("given", "8-bit", "kahan")
# For each optimizer of the request that has one, its counterpart with other state, and the Python call that makes it
# (lowmem.techniques.optimizers). Kahan applies under half-bf16 only: with fp32 weights optimi's SGD compensates nothing.
STATE: dict[str, dict[str, tuple[str, str]]] = {
    "8-bit": {"sgd-momentum": ("bnb-sgd8bit", "bitsandbytes.optim.SGD8bit(params, lr, momentum=0.9)"),
              "adamw": ("adamw-8bit", "bitsandbytes.optim.AdamW8bit(params)")},
    "kahan": {"sgd-momentum": ("optimi-sgd", "optimi.SGD(params, lr, momentum=0.9, kahan_sum=True)")},
}
MICROBATCH_STEPS = 6  # microbatches tried: the whole batch, then halves down to 1 example or this many halvings


def budget_bytes(text: str) -> int:
    """'2GiB' -> 2147483648; units KiB/MiB/GiB/TiB (powers of 2) and KB/MB/GB/TB (powers of 10), or B."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)\s*", text)
    if not m or m.group(2) not in UNITS:
        raise SpecError(f"budget {text!r} is not a number with a unit: one of {', '.join(UNITS)} (e.g. 4GiB, 512MiB, 1.5GB)")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def microbatches(batch: int, steps: int = MICROBATCH_STEPS) -> list[int]:
    """0 (the whole batch), then batch/2, batch/4, ... while they divide the batch, at most ``steps`` in all."""
    out, b = [0], batch
    while b % 2 == 0 and b > 1 and len(out) < steps:
        b //= 2
        out.append(b)
    return out


@dataclass(frozen=True)
class Levers:
    """The settings the plan combines (every combination is accounted)."""

    precision: tuple[str, ...] = PRECISIONS
    checkpoint: tuple[str, ...] = CHECKPOINTS
    activation_bits: tuple[int, ...] = ACTIVATION_BITS
    optimizer_state: tuple[str, ...] = OPTIMIZER_STATE
    step: tuple[str, ...] = STEPS  # the optimizer step after backward, or fused into it
    microbatch_steps: int = MICROBATCH_STEPS


def optimizer_for(req: Request, state: str, precision: str) -> str | None:
    """The optimizer a row with optimizer state ``state`` steps with: the request's own (``given``), its counterpart
    in ``STATE``, or None where it has none (Kahan: none but under half-bf16; none over several devices)."""
    if state == "given":
        return req.optimizer
    if req.devices > 1:
        return None  # bitsandbytes' kernels take no DTensors (FSDP2), and the swaps are not accounted sharded
    if state == "kahan" and precision != "half-bf16":
        return None
    return STATE[state][req.optimizer][0] if req.optimizer in STATE[state] else None


def no_state(req: Request, states: tuple[str, ...]) -> str:
    """Why ``states`` give ``req`` nothing to plan: which optimizers each state has a counterpart for."""
    have = "; ".join(f"{s} for {', '.join(STATE[s])}" + (" (under half-bf16)" if s == "kahan" else "") for s in STATE)
    return (f"--optimizer-state {' '.join(states)} has no setting for --optimizer {req.optimizer}: the states other than "
            f"'given' have counterparts {have} only; add 'given'")


def grid(req: Request, has_chains: bool, levers: Levers = Levers(), layers: bool = False) -> list[tuple[Techniques, bool, str]]:
    """Every combination of ``levers`` (the microbatches: ``microbatches``), as (techniques, whether the checkpoint
    placement is planned, the optimizer); an optimizer state the request's optimizer has no counterpart for is left
    out. ``layers``: a transformers model, whose checkpointing is transformers' own, every layer
    (``checkpoint='block'``), not a placement."""
    if not set(levers.checkpoint) <= set(CHECKPOINTS):
        raise ValueError(f"checkpoint levers {levers.checkpoint} must be among {CHECKPOINTS}")
    if not set(levers.optimizer_state) <= set(OPTIMIZER_STATE):
        raise ValueError(f"optimizer_state levers {levers.optimizer_state} must be among {OPTIMIZER_STATE}")
    out = []
    for p, c, b, a, s in itertools.product(levers.precision, levers.checkpoint if has_chains or layers else ("none",),
                                           microbatches(req.device_batch, levers.microbatch_steps), levers.activation_bits,
                                           levers.optimizer_state):
        opt = optimizer_for(req, s, p)
        if opt is not None:
            ckpt = "block" if layers and c == "planned" else "none"
            out.append((Techniques(precision=p, microbatch=b, activation_bits=a, checkpoint=ckpt), c == "planned" and not layers, opt))
    return out


# --- recompute ---------------------------------------------------------------------------------------------------


def followed(req: Request, tech: Techniques, segments: list[list[Segment]] | None = None) -> MemoryReport:
    """``req``'s step under ``tech`` accounted, a long accumulation followed over its first three microbatches (the
    rest repeat the second's memory, as ``lowmem.wrn.memory`` explains)."""
    b = tech.microbatch
    return account(req, tech, examples=3 * b if b and req.device_batch // b > 3 else None, segments=segments)


def one_device(req: Request) -> Request:
    """The step one device of ``req`` computes, on its own: its share of the batch, without the sharding wrappers
    (FLOPs and compute time do not depend on them)."""
    return dataclasses.replace(req, batch=req.device_batch, devices=1, shard="replicate")


def step_flops(req: Request, checkpoint: str) -> int:
    """FLOPs of one device's fp32 step with ``checkpoint`` (torch.utils.flop_counter, on meta)."""
    step, *_ = step_of(one_device(req), Techniques(checkpoint=checkpoint), "meta")
    with FlopCounterMode(display=False) as counter:
        step(lambda _: None)
    return counter.get_total_flops()


def step_seconds(req: Request, tech: Techniques, segments: list[list[Segment]] | None = None, repeats: int = 2) -> float:
    """Median seconds of one device's real step on the CPU, after a warm-up step (without communication)."""
    step, *_ = step_of(one_device(req), tech, "cpu", segments=segments)
    step(lambda _: None)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(lambda _: None)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# --- the plan ----------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    budget: int
    rows: pd.DataFrame  # every accounted configuration
    fitting: pd.DataFrame  # the Pareto set of those that fit
    timed: bool


def fusable(req: Request, tech: Techniques) -> bool:
    """Whether the fused step can take ``tech``'s step of ``req``, by the same rules that refuse it in ``lowmem
    profile``: ``Request``'s (one device, a torch model) and ``fused_step.check``'s (whole batch, fp32)."""
    try:
        dataclasses.replace(req, step="fused")
        fused_step.check(tech.microbatch, tech.precision)
    except (SpecError, ValueError):
        return False
    return True


def how_to_apply(tech: Techniques, segments: list[list[Segment]] | None = None, state: str = "given",
                 optimizer: str = "", step: str = "plain") -> str:
    fields = {f.name: getattr(tech, f.name) for f in dataclasses.fields(tech)
              if f.name in ("precision", "microbatch", "checkpoint", "activation_bits")
              and getattr(tech, f.name) != getattr(Techniques(), f.name)}
    layers = fields.pop("checkpoint", None) == "block"  # only a transformers model's rows: grid(layers=True)
    call = "Techniques(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"
    if layers:
        call += f", {hf.CHECKPOINT_CALL}"
    if segments:  # (first block, end block, recomputed) per segment, per chain of lowmem.cli.profile.chains
        call += f" with lowmem.cli.profile.checkpoint_chains(model, segments={segments!r})"
    if state != "given":
        call += f", optimizer {STATE[state][optimizer][1]} in place of {optimizer}"
    if step == "fused":
        call += ", the optimizer stepped inside backward: lowmem.techniques.fused_step.FusedOptimizer(model.parameters(), make) with make(ps) your optimizer over ps"
    return call


def pareto(df: pd.DataFrame) -> pd.Series:
    """True where no other row is at least as good in peak, time, quality risk, exactness and freedom of the training
    loop, and better in one (a fused step rules out gradient clipping by the global norm: a fused row stays only
    where it lowers the peak)."""
    fused = (df["step"] == "fused") if "step" in df else pd.Series(False, index=df.index)
    pts = df[["peak_bytes", "time", "risk_key", "lossy"]].assign(fused=fused.astype(float)).to_numpy(dtype=float)
    return pd.Series([not any((q <= p).all() and (q < p).any() for j, q in enumerate(pts) if j != i)
                      for i, p in enumerate(pts)], index=df.index)


def make_plan(req: Request, budget: int, time_steps: bool = False, exact_only: bool = False,
              max_loss: float | None = None, progress: bool = True, root: Path = ROOT, levers: Levers = Levers(),
              cache: dict[Any, dict[str, Any]] | None = None) -> Plan:
    """Accounts the grid for ``req``, keeps what fits ``budget`` bytes (and the quality filters), and its Pareto set.
    Raises SpecError, naming the smallest peak reachable, when nothing fits. ``cache``: accounted configurations
    shared between plans of the same ``req`` at several budgets."""
    if req.spec.kind == "fairseq":
        if time_steps:
            raise SpecError("--time is not available for a fairseq architecture (its update needs a dataset); the time column is the FLOP ratio")
        if req.devices > 1:
            raise SpecError("lowmem plan searches a fairseq model's flags for one device; account its per-device peak "
                            "with lowmem profile fairseq:ARCH ... --devices N --shard MODE")
        if "plain" not in levers.step:
            raise SpecError("a fairseq architecture takes fairseq-train's own step, after backward: add --step plain")
        return _choose(pd.DataFrame(plan_fairseq.rows(req, budget, progress, root, levers.optimizer_state)), budget,
                       exact_only, max_loss)
    req = dataclasses.replace(req, step="plain")  # the reference step; the step lever says which steps are tried
    cache = {} if cache is None else cache
    if cache.setdefault("for", (req, root)) != (req, root):
        raise ValueError(f"this cache holds the accounts of {cache['for'][0]}, not of {req}")
    model = models.build(req.spec, "meta")
    has_chains = bool(chains(model))
    layers = not has_chains and hf.is_hf(model)
    has_bn = any(isinstance(m, _BatchNorm) for m in model.modules())
    # The effects were measured on WRN and DynamicConv: a language model's lossy levers are not measured here.
    effects = {} if hf.is_hf(model) else measured_effects(root)
    if "flops" not in cache:
        cache["flops"] = step_flops(req, "none")
    flops = cache["flops"]

    def row(tech: Techniques, opt: str, step: str, segments: list[list[Segment]] | None = None, recompute: int = 0
            ) -> dict[str, Any]:
        key = (tech, opt, step, repr(segments))
        if tech.checkpoint == "block":  # transformers' every layer: the recomputed forward, the same at any microbatch
            if "flops_layers" not in cache:
                cache["flops_layers"] = step_flops(req, "block") - flops
            recompute = cache["flops_layers"]
        if key not in cache:
            b, B = tech.microbatch, req.device_batch
            r = followed(dataclasses.replace(req, optimizer=opt, step=step), tech, segments)
            # Over several devices each normalizes over its own share, as a microbatch does: per-device BatchNorm
            # is the microbatch lever at the device's batch (SyncBatchNorm would be exact, and is not run here).
            per_device = req.devices > 1 and has_bn and not tech.microbatch
            # A swapped optimizer carries its measured effect; the user's own carries none (it is the reference).
            change, low, label = risk(dataclasses.replace(tech, microbatch=req.device_batch) if per_device else tech, has_bn,
                                      effects, opt if opt != req.optimizer else None)
            state = next((s for s in STATE if STATE[s].get(req.optimizer, ("",))[0] == opt), "given")
            if per_device:
                label = f"BatchNorm per device over {req.device_batch} examples, as microbatch={req.device_batch}: {label}"
            cache[key] = {"precision": tech.precision, "checkpoint": "planned" if segments else ("layers" if tech.checkpoint == "block" else "none"), "microbatch": b or B,
                          "optimizer": opt, "step": step,
                          "activation_bits": tech.activation_bits or (32 if tech.precision == "fp32" else 16),
                          "peak_bytes": r.peak, "peak_phase": r.peak_phase, "recompute": recompute / flops,
                          "time": 1 + recompute / flops,
                          "time_source": "estimated (FLOP ratio" + ("; not the fused step's per-parameter calls)" if step == "fused" else ")"),
                          "predicted_change": change, "predicted_low": low, "quality_risk": label,
                          "how_to_apply": how_to_apply(tech, segments, state, req.optimizer, step), "tech": tech,
                          "levers": plan_output.levers(tech, segments, opt, req.optimizer, step),
                          "segments": segments}
        return cache[key]

    def placed(tech: Techniques, opt: str, step: str) -> dict[str, Any]:
        """The checkpoint placement that fits with the least recompute, among the DP planner's memory-recompute
        front (lowmem.techniques.checkpoint.frontier), by the accountant. The planner's model of the peak is not
        the accountant's, so the front (recompute rising, modelled peak falling) is bisected on accounted peaks:
        the least recompute that fits where accounted peaks fall along the front too (tests/test_cli.py checks every
        point of one model's front), not a proof for every model. The block costs are those of the forward pass
        in the configuration's precision, without packed activations (the accountant then counts the packing)."""
        plain = row(tech, opt, step)
        if plain["peak_bytes"] <= budget:
            return plain  # nothing to place
        mb = tech.microbatch or req.device_batch
        ckey = ("costs", tech.precision, mb)
        if ckey not in cache:
            cache[ckey] = chain_costs(req, tech, mb)
        costs, lengths, _ = cache[ckey]
        front = [p for p in checkpoint.frontier(costs, lengths) if p[1] > 0]

        def at(i: int) -> dict[str, Any]:
            return row(tech, opt, step, checkpoint.split(front[i][2], lengths), front[i][1] * (req.device_batch // mb))

        first = first_fitting(len(front), lambda i: at(i)["peak_bytes"] <= budget)
        return at(len(front) - 1 if first is None else first)  # if none fits, the least memory the planner reaches

    # Per setting of the other levers, the largest microbatch that fits (microbatching costs time the FLOP ratio
    # does not see, so no smaller one is offered), found by bisection: the peak falls with the microbatch.
    rows: list[dict[str, Any]] = []
    sizes = microbatches(req.device_batch, levers.microbatch_steps)
    bases = grid(req, has_chains, dataclasses.replace(levers, microbatch_steps=1), layers)
    if not bases:
        raise SpecError(no_state(req, levers.optimizer_state))
    if not set(levers.step) <= set(STEPS):
        raise SpecError(f"step levers {levers.step} must be among {STEPS}")
    # The fused step takes the whole batch only: its settings are the plain ones at microbatch 0 that it can take.
    settings = [(base, planned, opt, step) for base, planned, opt in bases for step in levers.step
                if step == "plain" or fusable(req, base)]
    if not settings:
        raise SpecError(f"--step {' '.join(levers.step)}: the fused step needs one device and an fp32 setting "
                        "at the whole batch; add --step plain")
    for base, planned, opt, step in tqdm(settings, desc="accounting the levers", disable=None if progress else True,
                                         mininterval=5):
        seen: dict[int, dict[str, Any]] = {}

        def fits(i: int) -> bool:
            if i not in seen:
                tech = dataclasses.replace(base, microbatch=sizes[i])
                seen[i] = dict(placed(tech, opt, step) if planned else row(tech, opt, step))
                rows.append(seen[i])
            return seen[i]["peak_bytes"] <= budget

        # sizes[] run from the whole batch down; a fused step cannot accumulate microbatches, so it has only the first
        first = first_fitting(1 if step == "fused" else len(sizes), fits)
        if first is not None:
            seen[first]["largest_fitting"] = True
    df = pd.DataFrame(rows)
    # A placement at a size where the plain step fits is the plain step: one row.
    df = df.loc[~df.drop(columns=["tech", "segments"]).astype(str).duplicated()]
    plan = _choose(df, budget, exact_only, max_loss)
    if time_steps:
        base_s = step_seconds(req, Techniques())
        plan.fitting["time"] = [step_seconds(dataclasses.replace(req, optimizer=o, step=st), t, seg) / base_s
                                for t, seg, o, st in zip(plan.fitting.tech, plan.fitting.segments, plan.fitting.optimizer,
                                                         plan.fitting.step)]
        plan.fitting["time_source"] = "measured (CPU, against the plain step)"
        plan.timed = True
    return plan


def _choose(df: pd.DataFrame, budget: int, exact_only: bool, max_loss: float | None) -> Plan:
    """The plan of accounted rows ``df``: those marked largest_fitting, filtered, and their Pareto set."""
    # Exact first, then the smallest predicted loss; an unmeasured lever ranks below every measured one.
    # Ranked by the low end of the measured interval (a gain is not credited); whether a lever is lossy at all is a
    # cost of its own, so a measured lever never stands for one proven exact.
    df["risk_key"] = df.predicted_low.map(lambda c: math.inf if math.isnan(c) else max(-c, 0.0))
    df["lossy"] = (df.quality_risk != "exact").astype(float)
    ok = df[df.get("largest_fitting", pd.Series(False, index=df.index)).fillna(False).astype(bool)]
    if exact_only:
        ok = ok[ok.quality_risk == "exact"]
    if max_loss is not None:  # by the interval's low end; an unmeasured lever's loss is unknown, so it does not pass
        ok = ok[ok.predicted_low >= -max_loss]
    if ok.empty:
        best = df.sort_values("peak_bytes").iloc[0]
        raise SpecError(f"no configuration fits {budget / 2**30:.3f} GiB{' with the filters given' if len(df[df.peak_bytes <= budget]) else ''}: "
                        f"the smallest peak is {best.peak_bytes / 2**30:.3f} GiB, with {best['levers']} ({best['how_to_apply']})")
    front = ok[pareto(ok)].copy()
    return Plan(budget, df, front.sort_values(["peak_bytes"]).reset_index(drop=True), False)
