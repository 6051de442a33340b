"""How a quality number is known, and what its interval can resolve: the words of every headline and budget row.

A row's quality is one of:
- **measured**: its own runs, paired with the baseline (seeds, or one seed with the seed-widened bootstrap);
- **exact by test**: it differs from the baseline only by a lever a test proves bit-equal (checkpointing), so its
  change is the baseline compared with itself;
- **equal up to dropout draws**: it differs from the baseline only by a lever whose gradient a test proves equal to
  the plain step's with dropout off (DynamicConv's exact microbatching), and exact ones; with dropout on, the masks
  are other draws, so its change is zero with two seeds' noise as its interval;
- **carried**: it differs from a trained run only by such levers, and takes that run's quality (named).

``quality_from`` (``frontier.results``) says where a row's quality comes from; this module turns it into those
words. Neither decision rule changes here (``quality.RULES``): ``verdict`` only says where the data cannot carry the
mean rule's "within budget", its interval being wider than twice the budget.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import pandas as pd

EXACT_TWIN = re.compile(r"^(?P<how>exact|equal up to dropout draws), by test (?P<tests>.+): (?P<twin>.+?)'s runs?$")
DROPOUT = "equal up to dropout draws"


def kind(quality_from: str) -> str:
    """``measured``, ``exact by test``, ``equal up to dropout draws`` (``DROPOUT``), ``carried`` or ``not trained``."""
    if not isinstance(quality_from, str) or not quality_from:
        return "not trained"
    m = EXACT_TWIN.match(quality_from)
    if m is None:
        return "measured"
    if m["twin"] != "baseline":
        return "carried"
    return "exact by test" if m["how"] == "exact" else DROPOUT


def detail(quality_from: str, n: float, sources: Mapping[str, str], widened: bool = False) -> str:
    """The row's ``kind`` in a sentence: its seeds and stage, the test that makes it exact, the run it carries and
    where that run comes from (``sources``: a configuration's name -> its own ``quality_from``)."""
    k = kind(quality_from)
    if k == "not trained":
        return k
    seeds = "1 seed, paired bootstrap widened by the seed sd" if widened and n == 1 else (
        "1 seed, paired bootstrap" if n == 1 else f"{int(n)} seeds")
    if k == "measured":
        return f"measured, {seeds} ({quality_from})"
    m = EXACT_TWIN.match(quality_from)
    assert m is not None
    if k == "exact by test":
        return f"exact by test ({m['tests']}): the baseline's own runs, compared with themselves"
    if k == DROPOUT:
        return (f"equal up to dropout draws by test ({m['tests']}): the baseline's own update, its interval two "
                "seeds' noise")
    differ = ("the lever that differs is exact by test" if m["how"] == "exact"
              else "the levers that differ are equal up to dropout draws or exact by test")
    return f"carried from {m['twin']}'s run ({sources.get(m['twin'], 'source not recorded')}; {seeds}); {differ} ({m['tests']})"


def tests_of(quality_from: str) -> str:
    """The test(s) that make an exact or carried row's quality its twin's ("" for a measured row)."""
    m = EXACT_TWIN.match(quality_from) if isinstance(quality_from, str) else None
    return m["tests"] if m else ""


def twin_of(quality_from: str) -> str:
    """The configuration whose run an exact or carried row takes its quality from ("" for a measured row)."""
    m = EXACT_TWIN.match(quality_from) if isinstance(quality_from, str) else None
    return m["twin"] if m else ""


def half_width(low: float, high: float) -> float:
    return (high - low) / 2 if not (math.isnan(low) or math.isnan(high)) else math.nan


def resolution(quality_from: str, low: float, high: float) -> str:
    """``exact`` for the baseline against itself, else the interval's measured half-width (``±h``), or ``no
    interval``."""
    if kind(quality_from) == "exact by test":
        return "exact"
    h = half_width(low, high)
    return "no interval" if math.isnan(h) else f"±{h:.2f}"


def resolved(low: float, high: float, budget: float) -> bool:
    """Whether the interval is at most twice the budget wide: narrower data can tell a change of the budget's size
    from none; wider cannot."""
    return not math.isnan(low) and not math.isnan(high) and high - low <= 2 * budget


def verdict(rule: str, quality_from: str, low: float, high: float, budget: float) -> str:
    """What a row within budget by ``rule`` can claim: ``within budget``, or for the mean rule, ``within budget;
    not resolved`` where the interval is wider than twice the budget (or missing). Exact rows are resolved."""
    if rule == "mean" and kind(quality_from) != "exact by test" and not resolved(low, high, budget):
        return "within budget; not resolved"
    return "within budget"


def columns(rows: pd.DataFrame, sources: Mapping[str, str], widened: bool, names: Mapping[str, str] | None = None) -> pd.DataFrame:
    """``how_known``, ``known_detail``, ``resolution`` and ``verdict`` for each row of a budget or comparison table.
    ``names`` maps this module's column names (quality_from, quality_low, quality_high, quality_n, budget, rule) to
    the table's own."""
    c = {k: k for k in ("quality_from", "quality_low", "quality_high", "quality_n", "budget", "rule")} | dict(names or {})
    out = []
    for _, r in rows.iterrows():
        q = r[c["quality_from"]] if isinstance(r[c["quality_from"]], str) else ""
        lo, hi, n = (float(r[c[k]]) if pd.notna(r[c[k]]) else math.nan for k in ("quality_low", "quality_high", "quality_n"))
        out.append({"how_known": kind(q), "known_detail": detail(q, n, sources, widened) if q else "",
                    "resolution": resolution(q, lo, hi) if q else "",
                    "verdict": verdict(r[c["rule"]], q, lo, hi, float(r[c["budget"]])) if q else ""})
    return pd.DataFrame(out, index=rows.index)
