"""The two rules both planners share (``lowmem.cli.plan`` for torch models, ``lowmem.cli.plan_fairseq`` for fairseq
architectures): how lossy levers' measured effects add up, and the search for the first setting that fits."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any


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
