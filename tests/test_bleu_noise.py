"""lowmem.studies.bleu_noise: the seed spread and the bootstrap's coverage from a result, and the committed result's
guard. The training itself runs in notebook 08 at the smoke profile (nbval)."""

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from scipy import stats

from lowmem.config import ParamError
from lowmem.dynamicconv.params import TranslationTechniquesParams
from lowmem.studies import bleu_noise


def result(scores: list[float], pairs: list[tuple[float, float]], updates: tuple[int, ...] = (600,)) -> dict:
    """A stage result: seed i scores ``scores[i] + j`` at the j-th update count; ``pairs`` at every count."""
    return {"profile": "cpu", "max_update": 600, "updates": list(updates), "bootstrap_resamples": 1000,
            "runs": [{"seed": s, "key": f"k{s}", "trained": True,
                      "scores": [{"updates": u, "sacrebleu": b + j, "bleu_tokenized": b + j} for j, u in enumerate(updates)]}
                     for s, b in enumerate(scores)],
            "pairs": [{"updates": u, "seeds": f"p{i}", "change": (lo + hi) / 2, "low": lo, "high": hi}
                      for u in updates for i, (lo, hi) in enumerate(pairs)]}


def test_the_spread_half_widths_and_coverage_follow_from_the_scores() -> None:
    # sd of 10, 11, 12 is 1; an interval touching zero covers it
    row = bleu_noise.summary_row(result([10.0, 11.0, 12.0], [(-0.5, 0.5), (0.0, 1.0), (0.2, 0.9)]), 600)
    assert row["seed_sd"] == pytest.approx(1.0) and row["sacrebleu_mean"] == pytest.approx(11.0)
    assert row["pairs_covering_zero"] == "2/3"
    assert row["bootstrap_half_width"] == pytest.approx(0.5)  # median of 0.5, 0.5, 0.35
    t = stats.t.ppf(0.975, 2)
    assert row["half_width_3_seeds"] == pytest.approx(t * math.sqrt(2) / math.sqrt(3))
    # ±0.3 with sd 1: the fewest n with t(n-1)·√2/√n <= 0.3
    n = row["seeds_for_0.3"]
    assert stats.t.ppf(0.975, n - 1) * math.sqrt(2 / n) <= 0.3 < stats.t.ppf(0.975, n - 2) * math.sqrt(2 / (n - 1))
    assert row["coverage_p"] == pytest.approx(stats.binomtest(2, 3, 0.95).pvalue)


def test_a_committed_result_for_other_seeds_is_refused_with_the_command(tmp_path: Path) -> None:
    f = tmp_path / "bleu_noise_train.json"
    f.write_text(json.dumps(result([10.0, 11.0], [(-1.0, 1.0)])))
    p = TranslationTechniquesParams(profile="cpu", max_update=600, noise_seeds=[0, 1, 2], noise_updates=[600])
    with pytest.raises(ParamError, match="python -m lowmem.pipeline bleu-noise"):
        bleu_noise.results(p, tmp_path, f)
    longer = TranslationTechniquesParams(profile="cpu", max_update=600, noise_seeds=[0, 1], noise_updates=[600, 1000])
    with pytest.raises(ParamError, match="noise_updates"):  # other lengths than the committed ones
        bleu_noise.results(longer, tmp_path, f)
    same = TranslationTechniquesParams(profile="cpu", max_update=600, noise_seeds=[0, 1], noise_updates=[600])
    assert bleu_noise.results(same, tmp_path, f)["pairs"]
    with pytest.raises(ParamError, match="is missing"):  # minutes per seed: never trained inside a cpu notebook
        bleu_noise.results(p, tmp_path, tmp_path / "absent.json")


def test_each_update_count_is_summarized_from_its_own_scores_and_pairs() -> None:
    res = result([10.0, 11.0, 14.0], [(-0.5, 0.5), (0.0, 1.0), (0.2, 0.9)], updates=(600, 1000))
    res["runs"][2]["scores"][1]["sacrebleu"] = 13.0  # at 1000: 11, 12, 13 (sd 1); at 600: 10, 11, 14
    res["pairs"][3]["low"] = 0.1  # at 1000, the first pair no longer holds zero
    table = bleu_noise.summary(res)
    assert list(table.updates) == [600, 1000]
    assert table.seed_sd.tolist() == pytest.approx([statistics.stdev([10.0, 11.0, 14.0]), 1.0])
    assert table.sacrebleu_mean.tolist() == pytest.approx([35 / 3, 12.0])
    assert table.pairs_covering_zero.tolist() == ["2/3", "1/3"]
    m = bleu_noise.metrics(res)  # the techniques' length leads; every length is below it
    assert m["seed_sd"] == pytest.approx(round(statistics.stdev([10.0, 11.0, 14.0]), 3))
    assert m["by_updates"]["1000"]["seed_sd"] == 1.0 and m["updates"] == [600, 1000]


def test_a_seeds_minutes_come_from_fairseqs_clock_and_price_each_target(tmp_path: Path) -> None:
    # fairseq keeps its clock in every checkpoint it saves (the trainer's extra_state)
    torch.save({"model": {}, "extra_state": {"previous_training_time": 312.5, "train_iterator": {}}}, tmp_path / "c.pt")
    assert bleu_noise.wall_seconds(tmp_path / "c.pt") == 312.5
    res = result([10.0, 11.0, 12.0], [(-0.5, 0.5), (0.0, 1.0), (0.2, 0.9)])
    for r, w in zip(res["runs"], (240.0, 300.0, 600.0)):
        r["scores"][0]["wall_s"] = w
    row = bleu_noise.summary_row(res, 600)
    assert row["minutes_per_seed"] == 5.0  # the median seed's
    assert row["minutes_for_0.3"] == row["seeds_for_0.3"] * 5.0
    # Two lengths: the longer one is half as noisy at twice the minutes, so it prices ±0.3 lower.
    two = result([10.0, 11.0, 12.0], [(-0.5, 0.5), (0.0, 1.0), (0.2, 0.9)], updates=(600, 1200))
    for r, base in zip(two["runs"], (10.0, 11.0, 12.0)):
        r["scores"][0]["wall_s"], r["scores"][1]["wall_s"] = 300.0, 600.0
        r["scores"][1]["sacrebleu"] = 20 + (base - 11.0) / 2
    table = bleu_noise.summary(two)
    assert table["minutes_for_0.3"].iloc[1] < table["minutes_for_0.3"].iloc[0]
    assert bleu_noise.metrics(two)["cheapest_length_for_0.3"] == 1200
    assert bleu_noise.metrics(result([10.0, 11.0], [(-1.0, 1.0)]))["cheapest_length_for_0.3"] is None  # no minutes


def test_update_counts_must_rise_and_hold_the_techniques_run_length() -> None:
    for bad in ([], [1000, 600], [600, 600], [0, 600], [300, 900]):
        with pytest.raises(ParamError, match="noise_updates"):
            TranslationTechniquesParams(max_update=600, noise_updates=bad)


def test_fewer_than_two_seeds_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(ParamError, match="at least 2 seeds"):
        bleu_noise.train(TranslationTechniquesParams(noise_seeds=[0]), tmp_path)


def test_the_figure_marks_each_pair_by_whether_it_holds_zero_and_draws_the_seed_half_widths() -> None:
    res = result([10.0, 11.0, 12.0], [(-0.5, 0.5), (0.2, 0.9), (0.1, 1.0)], updates=(600, 1000))
    res["runs"][2]["scores"][1]["sacrebleu"] = 15.0  # at 1000: 11, 12, 15
    fig = bleu_noise.figure(res)
    seeds, pairs, widths = fig.axes
    assert [list(line.get_ydata()) for line in seeds.get_lines()] == [[10.0, 11.0], [11.0, 12.0], [12.0, 15.0]]
    labels = pairs.get_legend_handles_labels()[1]
    assert labels == ["holds 0: 2 of 6 (all lengths)", "excludes 0: 4 of 6 (all lengths)"]
    assert len(pairs.get_yticklabels()) == 6
    at600, at1000 = widths.get_lines()[:2]
    assert list(at600.get_xdata()) == list(range(2, max(bleu_noise.SEEDS_SHOWN) + 1))
    assert at600.get_ydata()[1] == pytest.approx(bleu_noise.half_width(1.0, 3))
    assert at1000.get_ydata()[1] == pytest.approx(bleu_noise.half_width(statistics.stdev([11.0, 12.0, 15.0]), 3))
    assert widths.get_legend_handles_labels()[1] == ["600 updates", "1000 updates"]
