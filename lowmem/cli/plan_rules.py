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

import pandas as pd

from lowmem.techniques import precision
from lowmem.techniques.step import Techniques

ROOT = Path(__file__).parents[2]  # the checkout, whose figures/ hold the measured effects


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
    """(lever, setting) -> {change, low, high, n, where} from the committed results: WRN's lossy levers alone
    (figures/09_wrn_levers.csv, stage combinations), the compressed activations and Kahan's bf16
    (metrics/levers_train.json), and 8-bit momentum (metrics/levers_state_train.json)."""
    # seaborn and scipy come with these: kept off the CLI's import path, which needs them only here
    from lowmem.studies.frontier import beyond_rows
    from lowmem.studies.quality_model import arm_change

    effects: dict[tuple[str, Any], dict[str, Any]] = {}
    levers = root / "figures" / "09_wrn_levers.csv"
    combos = root / "metrics" / "combinations.json"
    where = "WRN accuracy points"
    if combos.exists():
        where += f", profile {json.loads(combos.read_text())['profile'].get('wrn', '?')}"
    if levers.exists():
        for r in pd.read_csv(levers).itertuples():
            key = _lever(r.name)
            if key:
                effects[key] = {"change": r.quality_change, "low": r.quality_low, "high": r.quality_high,
                                "n": int(r.quality_n), "where": where}
    for r in beyond_rows(root / "metrics").itertuples():
        tech = json.loads(r.config)
        if set(tech) == {"activation_bits"}:  # the lever alone, against the baseline trained beside it
            effects[("activation_bits", tech["activation_bits"])] = {
                "change": r.quality_change, "low": r.quality_low, "high": r.quality_high, "n": int(r.quality_n),
                "where": f"WRN accuracy points, profile {r.profile}"}
    # The optimizer swaps, each against the same update with fp32 state (what the swap changes), paired by seed.
    for stage, arm, against, key in (("levers_train", "half-bf16+optimi-sgd", "optimi-sgd", ("precision", "half-bf16+kahan")),
                                     ("levers_state_train", "bnb-sgd8bit", "optimi-sgd", ("optimizer", "bnb-sgd8bit"))):
        path = root / "metrics" / f"{stage}.json"
        if path.exists():
            res = json.loads(path.read_text())
            if {arm, against} <= set(res["arms"]):
                c = arm_change(res, arm, against)
                effects[key] = {"change": c.mean, "low": c.low, "high": c.high, "n": c.n,
                                "where": f"WRN accuracy points against {against} in fp32, profile {res['profile']}"}
    return effects


def _lever(name: str) -> tuple[str, Any] | None:
    if name.startswith("microbatch-"):
        return ("microbatch", int(name.split("-")[1]))
    if name in precision.MODES:
        return ("precision", name)
    return None


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
