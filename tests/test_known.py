"""How each headline and budget row's quality is known, and what its interval resolves (lowmem.studies.known), and
the headline's GPU column (lowmem.studies.report)."""

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from lowmem.studies import known, report

ROOT = Path(__file__).parents[1]
T = "tests/test_checkpoint.py::test_x"


@pytest.mark.parametrize("source, kind", [
    ("stage combination_wrn@4", "measured"),
    ("stage levers_train, against its own baseline", "measured"),
    (f"exact, by test {T}: baseline's runs", "exact by test"),
    (f"exact, by test {T}: microbatch-16's runs", "carried"),
    (f"exact, by test {T}: update-freq-16's run", "carried"),
    (f"equal up to dropout draws, by test {T}: baseline's run", "equal up to dropout draws"),
    (f"equal up to dropout draws, by test {T}: sparsity-0.9's run", "carried"),
    ("", "not trained"),
])
def test_each_source_is_measured_exact_or_carried(source: str, kind: str) -> None:
    assert known.kind(source) == kind


def test_a_carried_row_names_the_run_it_carries_and_where_that_run_was_trained() -> None:
    d = known.detail(f"exact, by test {T}: update-freq-16's run", 1, {"update-freq-16": "stage translation_kahan_train"}, widened=True)
    assert d == (f"carried from update-freq-16's run (stage translation_kahan_train; 1 seed, paired bootstrap widened by "
                 f"the seed sd); the lever that differs is exact by test ({T})")
    assert known.detail("stage combination_wrn@4", 3, {}) == "measured, 3 seeds (stage combination_wrn@4)"
    assert known.tests_of(f"exact, by test {T}: baseline's runs") == T and known.tests_of("stage x") == ""


def test_a_row_equal_up_to_dropout_draws_is_never_exact_and_its_interval_is_resolved_like_a_measured_one() -> None:
    q = f"equal up to dropout draws, by test {T}: baseline's run"
    assert known.resolution(q, -0.81, 0.81) == "±0.81"  # two seeds' noise (frontier.widen_by_seed_noise), not "exact"
    assert known.verdict("mean", q, -0.81, 0.81, 0.15) == "within budget; not resolved"
    assert known.detail(q, 1, {}).startswith(f"equal up to dropout draws by test ({T})")
    carried = known.detail(f"equal up to dropout draws, by test {T}: sparsity-0.9's run", 1, {"sparsity-0.9": "stage s"})
    assert carried.endswith(f"the levers that differ are equal up to dropout draws or exact by test ({T})")


def test_dropout_draws_are_two_seeds_noise_about_zero() -> None:
    from scipy import stats

    from lowmem.studies import quality

    c = quality.dropout_draws(0.18, 4)
    assert c.mean == 0 and c.low == -c.high
    assert c.high == pytest.approx(stats.t.ppf(0.975, 3) * math.sqrt(2) * 0.18)
    with pytest.raises(ValueError):
        quality.dropout_draws(0.18, 1)


def test_resolution_is_the_half_width_and_the_mean_rule_is_unresolved_past_twice_the_budget() -> None:
    exact = f"exact, by test {T}: baseline's runs"
    assert known.resolution(exact, 0.0, 0.0) == "exact"
    assert known.resolution("stage s", -0.55, 0.23) == "±0.39"
    assert known.resolution("stage s", math.nan, math.nan) == "no interval"
    # 0.78 wide against a budget of 0.4: resolved; 0.82 wide: not; the interval rule is never marked.
    assert known.verdict("mean", "stage s", -0.55, 0.23, 0.4) == "within budget"
    assert known.verdict("mean", "stage s", -0.59, 0.23, 0.4) == "within budget; not resolved"
    assert known.verdict("interval", "stage s", -0.1, 3.0, 0.4) == "within budget"
    assert known.verdict("mean", exact, 0.0, 0.0, 0.4) == "within budget"
    assert known.verdict("mean", "stage s", math.nan, math.nan, 0.4) == "within budget; not resolved"


def test_the_committed_headline_says_how_each_row_is_known_and_what_it_resolves() -> None:
    full = pd.read_csv(ROOT / "figures/00_headline_full.csv").to_dict("records")
    short = pd.read_csv(ROOT / "figures/00_headline.csv")
    assert len(short.columns) <= 8 and len(short) == len(full)
    for f, s in zip(full, short.to_dict("records")):
        budget = float(f["quality budget"].split(" ")[0])  # "0.4 (top-1 accuracy ...)"
        width = f["ours: 95% high"] - f["ours: 95% low"]
        exact = f["resolution"] == "exact"
        assert exact == ("baseline's own runs" in f["how known"]), f
        if not exact:
            assert f["resolution"] == f"±{width / 2:.2f}" or abs(float(f["resolution"][1:]) - width / 2) <= 0.01, f
        if abs(width - 2 * budget) > 0.02:  # the table's rounding cannot move the row across the line
            unresolved = f["rule"] == "mean" and not exact and width > 2 * budget
            assert f["verdict"] == ("within budget; not resolved" if unresolved else "within budget"), f
            assert s["quality change [95%]"].endswith(": not resolved") == unresolved, s
        assert s["how known"].split(",")[0].split(" ")[0] in ("measured", "exact", "equal", "carried"), s
        if s["how known"] == known.DROPOUT:  # never exact: its interval is two seeds' noise about zero
            assert f["resolution"] != "exact" and f["ours: 95% low"] < 0 < f["ours: 95% high"], f
        assert s["how known"].split(" ")[0].rstrip(",") == f["how known"].split(" ")[0].rstrip(","), (s, f)
        if f["task"] == "dynamicconv":
            assert s["measured reduction"] == "not measured (no fairseq on the GPU check)"


def test_the_gpu_column_is_the_measured_baseline_over_the_configuration(tmp_path: Path) -> None:
    (tmp_path / "metrics" / "gpu").mkdir(parents=True)
    g = {"dry": False, "device": "GPU X", "memory": [{"configuration": "baseline", "measured_mib": 600.0},
                                                      {"configuration": "checkpoint-block", "measured_mib": 480.0}]}
    (tmp_path / "metrics" / "gpu" / "gpu_check.json").write_text(json.dumps(g))
    r = report.Report(root=tmp_path, metrics={}, reference={})
    gpu = report.gpu_measured(r)
    assert report.gpu_cell("wrn", "checkpoint-block", gpu) == "1.25x measured (GPU X)"
    assert report.gpu_cell("wrn", "microbatch-8", gpu) == "not measured"
    assert report.gpu_cell("dynamicconv", "checkpoint-block", gpu) == "not measurable (no fairseq on the GPU check)"
    (tmp_path / "metrics" / "gpu" / "gpu_check.json").write_text(json.dumps({**g, "dry": True}))
    assert report.gpu_measured(r) == {}  # a dry run's numbers are the CPU's, never a GPU's


def test_the_measured_column_puts_the_cpu_checks_reduction_beside_the_gpus(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    rows = [{"configuration": "baseline", "measured_reduction": 1.0},
            {"configuration": "checkpoint-block", "measured_reduction": 2.5}]
    (tmp_path / "metrics" / "cpu_check.json").write_text(json.dumps({"cpu": "CPU Y", "rows": rows}))
    r = report.Report(root=tmp_path, metrics={}, reference={})
    cpu, gpu = report.cpu_measured(r), {"checkpoint-block": (1.25, "GPU X")}
    assert report.measured_cell("wrn", "checkpoint-block", gpu, cpu) == "1.25x on GPU X; 2.50x on CPU Y"
    assert report.measured_cell("wrn", "checkpoint-block", {}, cpu) == "2.50x on CPU Y"
    assert report.measured_cell("wrn", "microbatch-8", gpu, cpu) == "not measured"
    assert report.cpu_cell("wrn", "checkpoint-block", cpu) == "2.50x measured (CPU Y)"
    assert report.cpu_measured(report.Report(root=tmp_path / "none", metrics={}, reference={})) == {}


def test_the_headline_shows_the_confirming_run_beside_a_row_carried_through_exact_microbatching(tmp_path: Path) -> None:
    from types import SimpleNamespace

    run = {"max_update": 1400, "seed": 0, "trained": [
        {"technique": "baseline", "sacrebleu_change": 0.0, "sacrebleu_change_low": 0.0, "sacrebleu_change_high": 0.0},
        {"technique": "microbatch-16+checkpoint", "sacrebleu_change": -1.25, "sacrebleu_change_low": -2.14, "sacrebleu_change_high": -0.43}]}
    (tmp_path / "metrics").mkdir()
    (tmp_path / report.MICROBATCH_RUN).write_text(json.dumps(run))
    r = SimpleNamespace(root=tmp_path)
    carried = pd.DataFrame({"our_from": [f"equal up to dropout draws, by test {T}: baseline's run"]})
    text = report.confirming(r, carried)
    assert "microbatch-16+checkpoint -1.25 [-2.14, -0.43] sacreBLEU against its own baseline" in text
    assert "1400 updates, seed 0" in text
    assert report.confirming(r, pd.DataFrame({"our_from": ["stage combination_wrn@4"]})) == ""  # nothing carried so
