"""lowmem.studies.bleu_noise: the seed spread and the bootstrap's coverage from a result, and the committed result's
guard. The training itself runs in notebook 08 at the smoke profile (nbval)."""

import json
import math
from pathlib import Path

import pytest
from scipy import stats

from lowmem.config import ParamError
from lowmem.dynamicconv.params import TranslationTechniquesParams
from lowmem.studies import bleu_noise


def result(scores: list[float], pairs: list[tuple[float, float]]) -> dict:
    return {"profile": "cpu", "max_update": 600, "bootstrap_resamples": 1000,
            "runs": [{"seed": s, "key": f"k{s}", "trained": True, "sacrebleu": b, "bleu_tokenized": b} for s, b in enumerate(scores)],
            "pairs": [{"seeds": f"p{i}", "change": (lo + hi) / 2, "low": lo, "high": hi} for i, (lo, hi) in enumerate(pairs)]}


def test_the_spread_half_widths_and_coverage_follow_from_the_scores() -> None:
    # sd of 10, 11, 12 is 1; an interval touching zero covers it
    row = bleu_noise.summary_row(result([10.0, 11.0, 12.0], [(-0.5, 0.5), (0.0, 1.0), (0.2, 0.9)]))
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
    p = TranslationTechniquesParams(profile="cpu", max_update=600, noise_seeds=[0, 1, 2])
    with pytest.raises(ParamError, match="python -m lowmem.studies.bleu_noise"):
        bleu_noise.results(p, tmp_path, f)
    assert bleu_noise.results(TranslationTechniquesParams(profile="cpu", max_update=600, noise_seeds=[0, 1]), tmp_path, f)["pairs"]
    with pytest.raises(ParamError, match="is missing"):  # minutes per seed: never trained inside a cpu notebook
        bleu_noise.results(p, tmp_path, tmp_path / "absent.json")


def test_fewer_than_two_seeds_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(ParamError, match="at least 2 seeds"):
        bleu_noise.train(TranslationTechniquesParams(noise_seeds=[0]), tmp_path)


def test_the_figure_marks_each_pair_by_whether_it_holds_zero_and_draws_the_seed_half_widths() -> None:
    res = result([10.0, 11.0, 12.0], [(-0.5, 0.5), (0.2, 0.9), (0.1, 1.0)])
    fig = bleu_noise.figure(res)
    _, pairs, widths = fig.axes
    labels = pairs.get_legend_handles_labels()[1]
    assert labels == ["holds 0: 1 of 3", "excludes 0: 2 of 3"]
    curve = widths.get_lines()[0]
    assert list(curve.get_xdata()) == list(range(2, max(bleu_noise.SEEDS_SHOWN) + 1))
    assert curve.get_ydata()[1] == pytest.approx(bleu_noise.half_width(1.0, 3))
