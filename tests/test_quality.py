"""The paired intervals and the budget rule: coverage by simulation, pairing by seed and by sentence, the rule's edges."""

import math

import numpy as np
import pytest
import sacrebleu
from scipy import stats

from lowmem.studies import quality
from lowmem.studies.quality import Paired


def _coverage(draw, true_mean: float, interval, trials: int = 4000) -> float:
    hits = 0
    for _ in range(trials):
        r = interval(draw())
        hits += r.low <= true_mean <= r.high
    return hits / trials


def test_the_seed_interval_covers_the_true_change_95_percent_of_the_time_even_with_three_seeds() -> None:
    # With 3 seeds a normal (z) interval, or sd/n, or ddof=0, covers far less than 95% (z: about 82%).
    rng = np.random.default_rng(0)
    cov = _coverage(lambda: rng.normal(-0.3, 0.6, size=3), -0.3, quality.paired)
    assert abs(cov - quality.LEVEL) < 0.015, cov  # 4000 trials: the binomial sd is 0.0034


def test_the_per_example_interval_covers_the_true_accuracy_change() -> None:
    # Per example the new model loses (-1) with probability 0.04 and gains (+1) with 0.02: a true change of -0.02.
    rng = np.random.default_rng(1)
    hits, trials = 0, 2000
    for _ in range(trials):
        d = rng.choice([-1, 0, 1], p=[0.04, 0.94, 0.02], size=2000)
        base = np.where(d == -1, 1, np.where(d == 1, 0, rng.random(2000) < 0.85)).astype(int)
        r = quality.per_example((base + d).astype(bool), base.astype(bool))
        hits += r.low <= -0.02 <= r.high
    assert abs(hits / trials - quality.LEVEL) < 0.02, hits / trials


def test_pairs_are_made_by_seed_not_by_position() -> None:
    assert quality.seed_pairs({1: 0.9, 0: 0.8}, {2: 0.5, 0: 0.7, 1: 0.85}) == pytest.approx([0.1, 0.05])
    with pytest.raises(ValueError, match="no shared seeds"):
        quality.seed_pairs({3: 0.9}, {0: 0.7})


def test_one_seed_gives_a_change_but_no_interval_and_never_passes_the_interval_rule() -> None:
    r = quality.paired([-0.1])
    assert r.mean == -0.1 and math.isnan(r.low) and math.isnan(r.high) and r.n == 1
    assert quality.within_budget(r, 0.4, "mean") and not quality.within_budget(r, 0.4, "interval")


def test_the_rule_includes_the_budget_itself_and_nothing_below_it() -> None:
    at = Paired(mean=-0.4, low=-0.4, high=0.0, n=5, sd=0.3)
    below = Paired(mean=-0.4 - 1e-6, low=-0.4 - 1e-6, high=0.0, n=5, sd=0.3)
    for rule in quality.RULES:
        assert quality.within_budget(at, 0.4, rule) and not quality.within_budget(below, 0.4, rule)
    wide = Paired(mean=0.1, low=-0.5, high=0.7, n=5, sd=0.5)  # better on average, but the interval reaches -0.5
    assert quality.within_budget(wide, 0.4, "mean") and not quality.within_budget(wide, 0.4, "interval")
    with pytest.raises(ValueError, match="unknown rule"):
        quality.within_budget(at, 0.4, "median")
    with pytest.raises(ValueError, match=">= 0"):
        quality.within_budget(at, -0.4, "mean")


REFS = ["the cat sat on the mat .", "a dog ran in the park today .", "we like to read good books .",
        "it rained all day long here .", "she plays the piano very well ."] * 8
WORSE = ["the cat is on a mat .", "a dog ran in a park .", "we like reading books .", "it rained all day .",
         "she plays piano well ."] * 8


def test_the_bleu_change_is_sacrebleus_corpus_difference_and_identical_systems_give_exactly_zero() -> None:
    better = [r if i % 5 < 2 else w for i, (r, w) in enumerate(zip(REFS, WORSE))]
    r = quality.bleu_paired(better, WORSE, REFS, resamples=200)
    expected = sacrebleu.corpus_bleu(better, [REFS]).score - sacrebleu.corpus_bleu(WORSE, [REFS]).score
    assert r.mean == pytest.approx(expected, abs=1e-9) and r.low <= r.mean <= r.high and r.n == len(REFS)
    assert r.low > 0  # better on every resample: two fifths of the sentences are exact
    same = quality.bleu_paired(WORSE, WORSE, REFS, resamples=200)
    assert (same.mean, same.low, same.high) == (0.0, 0.0, 0.0)  # one index draw for both systems


def test_bad_inputs_are_refused_with_what_was_given() -> None:
    with pytest.raises(ValueError, match="finite"):
        quality.paired([])
    with pytest.raises(ValueError, match="equal-length"):
        quality.per_example([True, False], [True])
    with pytest.raises(ValueError, match="references"):
        quality.bleu_paired(["a"], ["a", "b"], ["a"])


def _one_seed_pair(rng: np.random.Generator, true: float, seed_sd: float, boot_se: float, noise_seeds: int):
    """One configuration-baseline pair of one seed each, its bootstrap interval, and the seed sd measured on
    ``noise_seeds`` other runs of the baseline: the inputs ``with_seed_noise`` gets from the pipeline."""
    z = float(stats.norm.ppf(0.975))
    d = true + rng.normal(0, seed_sd * math.sqrt(2)) + rng.normal(0, boot_se)
    measured_sd = float(rng.normal(0, seed_sd, size=noise_seeds).std(ddof=1))
    return Paired(d, d - z * boot_se, d + z * boot_se, 1, math.nan), measured_sd


@pytest.mark.parametrize("seed_sd, boot_se", [(0.9, 0.35), (0.2, 0.35)])
def test_the_seed_noise_interval_of_one_seed_covers_the_true_change_95_percent_of_the_time(seed_sd: float, boot_se: float) -> None:
    # Each run of the pair carries the seed noise: without the √2, or with z instead of Satterthwaite's t over 4
    # noise seeds, the first case covers about 85-90%; the bootstrap interval alone covers less in both.
    rng = np.random.default_rng(2)
    pairs = [_one_seed_pair(rng, -0.3, seed_sd, boot_se, 4) for _ in range(4000)]
    cov = float(np.mean([(lambda r: r.low <= -0.3 <= r.high)(quality.with_seed_noise(c, sd, 4)) for c, sd in pairs]))
    boot_only = float(np.mean([c.low <= -0.3 <= c.high for c, _ in pairs]))
    assert abs(cov - quality.LEVEL) < 0.015, cov  # 4000 trials: the binomial sd is 0.0034
    assert boot_only < quality.LEVEL - 0.05, boot_only  # what the headline claimed before


def test_the_seed_noise_interval_reduces_to_each_source_alone() -> None:
    boot = Paired(1.0, 0.2, 1.6, 1, math.nan)  # asymmetric, as a bootstrap's percentiles may be
    none = quality.with_seed_noise(boot, 0.0, 4)  # no seed noise: the bootstrap's width, made symmetric
    assert (none.low, none.high) == pytest.approx((1.0 - 0.7, 1.0 + 0.7), abs=1e-12)
    flat = Paired(1.0, 1.0, 1.0, 1, math.nan)  # no test-set noise: t with the noise study's n - 1 = 3 df
    only = quality.with_seed_noise(flat, 0.5, 4)
    assert only.high - 1.0 == pytest.approx(stats.t.ppf(0.975, 3) * math.sqrt(2) * 0.5, rel=1e-12)
    unknown = Paired(1.0, math.nan, math.nan, 1, math.nan)
    assert quality.with_seed_noise(unknown, 0.5, 4) is unknown
    itself = Paired(0.0, 0.0, 0.0, 1, math.nan)  # the baseline's own run (or its exact twin): no noise to add
    assert quality.with_seed_noise(itself, 0.5, 4) is itself
    with pytest.raises(ValueError, match="two or more seeds"):
        quality.with_seed_noise(boot, 0.5, 1)
