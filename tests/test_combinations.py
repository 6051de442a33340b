"""The combination study: Pareto extraction, budget tables, the comparison with the paper, the grid and the chosen
subset, the accountant's shortcut for microbatches, and the DVC matrix stages."""

import dataclasses
import importlib.metadata
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from lowmem import config
from lowmem.config import ParamError
from lowmem.studies import (combination_grid, combination_memory, combination_search, combinations, frontier,
                            frontier_tables, quality, quality_model)

ROOT = Path(__file__).parents[1]

# A hand-made frontier: B and C tie on memory, C loses more quality but runs faster; E and G are dominated.
POINTS = pd.DataFrame({
    "name": ["A", "B", "C", "D", "E", "F", "G", "H"],
    "reduction": [1.0, 2.0, 2.0, 4.0, 3.0, 8.0, 1.0, 50.0],
    "quality_change": [0.0, -0.1, -0.3, -0.5, -0.6, -2.0, -0.2, float("nan")],
    "time_ratio": [1.0, 1.5, 1.2, 1.1, 0.9, 3.0, 1.0, 1.0],
})


def test_pareto_keeps_exactly_the_undominated_points() -> None:
    on = POINTS[frontier.pareto(POINTS)].name.tolist()
    assert on == ["A", "B", "D", "F"]  # C: B has the same memory and less loss; E: D beats it on both; H: not trained


def test_pareto_keeps_both_of_two_equal_points() -> None:
    twins = pd.DataFrame({"reduction": [2.0, 2.0, 1.0], "quality_change": [-0.1, -0.1, -0.5]})
    assert frontier.pareto(twins).tolist() == [True, True, False]


def test_best_within_picks_the_largest_reduction_inside_each_budget() -> None:
    best = frontier.best_within(POINTS, [0.01, 0.1, 0.3, 0.5, 5.0])
    assert best.name.tolist() == ["A", "B", "C", "D", "F"]
    # 0.1: B's -0.1 is on the budget's edge and counts; 0.3: B and C tie at 2x, and C is the faster one.
    assert best.budget.tolist() == [0.01, 0.1, 0.3, 0.5, 5.0]


def test_best_within_reports_a_budget_nothing_meets() -> None:
    worse = POINTS.assign(quality_change=POINTS.quality_change - 1.0)
    best = frontier.best_within(worse, [0.5, 1.0])
    assert best.name.isna().tolist() == [True, False] and best.name.iloc[1] == "A"


def test_comparison_reads_the_paper_from_the_reference_file(tmp_path: Path) -> None:
    ref = frontier.paper_reference()
    tables = {}
    for task, r in ref["tasks"].items():
        pts = POINTS.assign(config=POINTS.name, quality_change=POINTS.quality_change * abs(r["quality_change"]) / 0.5)
        tables[task] = frontier.best_within(pts, [-r["quality_change"]]).rename(columns={"name": "x"})
    comp = frontier_tables.comparison(tables, ref, {t: "test" for t in ref["tasks"]})
    for row in comp.itertuples():
        paper = ref["tasks"][row.task]
        assert row.paper_reduction == paper["memory_reduction"] and row.paper_change == paper["quality_change"]
        assert row.our_config == "D" and row.ours_over_paper == pytest.approx(4.0 / paper["memory_reduction"])
    with pytest.raises(ValueError, match="no row for the paper's budget"):
        frontier_tables.comparison({t: frontier.best_within(POINTS.assign(config=POINTS.name), [9.0]) for t in ref["tasks"]}, ref, {})


def test_beyond_rows_pair_each_arm_with_a_lever_beyond_the_paper_against_its_baseline(tmp_path: Path) -> None:
    arm = lambda acc, mib, step, **tech: {"techniques": tech, "per_seed_acc": acc, "step_s": step,  # noqa: E731
                                          "memory": {"activations_mib": mib / 2, "total_mib": mib}}
    res = {"profile": "cpu", "seeds": [0, 1, 2], "arms": {
        "baseline": arm([0.90, 0.91, 0.92], 400.0, [0.2, 0.2, 0.2]),
        "microbatch-8": arm([0.90, 0.90, 0.90], 40.0, [0.3, 0.3, 0.3], microbatch=8),  # the paper's: left out
        "activations-2": arm([0.89, 0.91, 0.90], 100.0, [0.3, 0.5, 0.4], activation_bits=2),
        "optimi-sgd": arm([0.90, 0.91, 0.92], 400.0, [0.2, 0.2, 0.2], optimizer="optimi-sgd")}}
    (tmp_path / "levers_train.json").write_text(json.dumps(res))
    rows = frontier.beyond_rows(tmp_path).set_index("name")
    assert list(rows.index) == ["activations-2", "optimi-sgd"]
    a = rows.loc["activations-2"]
    assert a.reduction == pytest.approx(4.0) and a.quality_change == pytest.approx((-1 + 0 - 2) / 3)
    assert a.quality_n == 3 and a.quality_low < a.quality_change < a.quality_high
    assert a.time_ratio == pytest.approx(0.4 / 0.2)  # medians of the runs' steps
    assert json.loads(a.config) == {"activation_bits": 2}
    assert frontier.beyond_rows(tmp_path / "nothing").empty


def test_beyond_rows_take_the_second_study_with_its_own_baseline_and_machine(tmp_path: Path) -> None:
    """Each study of levers beyond the paper pairs its arms with its own baseline (another machine trains the same
    seed to another accuracy); an arm already in the first study is not taken twice."""
    arm = lambda acc, **tech: {"techniques": tech, "per_seed_acc": acc, "step_s": [0.2, 0.2, 0.2],  # noqa: E731
                               "memory": {"total_mib": 100.0}}
    first = {"profile": "cpu", "seeds": [0, 1, 2], "arms": {"baseline": arm([0.90, 0.90, 0.90]),
                                                            "optimi-sgd": arm([0.89, 0.89, 0.89], optimizer="optimi-sgd")}}
    second = {"profile": "cpu", "machine": "CPU B", "seeds": [0, 1, 2], "arms": {
        "baseline": arm([0.80, 0.80, 0.80]), "optimi-sgd": arm([0.70, 0.70, 0.70], optimizer="optimi-sgd"),
        "bnb-sgd8bit": arm([0.81, 0.81, 0.81], optimizer="bnb-sgd8bit")}}
    (tmp_path / "levers_train.json").write_text(json.dumps(first))
    (tmp_path / "levers_state_train.json").write_text(json.dumps(second))
    rows = frontier.beyond_rows(tmp_path).set_index("name")
    assert list(rows.index) == ["optimi-sgd", "bnb-sgd8bit"]
    assert rows.loc["optimi-sgd"].quality_change == pytest.approx(-1.0)  # the first study's, against its baseline
    assert rows.loc["bnb-sgd8bit"].quality_change == pytest.approx(+1.0)  # against the second study's baseline
    assert rows.loc["bnb-sgd8bit"].machine == "CPU B" and rows.loc["optimi-sgd"].machine == "not recorded"


def test_dynamicconv_beyond_rows_carry_their_runs_bleu_to_exact_twins_and_stay_out_of_the_levels(tmp_path: Path) -> None:
    d = small("dynamicconv", precision=["fp32", "adamw-8bit"], sparsity=[0], microbatch=[1, 4], checkpoint=["none", "layers"])
    configs = combination_grid.grid(d)
    names = [combination_grid.name(d, c) for c in configs]
    assert names == ["baseline", "checkpoint", "microbatch-4", "microbatch-4+checkpoint", "adamw-8bit",
                     "adamw-8bit+checkpoint", "adamw-8bit+microbatch-4", "adamw-8bit+microbatch-4+checkpoint"]
    sweep = pd.DataFrame({"name": names, "precision": [c.get("precision", "fp32") for c in configs],
                          "sparsity": 0.0, "microbatch": [c.get("microbatch", 1) for c in configs],
                          "checkpoint": [c.get("checkpoint", "none") for c in configs],
                          "config": [json.dumps(c) for c in configs], "techniques": [len(c) for c in configs],
                          "mildness": [combination_grid.mildness(d, c) for c in configs], "activation_bits": 0,
                          "total_mib": [100, 60, 50, 30, 25, 55, 40, 20]})
    sweep["reduction"] = 100 / sweep.total_mib
    # The levels pick the paper's levers only, however far a lever beyond the paper reaches: adamw-8bit alone (4x,
    # one technique) or 8-bit activations alone (5x) would be the fewest techniques reaching 3x.
    d.levels, d.slots, d.trained_elsewhere = [3.0], 2, []
    packed = pd.DataFrame([{**sweep.iloc[0].to_dict(), "name": "activations-8", "config": json.dumps({"activation_bits": 8}),
                            "techniques": 1, "mildness": 1, "activation_bits": 8, "total_mib": 20, "reduction": 5.0}])
    assert [c["name"] for c in combination_search.select(d, pd.concat([sweep, packed], ignore_index=True))] == ["baseline", "microbatch-4+checkpoint"]
    sweep.to_csv(tmp_path / "dynamicconv_sweep.csv", index=False)
    trained = {"profile": "cpu", "machine": "CPU A", "time_ratio": {"baseline": 1.0, "adamw-8bit+microbatch-4": 1.3},
               "trained": [{"technique": "baseline", "sacrebleu_change": 0.0, "sacrebleu_change_low": 0.0, "sacrebleu_change_high": 0.0},
                           {"technique": "adamw-8bit+microbatch-4", "sacrebleu_change": -0.4,
                            "sacrebleu_change_low": -0.9, "sacrebleu_change_high": 0.1}]}
    (tmp_path / "translation_levers_train.json").write_text(json.dumps(trained))
    rows = frontier.beyond_rows_dynamicconv(tmp_path, tmp_path).set_index("name")
    assert list(rows.index) == ["adamw-8bit+microbatch-4", "adamw-8bit+microbatch-4+checkpoint"]
    twin = rows.loc["adamw-8bit+microbatch-4+checkpoint"]
    assert (twin.quality_change, twin.quality_low, twin.quality_high) == (-0.4, -0.9, 0.1)
    assert twin.quality_from.startswith("exact, by test") and np.isnan(twin.time_ratio)
    assert rows.loc["adamw-8bit+microbatch-4"].time_ratio == 1.3 and twin.reduction == 5.0
    assert frontier.beyond_rows_dynamicconv(tmp_path, tmp_path / "nothing").empty

    # A bit width the grid does not hold: its stage accounts its memory itself, against its own baseline, and
    # checkpointing gives it no twin (it is not exact with packed activations).
    mem = {"baseline": {"total_mib": 100.0, "activations_mib": 50.0},
           "activations-8+checkpoint": {"total_mib": 30.0, "activations_mib": 5.0}}
    packed = {"profile": "cpu", "machine": "CPU A", "time_ratio": {"baseline": 1.0, "activations-8+checkpoint": 1.6}, "memory": mem,
              "trained": [{"technique": "baseline", "sacrebleu_change": 0.0, "sacrebleu_change_low": 0.0, "sacrebleu_change_high": 0.0},
                          {"technique": "activations-8+checkpoint", "sacrebleu_change": -0.2,
                           "sacrebleu_change_low": -0.6, "sacrebleu_change_high": 0.2}]}
    (tmp_path / "translation_activations_train.json").write_text(json.dumps(packed))
    rows = frontier.beyond_rows_dynamicconv(tmp_path, tmp_path).set_index("name")
    assert list(rows.index) == ["adamw-8bit+microbatch-4", "adamw-8bit+microbatch-4+checkpoint", "activations-8+checkpoint"]
    act = rows.loc["activations-8+checkpoint"]
    assert (act.reduction, act.activations_mib, act.quality_change, act.quality_high, act.time_ratio) == (100 / 30, 5.0, -0.2, 0.2, 1.6)
    assert act.study == "translation_activations_train" and act.quality_from == "stage translation_activations_train"
    mem["baseline"]["total_mib"] = 90.0  # another recipe than the sweep's: the reductions would not compare
    (tmp_path / "translation_activations_train.json").write_text(json.dumps(packed))
    with pytest.raises(ValueError, match="its baseline's memory differs from the DynamicConv sweep's"):
        frontier.beyond_rows_dynamicconv(tmp_path, tmp_path)
    del packed["memory"]
    (tmp_path / "translation_activations_train.json").write_text(json.dumps(packed))
    with pytest.raises(ValueError, match=r"no full-size memory recorded for \['activations-8\+checkpoint', 'baseline'\], needed for "
                                         r"\['activations-8\+checkpoint'\], which the DynamicConv sweep does not hold: rerun stage translation_activations_train"):
        frontier.beyond_rows_dynamicconv(tmp_path, tmp_path)
    # One the grid holds takes the sweep's memory, and its checkpointed row in the grid still gets no twin.
    grid = pd.concat([sweep, pd.DataFrame([{**sweep.iloc[0].to_dict(), "name": n, "config": json.dumps(c), "activation_bits": 8,
                                            "checkpoint": c.get("checkpoint", "none"), "total_mib": t, "reduction": 100 / t}
                                           for n, c, t in [("activations-8", {"activation_bits": 8}, 80.0),
                                                           ("activations-8+checkpoint", {"checkpoint": "layers", "activation_bits": 8}, 40.0)]])],
                     ignore_index=True)
    grid.to_csv(tmp_path / "dynamicconv_sweep.csv", index=False)
    packed["trained"][1]["technique"], packed["time_ratio"] = "activations-8", {"baseline": 1.0, "activations-8": 1.6}
    (tmp_path / "translation_activations_train.json").write_text(json.dumps(packed))
    rows = frontier.beyond_rows_dynamicconv(tmp_path, tmp_path).set_index("name")
    assert list(rows.index) == ["adamw-8bit+microbatch-4", "adamw-8bit+microbatch-4+checkpoint", "activations-8"]
    assert (rows.loc["activations-8"].reduction, rows.loc["activations-8"].quality_change) == (1.25, -0.2)


def test_a_levers_stage_arm_of_the_papers_levers_gives_its_row_in_the_papers_grid_and_its_twin(tmp_path: Path) -> None:
    """A control a levers stage trained beside its levers (update-freq 16 in stage translation_kahan_train) is a
    combination of the paper's levers: its row gets that run's change against the baseline beside it, and its
    checkpointed twin the same (exact by test). Stage 08's own runs and the combination study's keep theirs, and
    the arms beyond the paper stay accounted points without quality (theirs is ``beyond_rows_dynamicconv``'s)."""
    d = small("dynamicconv", precision=["fp32", "adamw-8bit"], sparsity=[0], microbatch=[1, 4, 16], checkpoint=["none", "layers"],
              activation_bits=[0, 8])
    configs = combination_grid.grid(d)
    names = [combination_grid.name(d, c) for c in configs]
    sweep = pd.DataFrame({"name": names, "precision": [c.get("precision", "fp32") for c in configs], "sparsity": 0.0,
                          "microbatch": [c.get("microbatch", 1) for c in configs],
                          "checkpoint": [c.get("checkpoint", "none") for c in configs],
                          "activation_bits": [c.get("activation_bits", 0) for c in configs], "config": [json.dumps(c) for c in configs],
                          "techniques": [len(c) for c in configs], "total_mib": np.linspace(100, 10, len(configs))})
    sweep["reduction"] = 100 / sweep.total_mib
    sweep.to_csv(tmp_path / "dynamicconv_sweep.csv", index=False)
    (tmp_path / "dynamicconv_selected.json").write_text(json.dumps({"profile": "cpu", "selected": []}))
    (tmp_path / "combinations").mkdir()

    def arm(t: str, change: float) -> dict:
        return {"technique": t, "sacrebleu": 20 + change, "sacrebleu_change": change,
                "sacrebleu_change_low": change - 1, "sacrebleu_change_high": change + 1}

    def write(stage: str, res: dict) -> None:
        (tmp_path / f"{stage}.json").write_text(json.dumps(res))

    write("translation_techniques_train", {"profile": "cpu", "max_update": 100, "time_ratio": {"baseline": 1.0, "microbatch-4": 0.9},
                                           "trained": [arm("baseline", 0.0), arm("microbatch-4", 2.0)]})
    kahan = {"profile": "cpu", "max_update": 100,
             "time_ratio": {"baseline": 1.0, "microbatch-4": 0.5, "microbatch-16": 1.2, "adamw-8bit": 1.1, "activations-8": 1.6},
             "trained": [arm("baseline", 0.3), arm("microbatch-4", -5.0), arm("microbatch-16", 1.5), arm("adamw-8bit", 0.1),
                         arm("activations-8", -0.2)]}
    write("translation_kahan_train", kahan)
    got = frontier.results("dynamicconv", tmp_path, tmp_path).set_index("name")
    uf16, twin = got.loc["microbatch-16"], got.loc["microbatch-16+checkpoint"]
    assert (uf16.quality_change, uf16.quality_low, uf16.quality_high, uf16.time_ratio) == (1.5, 0.5, 2.5, 1.2)
    assert uf16.quality_from == "stage translation_kahan_train"
    assert (twin.quality_change, twin.quality_low, twin.quality_high) == (1.5, 0.5, 2.5) and twin.quality_from.startswith("exact, by test")
    # Stage 08's runs keep stage 08's scores; the levers stage's baseline and its levers beyond the paper add nothing here.
    assert (got.loc["microbatch-4"].quality_change, got.loc["microbatch-4"].time_ratio) == (2.0, 0.9)
    assert got.loc["baseline"].quality_change == 0.0
    assert got.loc[["adamw-8bit", "activations-8"], "quality_change"].isna().all() and got.loc[["adamw-8bit", "activations-8"], "beyond"].all()
    assert got.quality_change.notna().sum() == 6  # the baseline, microbatch-4 and -16, and their checkpointed twins
    assert len(got) == len(configs) == 24 and got.beyond.sum() == 18  # every accounted point, 6 of them the paper's
    # An arm in two levers stages is the first one's (LEVERS_STAGES_DYNAMICCONV's order).
    write("translation_levers_train", {**kahan, "trained": [arm("baseline", 0.0), arm("microbatch-16", 9.0)]})
    uf16 = frontier.results("dynamicconv", tmp_path, tmp_path).set_index("name").loc["microbatch-16"]
    assert (uf16.quality_change, uf16.quality_from) == (9.0, "stage translation_levers_train")
    (tmp_path / "translation_levers_train.json").unlink()
    with pytest.raises(ValueError, match="different profiles"):
        write("translation_kahan_train", {**kahan, "profile": "smoke"})
        frontier.results("dynamicconv", tmp_path, tmp_path)
    with pytest.raises(ValueError, match="stage translation_kahan_train trained 50 updates but stage 08's baseline 100"):
        write("translation_kahan_train", {**kahan, "max_update": 50})
        frontier.results("dynamicconv", tmp_path, tmp_path)


def test_every_committed_dynamicconv_arm_with_a_plugin_lever_beyond_the_paper_is_among_the_beyond_rows() -> None:
    """A trained arm whose setting the sweep holds but ``quality_model.BEYOND_PAPER_DYNAMICCONV`` does not list would
    drop out of the rows "the paper's and beyond" without an error; each levers stage's arms with one of the
    plugin's options beyond the paper are all there."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    techniques = config.load("combinations_dynamicconv", {**params, "base": {**params["base"], "profile": "cpu"}}).translation["techniques"]
    rows = frontier.beyond_rows_dynamicconv(ROOT / "data" / "combinations", ROOT / "metrics")
    for stage in frontier.LEVERS_STAGES_DYNAMICCONV:
        trained = json.loads((ROOT / "metrics" / f"{stage}.json").read_text())["trained"]
        arms = [r["technique"] for r in trained
                if {"lowmem_adamw8bit", "lowmem_adamw_kahan", "--activation-bits"} & set(techniques[r["technique"]])]
        assert arms and set(arms) <= set(rows.name), stage
        assert set(rows[rows.study == stage].name) >= set(arms) - set(rows[rows.study != stage].name)


def test_one_seed_bleu_intervals_are_widened_by_the_noise_study_at_their_own_length_only(tmp_path: Path) -> None:
    scores = {600: [12.0, 13.0, 14.5], 1400: [23.0, 23.2, 22.9]}
    noise = {"profile": "cpu", "updates": [600, 1400], "machine": "CPU A",
             "runs": [{"seed": s, "scores": [{"updates": u, "sacrebleu": scores[u][s]} for u in scores]} for s in range(3)]}
    (tmp_path / "bleu_noise_train.json").write_text(json.dumps(noise))
    got = frontier.dc_seed_noise(tmp_path, "cpu", 1400)
    assert (got["seeds"], got["sd"]) == (3, pytest.approx(float(np.std(scores[1400], ddof=1)), rel=1e-12))
    assert frontier.dc_seed_noise(tmp_path, "smoke", 1400) is None  # another profile's noise is not this one's
    assert frontier.dc_seed_noise(tmp_path, "cpu", 1000) is None  # nor another length's
    assert frontier.dc_seed_noise(tmp_path / "nothing", "cpu", 600) is None
    rows = pd.DataFrame({"name": ["baseline", "a", "a+checkpoint", "untested", "wrn-like"],
                         "quality_change": [0.0, -0.4, -0.4, -1.0, -0.2], "quality_low": [0.0, -0.9, -0.9, np.nan, -0.5],
                         "quality_high": [0.0, 0.1, 0.1, np.nan, 0.1], "quality_n": [1, 1, 1, 1, 3]})
    wide = frontier.widen_by_seed_noise(rows, got).set_index("name")
    want = quality.with_seed_noise(quality.Paired(-0.4, -0.9, 0.1, 1, np.nan), got["sd"], 3)
    for n in ("a", "a+checkpoint"):  # an exact twin carries its run's quality, so the same interval
        assert (wide.loc[n, "quality_low"], wide.loc[n, "quality_high"]) == (want.low, want.high)
    assert want.low < -0.9 and want.high > 0.1
    # The baseline's own run differs from itself by exactly zero; a run without an interval and a seed-paired WRN
    # row are not one seed's bootstrap.
    assert wide.loc["baseline", ["quality_low", "quality_high"]].tolist() == [0.0, 0.0]
    assert wide.loc["untested", ["quality_low", "quality_high"]].isna().all()
    assert wide.loc["wrn-like", ["quality_low", "quality_high"]].tolist() == [-0.5, 0.1]
    assert frontier.widen_by_seed_noise(rows, None).equals(rows)


def test_comparison_says_so_for_a_task_with_no_lever_beyond_the_paper() -> None:
    ref = frontier.paper_reference()
    task = next(iter(ref["tasks"]))
    pts = POINTS.assign(config=POINTS.name)
    comp = frontier_tables.comparison({task: frontier.best_within(pts, [-ref["tasks"][task]["quality_change"]])}, ref,
                                      {t: "test" for t in ref["tasks"]}, frontier.LEVERS_BEYOND).set_index("task")
    assert (comp.levers == frontier.LEVERS_BEYOND).all()
    others = [t for t in ref["tasks"] if t != task]
    assert all(comp.loc[t, "our_config"].startswith("none trained") and pd.isna(comp.loc[t, "our_reduction"]) for t in others)


def test_readme_block_is_replaced_between_its_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# t\n\n{frontier_tables.README_BEGIN}\nold\n{frontier_tables.README_END}\n\nrest\n")
    frontier_tables.write_readme_block(readme, "| a |\n|---|\n| 1 |\n")
    assert frontier_tables.readme_block(readme) == "| a |\n|---|\n| 1 |"
    assert readme.read_text().endswith("\n\nrest\n")
    (tmp_path / "bare.md").write_text("# t\n")
    with pytest.raises(ValueError, match="no headline block"):
        frontier_tables.write_readme_block(tmp_path / "bare.md", "x")


def test_readme_shows_the_headline_table_the_report_wrote() -> None:
    assert frontier_tables.readme_block(ROOT / "README.md") == (ROOT / "figures/00_headline.md").read_text().strip()


def small(task: str = "wrn", profile: str = "smoke", **kw: object) -> combination_grid.CombinationsParams:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["base"]["profile"] = profile
    p = config.load(f"combinations_{task}", params)
    if "activation_bits" not in kw:  # the paper's four dimensions, unless a test adds the fifth
        kw = {"activation_bits": [0], **({"search_paper": False} if task == "wrn" else {}), **kw}
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def test_the_grid_is_every_combination_with_the_baseline_first() -> None:
    p = small(sparsity=[0, 0.5, 0.9], precision=["fp32", "half-bf16"], microbatch=[0, 8, 2], checkpoint=["none", "sqrt"])
    g = combination_grid.grid(p)
    assert len(g) == 3 * 2 * 3 * 2 and g[0] == {}
    names = [combination_grid.name(p, c) for c in g]
    assert len(set(names)) == len(names)
    assert "sparsity-0.5+half-bf16+microbatch-2+checkpoint-sqrt" in names
    # WRN's fifth dimension, a lever beyond the paper: every combination again with each bit width
    wide = combination_grid.grid(small(sparsity=[0, 0.5, 0.9], precision=["fp32", "half-bf16"], microbatch=[0, 8, 2],
                                   checkpoint=["none", "sqrt"], activation_bits=[0, 8, 2]))
    assert len(wide) == 3 * len(g) and [c for c in wide if "activation_bits" not in c] == g
    assert combination_grid.name(p, {"microbatch": 8, "checkpoint": "block", "activation_bits": 2}) == \
        "microbatch-8+checkpoint-block+activations-2"  # named as stage levers_train's arm
    d = small("dynamicconv")
    assert combination_grid.translation_options(d, {"sparsity": 0.9, "precision": "fp16", "microbatch": 4, "checkpoint": "layers"}) == [
        "--sparsity", "0.9", "--sparse-method", "static", "--fp16", "--microbatches", "4", "--checkpoint-activations"]
    # DynamicConv's fifth dimension is the plugin's option, named as stage translation_activations_train's arm
    assert combination_grid.translation_options(d, {"checkpoint": "layers", "activation_bits": 8}) == [
        "--checkpoint-activations", "--activation-bits", "8"]
    assert combination_grid.name(d, {"microbatch": 4, "activation_bits": 8}) == "microbatch-4+activations-8"


def test_dynamicconv_bf16_settings_take_stage_08s_options_and_mixed_bf16_with_sparsity_is_left_out() -> None:
    d = small("dynamicconv", "cpu", sparsity=[0, 0.9], precision=["fp32", "mixed-bf16", "all-bf16", "fp16"], microbatch=[1, 4],
              checkpoint=["none", "layers"])
    techniques = d.translation["techniques"]
    assert combination_grid.translation_options(d, {"precision": "mixed-bf16", "microbatch": 4}) == [
        *techniques["mixed-bf16"], "--microbatches", "4"]
    assert combination_grid.translation_options(d, {"sparsity": 0.9, "precision": "all-bf16"}) == ["--sparsity", "0.9", *techniques["all-bf16"]]
    g = combination_grid.grid(d)
    # 2 x 4 x 2 x 2 settings, less the 4 that pair mixed-bf16 with sparsity (the accountant refuses them)
    assert len(g) == 32 - 4 and not [c for c in g if c.get("precision") == "mixed-bf16" and "sparsity" in c]
    assert {"precision": "mixed-bf16", "microbatch": 4, "checkpoint": "layers"} in g
    d.translation = {**d.translation, "device": "cpu"}
    assert [m for m in d.precision if combination_grid.trainable(d, m)] == ["fp32", "mixed-bf16", "all-bf16"]
    with pytest.raises(ParamError, match="half-fp32"):
        combination_grid.translation_options(d, {"precision": "half-fp32"})


def test_select_takes_the_baseline_singles_then_the_mildest_combination_at_each_level() -> None:
    p = small(sparsity=[0, 0.9], precision=["fp32", "half-bf16"], microbatch=[0, 8], checkpoint=["none"],
              singles=[{"precision": "half-bf16"}], levels=[2, 10], slots=4, search=False)
    rows = []
    # grid order: baseline, microbatch-8, half-bf16, half-bf16+microbatch-8, sparsity-0.9, sparsity-0.9+microbatch-8, ...
    for cfg, red in zip(combination_grid.grid(p), [1.0, 12.0, 1.9, 25.0, 2.0, 15.0, 2.1, 30.0]):
        rows.append({"name": combination_grid.name(p, cfg), "config": json.dumps(cfg), "techniques": len(cfg),
                     "mildness": combination_grid.mildness(p, cfg), "reduction": red, "precision": cfg.get("precision", "fp32")})
    chosen = combination_search.select(p, pd.DataFrame(rows))
    # level 2: one technique is enough, and of the two equally mild singles that reach it microbatch-8 saves more;
    # level 10: two techniques are needed, and of the two equally mild pairs half-bf16+microbatch-8 saves more.
    assert [c["name"] for c in chosen] == ["baseline", "half-bf16", "microbatch-8", "half-bf16+microbatch-8"]
    assert [c["slot"] for c in chosen] == [0, 1, 2, 3] and chosen[3]["config"] == {"precision": "half-bf16", "microbatch": 8}
    p.slots = 5
    with pytest.raises(ParamError, match="set slots to 4"):
        combination_search.select(p, pd.DataFrame(rows))
    p.slots, p.levels = 4, [2, 100]
    with pytest.raises(ParamError, match="no combination of the grid reaches 100x"):
        combination_search.select(p, pd.DataFrame(rows))


@pytest.mark.parametrize("cfg", [
    {"microbatch": 2},
    {"sparsity": 0.9, "precision": "half-fp16", "microbatch": 2, "checkpoint": "sqrt"},
    {"sparsity": 0.5, "precision": "mixed-bf16", "microbatch": 4, "checkpoint": "block"},
])
def test_skipping_repeated_microbatches_accounts_the_same_bytes(cfg: dict) -> None:
    p = small(wrn={"model": "wrn-10-1", "num_classes": 10, "in_channels": 3, "image_size": 32, "batch_size": 16, "device": "cpu"})
    short = combination_memory.wrn_memory_row(p, cfg)
    full = combination_memory.wrn_memory_row(p, cfg, skip_repeats=False)
    assert short == full


def test_every_profile_chooses_as_many_combinations_as_the_matrix_has_slots() -> None:
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for task in combination_grid.TASKS:
        slots = dvc[f"combination_{task}"]["matrix"]["slot"]
        for profile in ("smoke", "cpu", "paper"):
            p = config.load(f"combinations_{task}", {**params, "base": {**params["base"], "profile": profile}})
            if p.search:  # the singles' slots, then the search's
                slots_all = slots + dvc[f"combination_search_{task}"]["matrix"]["slot"]
                assert slots == list(range(1 + len(p.singles)))
            else:
                slots_all = slots
            assert slots_all == list(range(p.slots))
            assert 1 + len(p.singles) + len(p.levels) + combination_search.search_slots(p) - len(p.levels) * p.search - len(p.trained_elsewhere) == p.slots
        committed = json.loads((ROOT / f"data/combinations/{task}_selected.json").read_text())
        assert [c["slot"] for c in committed["selected"]] == slots


def test_the_matrix_stages_expand_to_one_run_per_slot() -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}
    out = subprocess.run(["dvc", "stage", "list"], cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    stages = {line.split()[0] for line in out.splitlines() if line.strip()}
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for task in combination_grid.TASKS:
        runs = {s.replace("combination_search_", "combination_") for s in stages
                if s.startswith((f"combination_{task}@", f"combination_search_{task}@"))}
        assert runs == {f"combination_{task}@{i}" for i in range(params[f"combinations_{task}"]["slots"])}


# --- the quality-aware search -------------------------------------------------------------------------------------


def _slot(name: str, accs: list[float], seeds: list[int] = [0, 1, 2]) -> dict:
    return {"name": name, "seeds": seeds, "per_seed_acc": accs}


def test_a_paired_change_pairs_by_seed_in_points() -> None:
    base = _slot("baseline", [0.80, 0.82, 0.84])
    other = _slot("x", [0.835, 0.815, 0.79], seeds=[2, 1, 0])  # listed in another order
    c = quality_model.paired_change(other, base)
    assert c.n == 3 and c.mean == pytest.approx(100 * ((0.79 - 0.80) + (0.815 - 0.82) + (0.835 - 0.84)) / 3)


def _search_grid() -> tuple[combination_grid.CombinationsParams, pd.DataFrame]:
    p = small(sparsity=[0, 0.9], precision=["fp32", "half-bf16"], microbatch=[0, 8, 2], checkpoint=["none", "block"],
              singles=[{"sparsity": 0.9}, {"precision": "half-bf16"}, {"microbatch": 8}], levels=[10, 30], search=True,
              search_max=True, slots=4 + 3)
    rows = []
    for cfg in combination_grid.grid(p):
        red = (1.5 if cfg.get("sparsity") else 1) * (2 if cfg.get("precision") else 1) * \
            {0: 1, 8: 8, 2: 20}[cfg.get("microbatch", 0)] * (1.6 if cfg.get("checkpoint") else 1)
        rows.append({"name": combination_grid.name(p, cfg), "config": json.dumps(cfg), "reduction": red,
                     "time_ratio": 1.0 + 0.3 * bool(cfg.get("checkpoint")), **{d: cfg.get(d, getattr(p, d)[0]) for d in quality_model.dims(p.task)}})
    return p, pd.DataFrame(rows)


EFFECTS = {("sparsity", 0.9): quality.Paired(-0.8, -1, -0.6, 3, 0.1), ("precision", "half-bf16"): quality.Paired(-0.1, -0.3, 0.1, 3, 0.1),
           ("microbatch", 8): quality.Paired(-0.2, -0.4, 0, 3, 0.1)}


def test_the_prediction_is_the_sum_of_the_lossy_levers_and_unknown_where_a_lever_was_not_trained_alone() -> None:
    p, memory = _search_grid()
    pred = quality_model.predict(memory, EFFECTS).set_axis(memory.name)
    assert pred["baseline"] == 0 and pred["checkpoint-block"] == 0  # exact: adds nothing
    assert pred["sparsity-0.9+half-bf16+microbatch-8+checkpoint-block"] == pytest.approx(-1.1)
    assert pred["half-bf16+microbatch-8"] == pytest.approx(-0.3)
    assert np.isnan(pred["microbatch-2"]) and np.isnan(pred["half-bf16+microbatch-2+checkpoint-block"])


def test_the_search_picks_the_smallest_predicted_loss_at_each_level_then_the_largest_predictable_reduction() -> None:
    p, memory = _search_grid()
    chosen = ["baseline", "sparsity-0.9", "half-bf16", "microbatch-8"]
    picks = combination_search.search(p, memory, EFFECTS, chosen)
    # 10x: microbatch-8 (8x) needs checkpointing (12.8x, no loss) or half-bf16 (16x, -0.1): the exact lever wins.
    # 30x: half-bf16+microbatch-8+checkpoint-block (25.6x) falls short; sparsity costs 0.8, so -0.9 is the least.
    # Maximum: of what is left, half-bf16+microbatch-8+checkpoint-block (25.6x) beats sparsity-0.9+half-bf16+microbatch-8 (24x).
    assert [c["name"] for c in picks] == ["microbatch-8+checkpoint-block", "sparsity-0.9+half-bf16+microbatch-8+checkpoint-block",
                                          "half-bf16+microbatch-8+checkpoint-block"]
    assert [c["role"] for c in picks] == ["search 10x", "search 30x", "search maximum"]
    assert picks[1]["predicted_change"] == pytest.approx(-1.1) and picks[2]["predicted_change"] == pytest.approx(-0.3)
    p.levels = [10, 100]
    with pytest.raises(ParamError, match="reaches 100x"):
        combination_search.search(p, memory, EFFECTS, chosen)


def test_with_search_paper_the_search_picks_again_among_the_papers_levers_alone() -> None:
    """A lever beyond the paper that gains wins every level of the first pass (at 10x microbatch-8 with 8-bit
    activations, 10.4x, ties with its checkpointed twin and runs faster); the second pass, the paper's levers alone,
    then picks what the search would pick on a grid without it (the test above)."""
    p, memory = _search_grid()
    p.activation_bits, p.search_paper = [0, 8], True
    rows = []
    for _, r in memory.iterrows():
        for bits in (0, 8):
            cfg = {**json.loads(r.config), **({"activation_bits": bits} if bits else {})}
            rows.append({**r.to_dict(), "name": combination_grid.name(p, cfg), "config": json.dumps(cfg), "activation_bits": bits,
                         "reduction": r.reduction * (1.3 if bits else 1)})
    effects = {**EFFECTS, ("activation_bits", 8): quality.Paired(0.05, -0.2, 0.3, 3, 0.1)}
    picks = combination_search.search(p, pd.DataFrame(rows), effects, ["baseline", "sparsity-0.9", "half-bf16", "microbatch-8"])
    assert [c["name"] for c in picks] == [
        "microbatch-8+activations-8", "half-bf16+microbatch-8+checkpoint-block+activations-8",
        "sparsity-0.9+half-bf16+microbatch-8+checkpoint-block+activations-8",
        "microbatch-8+checkpoint-block", "sparsity-0.9+half-bf16+microbatch-8+checkpoint-block", "half-bf16+microbatch-8+checkpoint-block"]
    assert [c["role"] for c in picks[3:]] == ["search 10x (the paper's levers)", "search 30x (the paper's levers)",
                                              "search maximum (the paper's levers)"]
    assert combination_search.search_slots(p) == 6
    with pytest.raises(ParamError, match="search_paper"):
        small(search=True, search_paper=True, activation_bits=[0], singles=[{"sparsity": 0.9}]).__post_init__()


def test_the_search_refuses_an_exact_lever_among_its_singles() -> None:
    with pytest.raises(ParamError, match="exact levers"):
        small(search=True, singles=[{"checkpoint": "sqrt"}]).__post_init__()


def test_both_rules_decide_from_the_interval_columns() -> None:
    pts = pd.DataFrame({"name": ["A", "B", "C"], "reduction": [1.0, 10.0, 20.0], "quality_change": [0.0, -0.3, -0.35],
                        "quality_low": [0.0, -0.39, -0.9], "quality_high": [0.0, -0.2, 0.2], "time_ratio": [1.0, 1.0, 1.0]})
    assert frontier.best_within(pts, [0.4], rule="mean").name.tolist() == ["C"]
    assert frontier.best_within(pts, [0.4], rule="interval").name.tolist() == ["B"]
    assert frontier.best_within(pts.drop(columns=["quality_low", "quality_high"]), [0.4], rule="interval").name.isna().all()


def test_each_exact_lever_names_a_test_that_exists() -> None:
    for lever, ref in [*quality_model.EXACT.items(), *quality_model.EXACT_DYNAMICCONV.items(),
                       *quality_model.EQUAL_UP_TO_DROPOUT_DYNAMICCONV.items()]:
        path, test = ref.split("::")
        assert f"def {test}(" in (ROOT / path).read_text(), lever


def test_a_dynamicconv_checkpoint_twin_carries_its_run_only_in_a_tested_precision() -> None:
    rows = [("baseline", 0, "fp32", 1, "none", 0.0), ("a", 0.9, "all-bf16", 16, "none", -1.5), ("a+ckpt", 0.9, "all-bf16", 16, "layers", None),
            ("b", 0, "fp16", 4, "none", -0.2), ("b+ckpt", 0, "fp16", 4, "layers", None), ("c+ckpt", 0.5, "all-bf16", 16, "layers", None)]
    df = pd.DataFrame(rows, columns=["name", "sparsity", "precision", "microbatch", "checkpoint", "quality_change"])
    df["quality_low"], df["quality_high"], df["quality_n"], df["quality_from"] = df.quality_change - 1, df.quality_change + 1, 1.0, ""
    df["activation_bits"] = 0
    frontier._exact_fill(df, "dynamicconv", quality_model.EXACT_DYNAMICCONV, quality_model.EXACT_DYNAMICCONV_PRECISIONS)
    by = df.set_index("name")
    assert by.loc["a+ckpt", ["quality_change", "quality_low", "quality_high"]].tolist() == [-1.5, -2.5, -0.5]
    assert by.loc["a+ckpt", "quality_from"].startswith("exact, by test tests/test_translation_techniques.py::")
    assert by.loc[["b+ckpt", "c+ckpt"], "quality_change"].isna().all()  # fp16 is not covered; c has no trained twin


def test_exact_microbatching_carries_its_twins_quality_as_equal_up_to_dropout_draws_and_update_freq_does_not() -> None:
    mb, uf = "--microbatches 16", "--update-freq 16 --max-tokens 250"
    rows = [("baseline", 0, "fp32", 1, "none", "(none)", 0.0), ("checkpoint", 0, "fp32", 1, "layers", "--checkpoint-activations", 0.0),
            ("sparsity-0.9", 0.9, "fp32", 1, "none", "--sparsity 0.9", -0.3),
            ("all-bf16", 0, "all-bf16", 1, "none", "--precision half-bf16", -9.0),
            ("update-freq-16", 0, "fp32", 16, "none", uf, 2.4),
            ("microbatch-16+checkpoint", 0, "fp32", 16, "layers", f"{mb} --checkpoint-activations", None),
            ("sparsity-0.9+microbatch-16", 0.9, "fp32", 16, "none", f"--sparsity 0.9 {mb}", None),
            ("all-bf16+microbatch-16", 0, "all-bf16", 16, "none", f"--precision half-bf16 {mb}", None),
            ("update-freq-16+checkpoint", 0, "fp32", 16, "layers", f"{uf} --checkpoint-activations", None),
            ("update-freq-8", 0, "fp32", 8, "none", "--update-freq 8 --max-tokens 500", None)]
    df = pd.DataFrame(rows, columns=["name", "sparsity", "precision", "microbatch", "checkpoint", "options", "quality_change"])
    df["quality_low"], df["quality_high"], df["quality_n"], df["quality_from"] = df.quality_change - 1, df.quality_change + 1, 1.0, ""
    df.loc[[0, 1], ["quality_low", "quality_high"]] = 0.0  # checkpointing, trained too (stage 08), is exact: 0 [0, 0]
    df["activation_bits"] = 0
    frontier._exact_fill(df, "dynamicconv", quality_model.EXACT_DYNAMICCONV, quality_model.EXACT_DYNAMICCONV_PRECISIONS,
                         quality_model.EQUAL_UP_TO_DROPOUT_DYNAMICCONV, quality_model.EQUAL_UP_TO_DROPOUT_PRECISIONS)
    by = df.set_index("name")
    # The baseline's own update with other dropout draws (not the checkpointed run's, trained beside it): zero, its
    # interval left for the seed noise to give.
    assert by.loc["microbatch-16+checkpoint", "quality_change"] == 0 and by.loc["microbatch-16+checkpoint", ["quality_low", "quality_high"]].isna().all()
    assert by.loc["microbatch-16+checkpoint", "quality_from"] == (
        f"equal up to dropout draws, by test {quality_model.EQUAL_UP_TO_DROPOUT_DYNAMICCONV['microbatch']}; "
        f"{quality_model.EXACT_DYNAMICCONV['checkpoint']}: baseline's run")
    assert by.loc["sparsity-0.9+microbatch-16", ["quality_change", "quality_low", "quality_high"]].tolist() == [-0.3, -1.3, 0.7]
    assert by.loc["sparsity-0.9+microbatch-16", "quality_from"].endswith(": sparsity-0.9's run")
    # bf16 gradients would accumulate the sub-batches in bf16: not covered by the test, not carried.
    assert pd.isna(by.loc["all-bf16+microbatch-16", "quality_change"])
    # update-freq is another batching: it carries only its own run (through checkpointing), never the baseline's.
    assert by.loc["update-freq-16+checkpoint", "quality_change"] == 2.4
    assert by.loc["update-freq-16+checkpoint", "quality_from"].startswith("exact, by test")
    assert pd.isna(by.loc["update-freq-8", "quality_change"])
    f = frontier.widen_by_seed_noise(df, {"sd": 0.18, "seeds": 4})
    assert f.set_index("name").loc["microbatch-16+checkpoint", "quality_high"] == pytest.approx(quality.dropout_draws(0.18, 4).high)


def test_a_wrn_checkpoint_twin_carries_its_run_only_without_compressed_activations() -> None:
    """With activations packed, checkpointing is not exact (a segment's recomputed tensors stay unpacked), so a
    compressed row neither takes nor gives a twin's quality."""
    rows = [("m8", 0, "fp32", 8, "none", 0, -0.1), ("m8+ckpt", 0, "fp32", 8, "block", 0, None),
            ("m8+a8", 0, "fp32", 8, "none", 8, -0.3), ("m8+ckpt+a8", 0, "fp32", 8, "block", 8, None),
            ("m4+ckpt+a2", 0, "fp32", 4, "block", 2, -0.9), ("m4+a2", 0, "fp32", 4, "none", 2, None)]
    df = pd.DataFrame(rows, columns=["name", "sparsity", "precision", "microbatch", "checkpoint", "activation_bits", "quality_change"])
    df["quality_low"], df["quality_high"], df["quality_n"], df["quality_from"] = df.quality_change - 1, df.quality_change + 1, 3.0, ""
    df["optimizer"] = "sgd"
    frontier._exact_fill(df, "wrn")
    by = df.set_index("name")
    assert by.loc["m8+ckpt", "quality_change"] == -0.1 and by.loc["m8+ckpt", "quality_from"].startswith("exact, by test")
    assert by.loc[["m8+ckpt+a8", "m4+a2"], "quality_change"].isna().all()


def test_levers_arms_that_the_grid_holds_are_left_to_the_grid(tmp_path: Path) -> None:
    arm = lambda acc, **tech: {"techniques": tech, "per_seed_acc": acc, "step_s": [0.2], "memory": {"total_mib": 100.0}}  # noqa: E731
    res = {"profile": "cpu", "seeds": [0], "arms": {"baseline": arm([0.9]), "activations-8": arm([0.9], activation_bits=8),
                                                   "optimi-sgd": arm([0.9], optimizer="optimi-sgd")}}
    (tmp_path / "levers_train.json").write_text(json.dumps(res))
    assert frontier.beyond_rows(tmp_path, {json.dumps({"activation_bits": 8})}).name.tolist() == ["optimi-sgd"]


@pytest.mark.parametrize("task, kw, match", [
    ("wrn", {"activation_bits": [0, 3]}, "activation_bits: \\[3\\] not allowed; use 0 \\(off\\) or one of 2, 4, 8, 16"),
    ("wrn", {"activation_bits": [8, 0]}, "must start with its 'off' value"),
    ("dynamicconv", {"activation_bits": [0, 3]}, "combinations_dynamicconv.activation_bits: \\[3\\] not allowed"),
])
def test_a_bad_activation_bits_list_stops_before_any_compute(task: str, kw: dict, match: str) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params[f"combinations_{task}"] = {**params[f"combinations_{task}"], **kw}
    with pytest.raises(ParamError, match=match):
        config.load(f"combinations_{task}", params)


def test_the_prediction_adds_a_compressed_activations_effect_like_any_lossy_lever() -> None:
    cfgs = [{"microbatch": 8, "checkpoint": "block", "activation_bits": 8}, {"activation_bits": 4}]
    memory = pd.DataFrame({"config": [json.dumps(c) for c in cfgs]})
    effects = {**EFFECTS, ("activation_bits", 8): quality.Paired(-0.05, -1, 1, 3, 0.1)}
    pred = quality_model.predict(memory, effects)
    assert pred[0] == pytest.approx(-0.2 - 0.05) and np.isnan(pred[1])


def test_the_report_shows_a_wide_figure_scaled_to_its_width_with_the_aspect_kept(tmp_path: Path) -> None:
    from PIL import Image

    from lowmem.studies import report

    Image.new("RGB", (2800, 700), "white").save(tmp_path / "wide.png")
    Image.new("RGB", (700, 500), "white").save(tmp_path / "narrow.png")
    with Image.open(io.BytesIO(report.shown_png(tmp_path / "wide.png"))) as im:
        assert im.size == (report.REPORT_WIDTH_PX, report.REPORT_WIDTH_PX // 4)
    with Image.open(io.BytesIO(report.shown_png(tmp_path / "narrow.png"))) as im:
        assert im.size == (700, 500)


# --- WRN's optimizer levers in the grid, and the grid's accounting on processes and from its cache ---------------

SMALL_WRN = {"model": "wrn-10-1", "num_classes": 10, "in_channels": 3, "image_size": 32, "batch_size": 16, "device": "cpu"}


def _optimizer_grid(**kw: object) -> combination_grid.CombinationsParams:
    return small(**{"sparsity": [0, 0.9], "precision": ["fp32", "half-bf16", "half-bf16-kahan"], "microbatch": [0, 8],
                    "checkpoint": ["none"], "optimizer": ["sgd", "bnb-sgd8bit"], "search": True,
                    "singles": [{"sparsity": 0.9}], **kw})


def test_the_wrn_grid_holds_8bit_momentum_and_kahan_bf16_as_settings_beyond_the_paper() -> None:
    p = _optimizer_grid()
    g = combination_grid.grid(p)
    # 2 x 3 x 2 x 2 settings, less the 4 that would give Kahan's torch-optimi SGD a second optimizer
    assert len(g) == 24 - 4 and not [c for c in g if c.get("precision") == "half-bf16-kahan" and "optimizer" in c]
    names = [combination_grid.name(p, c) for c in g]
    # named as the levers stages' arms, so their runs and the grid's rows are one configuration
    assert "microbatch-8+bnb-sgd8bit" in names and "sparsity-0.9+half-bf16-kahan+microbatch-8" in names
    kahan = combination_grid.wrn_techniques(p, {"precision": "half-bf16-kahan", "microbatch": 8})
    assert (kahan.precision, kahan.optimizer, kahan.microbatch) == ("half-bf16", "optimi-sgd", 8)
    assert combination_grid.wrn_techniques(p, {"optimizer": "bnb-sgd8bit"}).optimizer == "bnb-sgd8bit"
    table = pd.DataFrame({"config": [json.dumps(c) for c in g], "precision": [c.get("precision", "fp32") for c in g]})
    beyond = quality_model.beyond_paper_rows("wrn", table)
    assert [c for c, b in zip(g, beyond) if b] == [c for c in g if c.get("precision") == "half-bf16-kahan" or "optimizer" in c]
    # the levers stages' arm is the grid's configuration, and back
    assert quality_model.grid_config("wrn", {"precision": "half-bf16", "optimizer": "optimi-sgd"}) == {"precision": "half-bf16-kahan"}
    assert quality_model.techniques_config("wrn", {"precision": "half-bf16-kahan"}) == {"precision": "half-bf16", "optimizer": "optimi-sgd"}


@pytest.mark.parametrize("kw, match", [
    ({"optimizer": ["sgd", "adam"]}, "optimizer: 'adam' is not allowed; use one of sgd, bnb-sgd8bit"),
    ({"optimizer": ["sgd", "optimi-sgd"]}, "Kahan's optimi-sgd is the precision setting half-bf16-kahan"),
    ({"optimizer": ["bnb-sgd8bit", "sgd"]}, "must start with its 'off' value"),
    ({"precision": ["fp32", "mixed-bf16-kahan"]}, "precision: 'mixed-bf16-kahan'.*Kahan's settings: half-bf16-kahan"),
    ({"workers": 0}, "workers must be an integer >= 1"),
    ({"search": False, "optimizer": ["sgd", "bnb-sgd8bit"], "activation_bits": [0], "precision": ["fp32", "half-bf16"]},
     "needs search: true"),
    ({"search": False, "optimizer": ["sgd"], "activation_bits": [0], "precision": ["fp32", "half-bf16-kahan"]},
     "needs search: true"),
    ({"search": False, "optimizer": ["sgd"], "activation_bits": [0], "precision": ["fp32"], "effects_from": ["levers_train"]},
     "effects_from: lever effects are the WRN search's"),
    ({"workers": True}, "workers must be an integer >= 1"),
    ({"effects_from": ["levers_tran"]}, "effects_from: \\['levers_tran'\\] not allowed"),
])
def test_a_bad_optimizer_lever_stops_before_any_compute(kw: dict, match: str) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["combinations_wrn"] = {**params["combinations_wrn"], **kw}
    with pytest.raises(ParamError, match=match):
        config.load("combinations_wrn", params)


def test_dynamicconv_takes_no_optimizer_list_and_a_missing_library_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    bad = {**params, "combinations_dynamicconv": {**params["combinations_dynamicconv"], "optimizer": ["sgd", "bnb-sgd8bit"]}}
    with pytest.raises(ParamError, match="DynamicConv's optimizer levers are precision settings \\(adamw-8bit, all-bf16-kahan\\)"):
        config.load("combinations_dynamicconv", bad)
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find(name, *a))
    params["combinations_wrn"] = {**params["combinations_wrn"], "optimizer": ["sgd", "bnb-sgd8bit"]}
    with pytest.raises(ParamError, match="needs bitsandbytes, which is not installed: `make setup`"):
        config.load("combinations_wrn", params)


def test_the_grid_accounts_its_rows_as_the_accountant_does_kahan_doubling_the_bf16_state() -> None:
    p = _optimizer_grid(wrn=SMALL_WRN)
    rows = {n: combination_memory.wrn_memory_row(p, c) for n, c in [
        ("plain", {"precision": "half-bf16"}), ("kahan", {"precision": "half-bf16-kahan"}), ("bnb", {"optimizer": "bnb-sgd8bit"})]}
    # bf16 momentum, then bf16 momentum and a bf16 compensation per weight
    assert rows["kahan"]["optimizer_mib"] == 2 * rows["plain"]["optimizer_mib"]
    from lowmem.techniques.step import Techniques
    from lowmem.wrn import memory as wrn_memory
    direct = wrn_memory.account(Techniques(optimizer="bnb-sgd8bit", sparse_format=p.sparse_format,
                                           dsr_periods=tuple(p.dsr["dsr_periods"]), dsr_reallocate=p.dsr["dsr_reallocate"]),
                                combination_grid.wrn_shape(p), p.seed)
    assert rows["bnb"]["total_mib"] * 2**20 == direct.peak


def test_a_memory_key_changes_with_each_input_of_the_row_and_with_the_accountant(monkeypatch: pytest.MonkeyPatch) -> None:
    p = _optimizer_grid(wrn=SMALL_WRN)
    configs = [{}, {"optimizer": "bnb-sgd8bit"}, {"precision": "half-bf16-kahan"}, {"sparsity": 0.9}]
    keys, digest = combination_memory.memory_keys(p, configs)
    assert len(set(keys)) == len(configs) and combination_memory.memory_keys(p, configs) == (keys, digest)
    for other in (dataclasses.replace(p, seed=1), dataclasses.replace(p, sparse_format="csr32"),
                  dataclasses.replace(p, wrn={**SMALL_WRN, "batch_size": 8}),
                  dataclasses.replace(p, dsr={**p.dsr, "dsr_reallocate": p.dsr["dsr_reallocate"] + 1})):
        assert not set(combination_memory.memory_keys(other, configs)[0]) & set(keys)
    monkeypatch.setattr(combination_memory, "MEMORY_ROW_FORMAT", combination_memory.MEMORY_ROW_FORMAT + 1)
    moved, moved_digest = combination_memory.memory_keys(p, configs)
    assert moved_digest != digest and not set(moved) & set(keys)
    # A library the grid does not use may be missing: its version is None, not an error.
    real = importlib.metadata.version

    def version(lib: str) -> str:
        if lib == "bitsandbytes":
            raise importlib.metadata.PackageNotFoundError(lib)
        return real(lib)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert combination_memory.memory_keys(p, [{}])[1] not in (digest, moved_digest)


def test_the_accounting_is_the_same_on_two_processes_and_resumes_from_its_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _optimizer_grid(wrn=SMALL_WRN, workers=2)
    configs = [{}, {"optimizer": "bnb-sgd8bit"}, {"precision": "half-bf16-kahan", "microbatch": 8}, {"sparsity": 0.9, "optimizer": "bnb-sgd8bit"}]
    serial = [combination_memory.wrn_memory_row(p, c) for c in configs]
    cache = tmp_path / "wrn_memory.csv"
    assert combination_memory.wrn_memory_rows(p, configs, progress=False, cache=cache) == serial  # spawned processes
    table = pd.read_csv(cache, dtype={"memory_key": str})
    assert list(table.memory_key) == combination_memory.memory_keys(p, configs)[0] and len(set(table.memory_key)) == 4
    # From the cache nothing is accounted again; a row another accountant wrote is; an interruption keeps what was done.
    p.workers = 1
    calls: list[dict] = []
    fail_at = [3]  # the call that is killed
    real = combination_memory.wrn_memory_row

    written_when_killed: list[int] = []  # the rows on disk as the kill comes: what a SIGKILL would leave

    def counted(q: combination_grid.CombinationsParams, cfg: dict) -> dict:
        calls.append(cfg)
        if len(calls) == fail_at[0]:
            written_when_killed.append(len(pd.read_csv(cache)) if cache.exists() else 0)
            raise InterruptedError("killed")
        return real(q, cfg)

    monkeypatch.setattr(combination_memory, "wrn_memory_row", counted)
    assert combination_memory.wrn_memory_rows(p, configs, progress=False, cache=cache) == serial and calls == []
    table.loc[1, "accountant"] = "another"
    table.to_csv(cache, index=False)
    assert combination_memory.wrn_memory_rows(p, configs, progress=False, cache=cache) == serial and calls == [configs[1]]
    cache.unlink()
    calls.clear()
    with pytest.raises(InterruptedError):
        combination_memory.wrn_memory_rows(p, configs, progress=False, cache=cache, every=2)
    assert written_when_killed == [2] and len(pd.read_csv(cache)) == 2  # the first part, written before the interruption
    cache.unlink()  # and within one part, the rows accounted before the error are written as it stops
    calls.clear()
    with pytest.raises(InterruptedError):
        combination_memory.wrn_memory_rows(p, configs, progress=False, cache=cache)
    assert written_when_killed[-1] == 0  # nothing was on disk: the error wrote them
    assert list(pd.read_csv(cache, dtype={"memory_key": str}).memory_key) == combination_memory.memory_keys(p, configs)[0][:2]
    calls.clear()
    fail_at[0] = 0
    assert combination_memory.wrn_memory_rows(p, configs, progress=False, cache=cache) == serial and calls == configs[2:]


def test_the_search_takes_a_levers_stage_arm_as_the_effect_of_a_setting_no_single_trains(tmp_path: Path) -> None:
    p = _optimizer_grid(singles=[{"precision": "half-bf16"}], effects_from=["levers_state_train", "levers_train"])
    arm = lambda acc, **tech: {"techniques": tech, "per_seed_acc": acc}  # noqa: E731
    seeds = p.train_seeds
    base = [0.90 + 0.01 * s for s in seeds]
    recipe = {"model": p.train["model"], "epochs": p.train["epochs"], "batch_size": p.train["batch_size"]}
    state = {"profile": p.profile, "seeds": seeds, **recipe, "arms": {
        "baseline": arm(base), "bnb-sgd8bit": arm([a - 0.005 for a in base], optimizer="bnb-sgd8bit"),
        "optimi-sgd": arm([a - 0.5 for a in base], optimizer="optimi-sgd"),  # not a setting of this grid
        "microbatch-8+bnb-sgd8bit": arm([a - 0.5 for a in base], microbatch=8, optimizer="bnb-sgd8bit")}}  # two settings
    levers = {"profile": p.profile, "seeds": seeds, **recipe, "arms": {
        "baseline": arm([a + 0.1 for a in base]), "half-bf16": arm(base, precision="half-bf16"),
        "half-bf16+optimi-sgd": arm([a + 0.08 for a in base], precision="half-bf16", optimizer="optimi-sgd")}}
    (tmp_path / "levers_state_train.json").write_text(json.dumps(state))
    (tmp_path / "levers_train.json").write_text(json.dumps(levers))
    trained = [{"slot": 0, **_slot("baseline", base, seeds)}, {"slot": 1, **_slot("half-bf16", [a - 0.003 for a in base], seeds)}]
    effects = combination_search.lever_effects(p, trained, tmp_path)
    assert set(effects) == {("precision", "half-bf16"), ("optimizer", "bnb-sgd8bit"), ("precision", "half-bf16-kahan")}
    # the single's own slot wins over the levers stage's arm of the same setting; each arm against its own baseline
    assert effects[("precision", "half-bf16")][1] == "slot 1" and effects[("precision", "half-bf16")][0].mean == pytest.approx(-0.3)
    assert effects[("optimizer", "bnb-sgd8bit")][0].mean == pytest.approx(-0.5)
    assert effects[("optimizer", "bnb-sgd8bit")][1] == "stage levers_state_train"
    assert effects[("precision", "half-bf16-kahan")][0].mean == pytest.approx(-2.0)
    for other in ({"seeds": [7]}, {"epochs": recipe["epochs"] + 1}):  # another sample of runs, another recipe
        (tmp_path / "levers_train.json").write_text(json.dumps({**levers, **other}))
        with pytest.raises(FileNotFoundError, match="rerun stage levers_train"):
            combination_search.lever_effects(p, trained, tmp_path)


def test_a_slot_whose_metrics_hold_the_same_runs_is_kept_and_any_difference_retrains() -> None:
    p = _optimizer_grid()
    chosen = {"slot": 12, "name": "microbatch-8+bnb-sgd8bit", "role": "search maximum",
              "config": {"microbatch": 8, "optimizer": "bnb-sgd8bit"}, "predicted_change": -1.0}
    base = combinations.BaselineParams(**p.train)
    keys = [combinations.store_run(base, s, combination_grid.wrn_techniques(p, chosen["config"], base.batch_size)).key
            for s in p.train_seeds]
    previous = {"task": "wrn", "profile": p.profile, **chosen, "slot": 14, "role": "search 64x", "seeds": p.train_seeds,
                "runs": [{"key": k, "seed": s, "trained": True} for k, s in zip(keys, p.train_seeds)], "per_seed_acc": [0.9]}
    kept = combinations.kept_wrn(p, chosen, previous)
    assert kept["slot"] == 12 and kept["role"] == "search maximum" and kept["per_seed_acc"] == [0.9]
    assert [r["trained"] for r in kept["runs"]] == [False] * len(keys) and all(r["kept"] for r in kept["runs"])
    other = {**chosen, "config": {"microbatch": 8}}
    assert combinations.kept_wrn(p, other, previous) is None  # another configuration
    assert combinations.kept_wrn(p, chosen, {**previous, "runs": [{"key": "0" * 20}]}) is None  # other code or recipe
    assert combinations.kept_wrn(p, chosen, {**previous, "profile": "cpu"}) is None


def test_a_setting_whose_effect_came_from_a_levers_stage_shows_that_arms_quality_and_gives_it_to_its_exact_twin(tmp_path: Path) -> None:
    p = _optimizer_grid(singles=[{"precision": "half-bf16"}])
    configs = [{}, {"precision": "half-bf16"}, {"optimizer": "bnb-sgd8bit"}, {"checkpoint": "block", "optimizer": "bnb-sgd8bit"},
               {"precision": "half-bf16", "optimizer": "bnb-sgd8bit"}]
    rows = [{"name": combination_grid.name(p, c), **{d: c.get(d, getattr(p, d)[0]) for d in quality_model.dims("wrn")},
             "config": json.dumps(c), "techniques": len(c), "total_mib": 100.0 / (1 + i), "reduction": 1.0 + i,
             "time_ratio": 1.0} for i, c in enumerate(configs)]
    pd.DataFrame(rows).to_csv(tmp_path / "wrn_sweep.csv", index=False)
    sel = [{"slot": 0, "name": "baseline", "role": "baseline", "config": {}},
           {"slot": 1, "name": "half-bf16", "role": "single technique", "config": {"precision": "half-bf16"}}]
    (tmp_path / "wrn_selected.json").write_text(json.dumps({"profile": p.profile, "selected": sel}))
    # The search's effect of half-bf16 differs from what its slot measured (-0.5): the table shows the slot's own.
    effects = [{"lever": "precision", "setting": "half-bf16", "change": -0.7, "low": -1.2, "high": -0.2, "n": 3, "from": "slot 1"},
               {"lever": "optimizer", "setting": "bnb-sgd8bit", "change": -0.9, "low": -2.7, "high": 0.9, "n": 3,
                "from": "stage levers_state_train"}]
    (tmp_path / "wrn_search.json").write_text(json.dumps({"profile": p.profile, "seeds": [0, 1, 2], "effects": effects, "selected": []}))
    (tmp_path / "combinations").mkdir()
    for c, acc in zip(sel, ([0.90, 0.91, 0.92], [0.895, 0.905, 0.915])):
        (tmp_path / "combinations" / f"wrn-{c['slot']}.json").write_text(json.dumps(
            {**c, "profile": p.profile, "seeds": [0, 1, 2], "per_seed_acc": acc}))
    got = frontier.results("wrn", tmp_path, tmp_path).set_index("name")
    bnb = got.loc["bnb-sgd8bit"]
    assert (bnb.quality_change, bnb.quality_low, bnb.quality_high, bnb.quality_n) == (-0.9, -2.7, 0.9, 3)
    assert bnb.quality_from == "stage levers_state_train, against its own baseline" and bnb.beyond
    twin = got.loc["checkpoint-block+bnb-sgd8bit"]
    assert twin.quality_change == -0.9 and twin.quality_from.startswith("exact, by test")
    both = got.loc["half-bf16+bnb-sgd8bit"]  # two lossy levers: predicted from the search's effects, not measured
    assert np.isnan(both.quality_change) and both.predicted_change == pytest.approx(-1.6)
    assert got.loc["half-bf16", "quality_change"] == pytest.approx(-0.5) and not got.loc["half-bf16", "beyond"]
    # A table made before the grid had the optimizer dimension is read with it off on every row.
    older = pd.DataFrame(rows[:2]).drop(columns="optimizer")
    older.to_csv(tmp_path / "wrn_sweep.csv", index=False)
    got = frontier.results("wrn", tmp_path, tmp_path)
    assert list(got.optimizer) == ["sgd", "sgd"] and got.quality_change.tolist() == pytest.approx([0.0, -0.5])
