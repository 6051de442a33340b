"""What the studies measured of each lossy lever, written once for the planner: ``metrics/lever_effects.json``.

``lowmem plan`` ranks its rows by the quality they risk. It reads this one file, and not the studies' tables and
statistics themselves, so that the product sits below the studies (tests/test_layout.py) and a plan needs neither
pandas' tables nor scipy's t. Two lists:

- ``wrn``: (lever, setting) -> WRN's test-accuracy change in points, with its paired 95% interval and seeds: the
  lossy levers alone (figures/09_wrn_levers.csv, stage combinations), the compressed activations alone
  (metrics/levers_train.json), and the two optimizer swaps, each paired against the same update with fp32 state
  (Kahan's bf16 against torch-optimi's SGD in fp32, 8-bit momentum against the same; stages levers_train and
  levers_state_train), and stochastic rounding's bf16 against its own SGD in fp32 (stage levers_rounding_train).
- ``fairseq``: fairseq-train options -> DynamicConv's sacreBLEU change with its bootstrap interval, widened by the
  baseline's seed noise where that was measured at the same profile and length (figures/08_translation_techniques.csv;
  8-bit AdamW and Kahan's AdamW from stages translation_levers_train and translation_kahan_train).

It also writes the levers table (``--table``, figures/levers.md): every lever of the registry
(``lowmem.techniques.registry``), how a run sets it, whether it is exact and the test that proves it, and for a lossy
one what WRN measured of it (the records above that its settings key).

    python -m lowmem.pipeline lever-effects --root . --out metrics/lever_effects.json --table figures/levers.md
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import pandas as pd

from lowmem import runs
from lowmem.studies import frontier, quality
from lowmem.studies.quality_model import arm_change
from lowmem.techniques import precision, registry, short_names

# The optimizer swaps, each against the same update with fp32 state (what the swap changes), paired by seed:
# (stage, arm, against, (lever, setting)). Kahan is keyed with the precision it compensates.
WRN_SWAPS = (("levers_train", "half-bf16+optimi-sgd", "optimi-sgd", ("precision", "half-bf16+kahan")),
             ("levers_state_train", "bnb-sgd8bit", "optimi-sgd", ("optimizer", "bnb-sgd8bit")),
             ("levers_rounding_train", "half-bf16+sr-sgd", "sr-sgd", ("optimizer", "sr-sgd")))
# The levers beyond the paper trained on DynamicConv, by the flags the fairseq planner keys them with: (stage,
# technique) whose trained arm measured them. Kahan is keyed with the precision it compensates.
FAIRSEQ_LEVERS = {"--optimizer lowmem_adamw8bit": ("translation_levers_train", "adamw-8bit"),
                  "--precision half-bf16 --optimizer lowmem_adamw_kahan": ("translation_kahan_train", "all-bf16-kahan")}


def wrn(root: Path) -> list[dict[str, Any]]:
    """WRN's measured lossy levers, one record each: lever, setting, change, low, high, n, where."""
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
    for r in frontier.beyond_rows(root / "metrics").itertuples():
        tech = json.loads(r.config)
        if set(tech) == {"activation_bits"}:  # the lever alone, against the baseline trained beside it
            effects[("activation_bits", tech["activation_bits"])] = {
                "change": r.quality_change, "low": r.quality_low, "high": r.quality_high, "n": int(r.quality_n),
                "where": f"WRN accuracy points, profile {r.profile}"}
    for stage, arm, against, key in WRN_SWAPS:
        path = root / "metrics" / f"{stage}.json"
        if path.exists():
            res = json.loads(path.read_text())
            if {arm, against} <= set(res["arms"]):
                c = arm_change(res, arm, against)
                effects[key] = {"change": c.mean, "low": c.low, "high": c.high, "n": c.n,
                                "where": f"WRN accuracy points against {against} in fp32, profile {res['profile']}"}
    return [{"lever": k, "setting": s, **{f: _plain(v) for f, v in e.items()}} for (k, s), e in effects.items()]


def _lever(name: str) -> tuple[str, Any] | None:
    if name.startswith("microbatch-"):
        return ("microbatch", int(name.split("-")[1]))
    if name.startswith("sparsity-"):
        return ("sparsity", float(name.split("-")[1]))
    if name in precision.MODES:
        return ("precision", name)
    return None


def fairseq(root: Path) -> list[dict[str, Any]]:
    """DynamicConv's measured options, one record each: options, change, low, high, where."""
    path = root / "figures" / "08_translation_techniques.csv"
    out: dict[str, dict[str, Any]] = {}
    if path.exists():
        df = pd.read_csv(path)
        md = root / "figures" / "08_translation_techniques.md"  # its caption names the profile
        caption = md.read_text().split("`") if md.exists() else []
        profile = caption[1] if len(caption) > 1 else "unknown"
        trained = root / "metrics" / "translation_techniques_train.json"
        updates = json.loads(trained.read_text())["max_update"] if trained.exists() else None
        # An --update-freq run is named by k alone: its --max-tokens is the study's T/k, as a plan's is the user's.
        out = {" ".join(r.options.split()[:2]) if r.options.startswith("--update-freq") else r.options:
               seed_widened(root, r.sacrebleu_change, r.sacrebleu_change_low, r.sacrebleu_change_high, profile, updates)
               for r in df.itertuples() if r.trained is True or str(r.trained) == "True"}
    for key, (stage, technique) in FAIRSEQ_LEVERS.items():
        path = root / "metrics" / f"{stage}.json"
        if path.exists():
            res = json.loads(path.read_text())
            out |= {key: seed_widened(root, r["sacrebleu_change"], r["sacrebleu_change_low"], r["sacrebleu_change_high"],
                                      res["profile"], res["max_update"])
                    for r in res["trained"] if r["technique"] == technique}
    return [{"options": k, **{f: _plain(v) for f, v in e.items()}} for k, e in out.items()]


def seed_widened(root: Path, change: float, low: float, high: float, profile: str, updates: int | None) -> dict[str, Any]:
    """One seed's sacreBLEU change with its bootstrap interval widened by the seed noise measured at the same profile
    and length, as the headline's (``frontier.widen_by_seed_noise``); the bootstrap's alone, said so, where none was."""
    where = f"DynamicConv sacreBLEU, profile {profile}, 1 seed"
    if math.isnan(low) or math.isnan(high):
        return {"change": change, "low": low, "high": high, "where": where + ", no interval"}
    noise = frontier.dc_seed_noise(root / "metrics", profile, updates) if updates is not None else None
    if noise is None:
        return {"change": change, "low": low, "high": high,
                "where": where + f", bootstrap interval only (no seed noise measured at profile {profile}, {updates} updates)"}
    run = quality.Paired(change, low, high, 1, float("nan"))
    c = quality.with_seed_noise(run, noise["sd"], noise["seeds"])
    if c is run:  # the baseline's own run, which with_seed_noise leaves as it is
        return {"change": change, "low": low, "high": high, "where": where + ", bootstrap interval"}
    return {"change": change, "low": c.low, "high": c.high,
            "where": f"{where}, bootstrap interval widened by the baseline's seed sd over {noise['seeds']} seeds"}


def _plain(v: Any) -> Any:
    """numpy's scalars as Python's, for JSON (NaN stays NaN: an unmeasured interval)."""
    return v.item() if hasattr(v, "item") else v


def effects(root: Path) -> dict[str, Any]:
    return {"wrn": wrn(root), "fairseq": fairseq(root)}


def _measures(lever: registry.Lever, effect: dict[str, Any]) -> bool:
    """Whether an effect record of ``wrn`` measures ``lever``: its field at any value where the lever is a number or a
    strategy (``short``), at one of its settings where the settings are its names, or, for an optimizer lever, a
    swap whose arm sets it (Kahan's is keyed with the precision it compensates)."""
    if not lever.field:
        return False
    key = (effect["lever"], effect["setting"])
    if lever.field == "optimizer":
        swaps = {k for _, arm, _, k in WRN_SWAPS if short_names.parse(arm).get("optimizer") in lever.settings}
        return key in swaps or (key[0] == "optimizer" and key[1] in lever.settings)
    return key[0] == lever.field and (bool(lever.short) or key[1] in lever.settings)


def table(wrn_effects: list[dict[str, Any]]) -> str:
    """The levers table: one row per lever of the registry, with what WRN measured of it."""
    rows = []
    for lv in registry.levers().values():
        found = [e for e in wrn_effects if _measures(lv, e)]
        measured = "; ".join(f"{e['setting']}: {e['change']:+.2f} [{e['low']:+.2f}, {e['high']:+.2f}], {e['n']} seeds"
                             for e in found)
        rows.append({"lever": lv.name, "what": lv.what, "set by (WRN)": (lv.short or ", ".join(map(str, lv.settings))) if lv.field else "-",
                     "exact": lv.exact, "proof": f"`{lv.proof.split('::')[-1]}`",
                     "WRN accuracy points, paired 95% interval": measured or ("-" if lv.exact != "lossy" else "not measured"),
                     "its study's results": lv.quality or "-"})
    profiles = sorted({m.group(1) for e in wrn_effects if (m := re.search(r"profile (\w+)", e["where"]))})
    caption = (f"The levers, each declared once in its module (lowmem/techniques, `LEVER`). Measured: what the studies "
               f"measured of a lever alone at profile `{', '.join(profiles) or 'none'}` (metrics/lever_effects.json; "
               "seeds paired, Student's t; each study's results file names its model and data), against the same "
               "update without it; proxy results, not CIFAR-10's. An exact lever is proven by its test; a measurement "
               "beside one is of where it is not exact (microbatching with BatchNorm).")
    return caption + "\n\n" + pd.DataFrame(rows).to_markdown(index=False) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--root", type=Path, default=Path("."), help="the checkout whose figures/ and metrics/ are read")
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write (metrics/lever_effects.json)")
    ap.add_argument("--table", type=Path, help="also write the levers table (Markdown) here: figures/levers.md")


def run(a: argparse.Namespace) -> int:
    found = effects(a.root)
    runs.write_json(a.out, found)
    if a.table:
        a.table.write_text(table(found["wrn"]))
    return 0
