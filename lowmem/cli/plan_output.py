"""What ``lowmem plan`` prints: the Pareto set as a table that fits a terminal (one row per point: peak, the levers by
short name, time, and the risk in a word), one row in full (``--explain N``: each lossy lever's measured effect and
where it was measured, and the Python that applies it), and JSON for machines (``--json``)."""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from lowmem.cli import hf
from lowmem.cli.profile import Request
from lowmem.techniques.checkpoint import Segment
from lowmem.techniques.step import Techniques

WIDTH = 120  # the widest line of the default output


def levers(tech: Techniques, segments: list[list[Segment]] | None, optimizer: str, given: str, step: str) -> str:
    """A torch row's levers by short name, joined by '+': 'plain' when none is on."""
    names = [tech.precision] if tech.precision != "fp32" else []
    names += [f"microbatch-{tech.microbatch}"] if tech.microbatch else []
    # the placement planned for the budget (--explain shows it), or a transformers model's every layer
    names += ["checkpoint"] if segments or tech.checkpoint != "none" else []
    names += [f"activations-{tech.activation_bits}"] if tech.activation_bits else []
    names += [optimizer] if optimizer != given else []
    names += ["fused-step"] if step == "fused" else []
    return "+".join(names) or "plain"


def fairseq_levers(precision: list[str], checkpoint: list[str], microbatch: list[str], optimizer: list[str]) -> str:
    """A fairseq row's levers by short name: the flags' values ('half-bf16', 'update-freq-4', 'lowmem_adamw8bit')."""
    names = [precision[-1].removeprefix("--")] if precision else []
    names += ["checkpoint"] if checkpoint else []
    names += [f"update-freq-{microbatch[1]}"] if microbatch and microbatch[0] == "--update-freq" else []
    names += [optimizer[-1]] if optimizer else []
    return "+".join(names) or "plain"


def risk_word(row: Any) -> str:
    """'exact'; 'lossy' with the low end of the summed 95% intervals (the worst the measurements allow); or
    'unmeasured' (a lossy lever this project has not measured)."""
    if row.quality_risk == "exact":
        return "exact"
    return "unmeasured" if math.isnan(row.predicted_low) else f"lossy {row.predicted_low:+.2f}"


def table(fitting: pd.DataFrame) -> str:
    """The Pareto set, one row per point, numbered for ``--explain``."""
    gib = fitting.peak_bytes.max() >= 2**30  # one unit for the column, the one its largest value reads best in
    peak = [f"{b / 2**30:,.3f}" if gib else f"{b / 2**20:,.1f}" for b in fitting.peak_bytes]
    t = pd.DataFrame({"#": range(1, len(fitting) + 1), f"peak ({'GiB' if gib else 'MiB'})": peak,
                      "levers": fitting.levers.to_numpy(), "time": [f"{x:.2f}x" for x in fitting.time],
                      "risk": [risk_word(r) for r in fitting.itertuples()]})
    return t.to_markdown(index=False, colalign=("right", "right", "left", "right", "left"), disable_numparse=True)


def explain(fitting: pd.DataFrame, n: int, req: Request, budget: int) -> str:
    """Row ``n`` (from 1) in full. ValueError listing the valid rows otherwise."""
    if not 1 <= n <= len(fitting):
        raise ValueError(f"--explain {n}: the plan has rows 1 to {len(fitting)}")
    r = fitting.iloc[n - 1]
    lines = [f"Row {n} of {len(fitting)}: {r.levers}",
             f"peak: {r.peak_bytes / 2**30:.3f} GiB in the {r.peak_phase} phase (budget {budget / 2**30:.3f} GiB)",
             f"time: {r.time:.2f}x the plain step's, {r.time_source}; recompute {r.recompute:.2f} of the plain step's FLOPs",
             "quality risk:"]
    if r.quality_risk == "exact":
        lines.append("  exact: every lever on is proven equal to the plain step by test")
    else:
        lines.append("  each lossy lever as measured in this project, on the task and profile named, never on your model:")
        lines += [f"  - {part}" for part in r.quality_risk.split("; ")]
    lines += ["how to apply it:", *("    " + line for line in how_to_apply(r, req).splitlines())]
    return "\n".join(lines)


def how_to_apply(row: Any, req: Request) -> str:
    """The Python that applies a torch row to ``model`` and trains on ``batches``, with the project's step (the one
    the plan accounted); a fairseq row's command line."""
    if row.tech is None:
        return row.how_to_apply
    tech: Techniques = row.tech
    half = tech.precision.startswith("half")
    fields = ", ".join(f"{k}={getattr(tech, k)!r}" for k in ("precision", "microbatch", "activation_bits")
                       if getattr(tech, k) != getattr(Techniques(), k))
    code = ["from lowmem.cli import profile", "from lowmem.techniques import precision",
            "from lowmem.techniques.step import Techniques, train_step", "",
            f"tech = Techniques({fields})", "prec = precision.parse(tech.precision)"]
    code += ["model = precision.prepare(model, prec)  # weights and buffers in 16 bits"] if half else []
    code += [f"profile.checkpoint_chains(model, segments={row.segments!r})"] if row.segments else []
    code += [hf.CHECKPOINT_CALL] \
        if tech.checkpoint == "block" else []  # a transformers model's rows (lowmem.cli.plan.grid)
    fused = ", fused=True" if row.step == "fused" else ""
    why = ("  # stepped inside backward" if fused else "") + \
        (f"  # in place of {req.optimizer}" if row.optimizer != req.optimizer else "")
    code += [f"optimizer = profile.make_optimizer({row.optimizer!r}, model{fused}){why}",
             "scaler = precision.make_scaler(prec, 'cuda')  # the device type you train on" if tech.precision != "fp32"
             else "scaler = None  # fp32: no loss scaling",
             "for x, y in batches:"]
    code += ["    x = precision.cast_batch(x, prec)"] if half else []
    code += ["    train_step(model, optimizer, x, y, tech, scaler=scaler)"]
    return "\n".join(code)


def as_json(fitting: pd.DataFrame, req: Request, budget: int) -> str:
    """The Pareto set for machines: every column but the Python objects, and the Python to apply each row."""
    rows = []
    for i in range(len(fitting)):
        r = fitting.iloc[i]
        row = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()
               if k not in ("tech", "segments") and not k.startswith("risk_")}
        row |= {"row": i + 1, "risk": risk_word(r), "segments": r.segments, "how_to_apply": how_to_apply(r, req)}
        rows.append(row)
    return json.dumps({"model": req.model, "batch": req.batch, "optimizer": req.optimizer, "budget_bytes": budget,
                       "rows": rows}, indent=2, default=_plain)


def _plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else str(v)
