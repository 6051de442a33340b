"""Quality differences with their uncertainty, and the one rule that says whether a configuration is within a budget.

A configuration's quality is reported as a paired difference against the baseline: both are trained with the same
seeds, and the difference of each seed's pair is the sample. Its 95% interval is Student's t on those differences
(``paired``). Two cheaper views of the test split's own noise sit beside it, for one pair of models: per-example
paired correctness for accuracy (``per_example``, the normal approximation to McNemar's test) and sacreBLEU's paired
bootstrap resampling for BLEU (``bleu_paired``). They see the test set's sampling only, never the seed-to-seed noise
of training, so a seed interval is the one the headline uses. Where a configuration has one seed (DynamicConv),
``with_seed_noise`` widens its bootstrap interval by the seed-to-seed spread measured on the baseline elsewhere.

``within_budget`` is the decision rule, stated once: every table and figure that says "within budget" calls it and
prints ``RULES[rule]`` under itself.
"""

from __future__ import annotations

import base64
import math
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sacrebleu.metrics import BLEU
from scipy import stats

LEVEL = 0.95  # two-sided confidence of every interval here

RULES = {
    "mean": "within budget b: the mean paired quality change over seeds is at least -b",
    "interval": f"within budget b: the whole {LEVEL:.0%} interval of the paired quality change lies at or above -b",
}


@dataclass(frozen=True)
class Paired:
    """A paired quality change (configuration minus baseline) over ``n`` samples, with its ``LEVEL`` interval.
    ``low``/``high`` are NaN with one sample: one pair gives a change but no spread."""

    mean: float
    low: float
    high: float
    n: int
    sd: float  # sample standard deviation of the differences (ddof=1); NaN for one sample


def _mean_interval(d: np.ndarray, quantile: float) -> Paired:
    """mean ± quantile · sd / √n of the differences ``d`` (two or more)."""
    n, mean, sd = len(d), float(d.mean()), float(d.std(ddof=1))
    half = quantile * sd / math.sqrt(n)
    return Paired(mean, mean - half, mean + half, n, sd)


def paired(differences: Sequence[float]) -> Paired:
    """Student's t interval of the mean of per-seed paired differences: mean ± t(n-1) · sd / √n."""
    d = np.asarray(differences, dtype=float)
    if d.ndim != 1 or len(d) == 0 or not np.isfinite(d).all():
        raise ValueError(f"paired() needs one or more finite differences, got {list(differences)!r}")
    if len(d) == 1:
        return Paired(float(d[0]), math.nan, math.nan, 1, math.nan)
    return _mean_interval(d, float(stats.t.ppf(0.5 + LEVEL / 2, len(d) - 1)))


def seed_pairs(config: dict[int, float], baseline: dict[int, float]) -> list[float]:
    """The per-seed differences ``config[s] - baseline[s]`` over the seeds both have; an error if they share none."""
    shared = sorted(set(config) & set(baseline))
    if not shared:
        raise ValueError(f"no shared seeds: configuration has {sorted(config)}, baseline {sorted(baseline)}; "
                         "train the configuration with the baseline's seeds")
    return [config[s] - baseline[s] for s in shared]


def per_example(correct: Sequence[bool], baseline_correct: Sequence[bool]) -> Paired:
    """Accuracy difference of two models on the same test examples, with the normal interval of the mean of the
    per-example differences (each -1, 0 or +1): the interval McNemar's test inverts. Only the examples on which
    the two disagree carry information, which is why this is narrower than comparing two accuracies unpaired."""
    a, b = np.asarray(correct, dtype=float), np.asarray(baseline_correct, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise ValueError(f"per_example() needs two equal-length vectors of at least 2 examples, got {a.shape} and {b.shape}")
    return _mean_interval(a - b, float(stats.norm.ppf(0.5 + LEVEL / 2)))


def pack_bits(correct: Sequence[bool]) -> str:
    """Per-example correctness as text for a JSON result: packed bits in base64 (10k examples in 1.7 kB)."""
    return base64.b64encode(np.packbits(np.asarray(correct, dtype=bool)).tobytes()).decode()


def unpack_bits(text: str, examples: int) -> np.ndarray:
    """``pack_bits``'s inverse: the first ``examples`` bits as a bool vector."""
    return np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8), count=examples).astype(bool)


def bleu_paired(hypotheses: Sequence[str], baseline: Sequence[str], references: Sequence[str],
                resamples: int = 1000, seed: int = 12345, lowercase: bool = False) -> Paired:
    """sacreBLEU's paired bootstrap resampling of the test set: the BLEU change of ``hypotheses`` over ``baseline``
    (detokenized sentences, against the same ``references``; ``lowercase`` as sacreBLEU's option) and its ``LEVEL``
    interval over the resamples.
    sacreBLEU draws the same sentence indices for both systems, which is what makes it paired."""
    if not (len(hypotheses) == len(baseline) == len(references)):
        raise ValueError(f"{len(hypotheses)} and {len(baseline)} hypotheses for {len(references)} references")
    bleu = BLEU(lowercase=lowercase)
    # The resampling of sacreBLEU's PairedTest (significance._paired_bs_test): per-sentence sufficient statistics,
    # one index draw shared by both systems, BLEU recomputed from summed statistics. PairedTest returns a p-value
    # and each system's own interval, not the interval of the difference, so the difference is taken here.
    # float64 rather than sacreBLEU's float32: the counts are integers, and then the full-set change is exactly
    # corpus_bleu's.
    refs = [list(references)]
    sys_stats = np.array(bleu._extract_corpus_statistics(list(hypotheses), refs), dtype="float64")
    base_stats = np.array(bleu._extract_corpus_statistics(list(baseline), refs), dtype="float64")
    idx = np.random.default_rng(seed).choice(len(references), size=(resamples, len(references)), replace=True)

    def score(s: np.ndarray) -> float:
        return float(bleu._compute_score_from_stats(s.sum(0)).score)

    deltas = np.array([score(sys_stats[i]) - score(base_stats[i]) for i in idx])
    full = score(sys_stats) - score(base_stats)
    tail = (1 - LEVEL) / 2
    low, high = np.quantile(deltas, [tail, 1 - tail])
    return Paired(float(full), float(low), float(high), len(references), float(deltas.std(ddof=1)))


def seed_scores(noise: dict, updates: int) -> list[float]:
    """Each seed's sacreBLEU at ``updates`` in a result of stage bleu_noise_train (``runs[].scores[]``), in seed
    order; an error naming the lengths it has when ``updates`` is not one of them."""
    if updates not in noise["updates"]:
        raise ValueError(f"the noise study decoded at {noise['updates']} updates, not {updates}")
    got = [[s["sacrebleu"] for s in r["scores"] if s["updates"] == updates] for r in noise["runs"]]
    if not all(got):
        raise ValueError(f"seeds {[r['seed'] for r, g in zip(noise['runs'], got) if not g]} have no score at {updates} updates")
    return [g[0] for g in got]


def dropout_draws(seed_sd: float, seeds: int) -> Paired:
    """The baseline against itself trained with other dropout draws (DynamicConv's exact microbatching, equal to the
    baseline's update up to them): zero, with two runs' seed noise as its interval, as ``with_seed_noise`` would give
    a pair without a bootstrap (Student's t at ``seeds`` - 1 degrees of freedom). Wide: other dropout draws are less
    than another seed (the initial weights and the batches' order stay)."""
    if seeds < 2 or not (math.isfinite(seed_sd) and seed_sd >= 0):
        raise ValueError(f"the seed sd needs a finite value >= 0 from two or more seeds, got {seed_sd} from {seeds}")
    se = math.sqrt(2) * seed_sd
    half = float(stats.t.ppf(0.5 + LEVEL / 2, seeds - 1)) * se
    return Paired(0.0, -half, half, 1, se)


def with_seed_noise(change: Paired, seed_sd: float, seeds: int) -> Paired:
    """One seed's paired-bootstrap ``change`` (``bleu_paired``), its interval widened by training's seed-to-seed noise:
    ``seed_sd``, the sd of the baseline's quality over ``seeds`` seeds, measured at the same length elsewhere (stage
    bleu_noise_train). Both runs of the pair carry that noise, taken as independent (same-seed runs are correlated,
    so this is the wide case), and the test set's sampling adds the bootstrap's variance:
    se² = se_b² + 2 · seed_sd², with se_b from the bootstrap interval as (high - low) / (2 · z). The quantile is
    Student's t at Welch-Satterthwaite's degrees of freedom, se⁴ / ((2 · seed_sd²)² / (seeds - 1)), since only the
    seed variance is estimated from few samples. The interval is symmetric about the full test set's change.
    No bootstrap interval (NaN) stays NaN. A change of zero with a zero-width interval stays as it is: that is the
    baseline's own run against itself (or its exact twin's, whose output is the same), zero in every seed too.
    Assumed: the configuration's seed sd is the baseline's (a lossy lever may make training noisier, which this
    cannot see). Wide on two counts: the pair's runs share a seed, and the seed sd, measured on one fixed test set,
    already holds the seed-by-sentence part that the bootstrap's variance counts too."""
    if seeds < 2 or not (math.isfinite(seed_sd) and seed_sd >= 0):
        raise ValueError(f"the seed sd needs a finite value >= 0 from two or more seeds, got {seed_sd} from {seeds}")
    if math.isnan(change.low) or math.isnan(change.high) or change.low == change.high == change.mean == 0:
        return change
    z = float(stats.norm.ppf(0.5 + LEVEL / 2))
    var_boot, var_seed = ((change.high - change.low) / (2 * z)) ** 2, 2 * seed_sd ** 2
    se = math.sqrt(var_boot + var_seed)
    df = math.inf if var_seed == 0 else se ** 4 / (var_seed ** 2 / (seeds - 1))
    half = float(stats.t.ppf(0.5 + LEVEL / 2, df)) * se
    return Paired(change.mean, change.mean - half, change.mean + half, change.n, se)


def within_budget(change: Paired, budget: float, rule: str) -> bool:
    """The decision rule (``RULES``): ``budget`` is the quality one may lose (0.4 points, 0.15 BLEU), ``change``
    the paired change in the same unit. The interval rule is False where there is no interval (one seed)."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; use one of {', '.join(RULES)}")
    if budget < 0:
        raise ValueError(f"a budget is the quality one may lose, >= 0; got {budget}")
    floor = -budget - 1e-12  # -b itself is within, whatever the float rounding
    if rule == "mean":
        return change.mean >= floor
    return not math.isnan(change.low) and change.low >= floor


# --- what n seeds can resolve (notebooks 08 and 10) ---

MAX_SEEDS = 200  # seeds_needed's search stops here: past it the proxy cannot reach the target at any sensible cost


def half_width(sd_single: float, n: int) -> float:
    """The 95% half-width, in the unit of ``sd_single``, of a mean paired difference over ``n`` seeds, where one
    pair's difference has sd √2 · ``sd_single``."""
    if n < 2:
        return math.inf
    return float(stats.t.ppf(0.5 + LEVEL / 2, n - 1)) * math.sqrt(2) * sd_single / math.sqrt(n)


def seeds_needed(sd_single: float, target: float) -> int | None:
    """The fewest seeds whose ``half_width`` is at most ``target``; None past ``MAX_SEEDS``."""
    for n in range(2, MAX_SEEDS + 1):
        if half_width(sd_single, n) <= target:
            return n
    return None


def sd_interval(sd: float, n: int) -> tuple[float, float]:
    """The 95% interval of a normal population's sd from a sample sd of ``n`` values (chi-square)."""
    tail = (1 - LEVEL) / 2
    return (sd * math.sqrt((n - 1) / stats.chi2.ppf(1 - tail, n - 1)), sd * math.sqrt((n - 1) / stats.chi2.ppf(tail, n - 1)))


def machine() -> str:
    """The CPU a study's runs trained on, as the kernel names it (Linux), else Python's guess. The same seed trains
    to other numbers on another CPU (its kernels round differently), so a study records it and pairs runs only within
    one machine's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
