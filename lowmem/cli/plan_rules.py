"""The planners' rules (``lowmem.cli.plan`` for torch models, ``lowmem.cli.plan_fairseq`` for fairseq architectures):
the quality risk of a row, from what this project measured of each lossy lever and how those effects add up, and the
search for the first setting that fits."""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowmem.techniques.step import Techniques

ROOT = Path(__file__).parents[2]  # the checkout, whose metrics/ hold the measured effects
EFFECTS = "metrics/lever_effects.json"  # written by stage lever_effects


def combine(lossy: list[tuple[str, dict[str, Any] | None]]) -> tuple[float, float, str]:
    """(sum of the effects, sum of their intervals' low ends, a label naming each with its interval, task and
    seeds); NaN where one is unmeasured. The low end is what the plan ranks by: a lever measured as +0.01
    [-1.79, +1.80] is not as safe as one proven exact."""
    if not lossy:
        return 0.0, 0.0, "exact"
    total, low, parts = 0.0, 0.0, []
    for label, e in lossy:
        if e is None:
            total = low = math.nan
            parts.append(f"{label}: unmeasured")
        else:
            total, low = total + e["change"], low + e["low"]
            seeds = f", {e['n']} seeds" if "n" in e else ""
            parts.append(f"{label}: {e['change']:+.2f} [{e['low']:+.2f}, {e['high']:+.2f}] ({e['where']}{seeds})")
    return total, low, "; ".join(parts)


def first_fitting(n: int, fits: Callable[[int], bool]) -> int | None:
    """The first of indices 0..n-1 where ``fits`` (false, then true, along them), or None when the last does not fit.
    The last is asked first: where nothing fits, one account answers."""
    if not fits(n - 1):
        return None
    return bisect.bisect_left(range(n - 1), True, key=fits)


def measured_effects(root: Path = ROOT) -> dict[tuple[str, Any], dict[str, Any]]:
    """(lever, setting) -> {change, low, high, n, where}: what the studies measured of WRN's lossy levers, from the
    one file they write for the planner (``lowmem.studies.lever_effects``); none where it is missing."""
    return {(e["lever"], e["setting"]): {k: v for k, v in e.items() if k not in ("lever", "setting")}
            for e in read_effects(root)["wrn"]}


def read_effects(root: Path) -> dict[str, list[dict[str, Any]]]:
    path = root / EFFECTS
    return json.loads(path.read_text()) if path.exists() else {"wrn": [], "fairseq": []}


def risk(tech: Techniques, has_batchnorm: bool, effects: dict[tuple[str, Any], dict[str, Any]],
         optimizer: str | None = None) -> tuple[float, float, str]:
    """(predicted change, its low end, its label): 0 and 'exact' when every lever on is exact; else ``combine`` of
    the lossy levers' measured effects. ``optimizer``: the row's, where the optimizer-state lever swapped it (Kahan
    is measured together with the 16-bit weights it compensates, so it replaces the precision's effect)."""
    lossy = []
    if optimizer == "optimi-sgd" and tech.precision == "half-bf16":
        lossy.append(("precision", "half-bf16+kahan"))
    elif tech.precision != "fp32":
        lossy.append(("precision", tech.precision))
    if optimizer in ("bnb-sgd8bit", "adamw-8bit"):
        lossy.append(("optimizer", optimizer))
    if tech.microbatch and has_batchnorm:
        lossy.append(("microbatch", tech.microbatch))
    if tech.activation_bits:
        lossy.append(("activation_bits", tech.activation_bits))
    return combine([(f"{k}={v}", effects.get((k, v))) for k, v in lossy])
