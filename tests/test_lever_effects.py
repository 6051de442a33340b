"""The planner's one file of measured lever effects is what the studies' committed results give, and a plan reads
it and nothing of the studies."""

import json
import math
from pathlib import Path

from lowmem.cli import plan_fairseq, plan_rules
from lowmem.studies import lever_effects

ROOT = Path(__file__).parents[1]


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_committed_effects_are_the_committed_results() -> None:
    committed = json.loads((ROOT / plan_rules.EFFECTS).read_text())
    assert _same(committed, json.loads(json.dumps(lever_effects.effects(ROOT))))


def test_each_swap_is_paired_against_the_same_update_in_fp32_and_kahan_is_keyed_with_its_precision() -> None:
    wrn = plan_rules.measured_effects(ROOT)
    for stage, arm, against, key in lever_effects.WRN_SWAPS:
        res = json.loads((ROOT / "metrics" / f"{stage}.json").read_text())
        by_seed = {s: a for s, a in zip(res["seeds"], res["arms"][arm]["per_seed_acc"])}
        ref = {s: a for s, a in zip(res["seeds"], res["arms"][against]["per_seed_acc"])}
        diffs = [100 * (by_seed[s] - ref[s]) for s in res["seeds"]]  # accuracies are fractions; changes in points
        assert wrn[key]["n"] == len(res["seeds"])
        assert math.isclose(wrn[key]["change"], sum(diffs) / len(diffs), abs_tol=1e-9)
        assert wrn[key]["low"] < wrn[key]["change"] < wrn[key]["high"]
    assert ("precision", "half-bf16+kahan") in wrn and "--precision half-bf16 --optimizer lowmem_adamw_kahan" in plan_fairseq.measured(ROOT)


def test_without_the_file_every_lossy_lever_is_unmeasured(tmp_path: Path) -> None:
    assert plan_rules.measured_effects(tmp_path) == {} and plan_fairseq.measured(tmp_path) == {}
    change, low, label = plan_rules.combine([("precision=half-bf16", plan_rules.measured_effects(tmp_path).get(("precision", "half-bf16")))])
    assert math.isnan(change) and math.isnan(low) and label == "precision=half-bf16: unmeasured"


def test_the_levers_table_has_every_lever_of_the_registry_and_each_lossy_ones_measured_effect() -> None:
    from lowmem.techniques import registry

    committed = json.loads((ROOT / plan_rules.EFFECTS).read_text())
    text = (ROOT / "figures" / "levers.md").read_text()
    assert text == lever_effects.table(committed["wrn"])
    rows = {cells[0]: " | ".join(cells) for line in text.splitlines()[4:]
            if (cells := [c.strip() for c in line.strip("|").split("|")])}
    assert list(rows) == list(registry.levers())
    sr = plan_rules.measured_effects(ROOT)[("optimizer", "sr-sgd")]
    assert f"sr-sgd: {sr['change']:+.2f} [{sr['low']:+.2f}, {sr['high']:+.2f}], {sr['n']} seeds" in rows["stochastic-rounding"]
    kahan = plan_rules.measured_effects(ROOT)[("precision", "half-bf16+kahan")]
    assert f"half-bf16+kahan: {kahan['change']:+.2f}" in rows["kahan"]
    assert " | bit-exact | " in rows["checkpointing"] and rows["checkpointing"].endswith("| - | -")
