"""The proxy-noise study's arithmetic: the half-width is the paired t interval's, the seed counts are the fewest that
reach a target, the budget counts the baseline's runs too, and the test subset is the one the trainer draws."""

import math

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from lowmem import config, runs
from lowmem.config import ParamError
from lowmem.pipeline import train_stage
from lowmem.studies import proxy_noise, quality
from lowmem.wrn.data import subset


def test_the_half_width_is_the_paired_t_interval_of_differences_whose_sd_is_root_two_times_the_seed_sd() -> None:
    d = np.array([0.3, -0.5, 0.9, 0.1, -0.2])
    ci = quality.paired(d)
    sd_single = d.std(ddof=1) / math.sqrt(2)
    assert proxy_noise.half_width(sd_single, len(d)) == pytest.approx(ci.high - ci.mean, rel=1e-12)
    assert proxy_noise.half_width(sd_single, 1) == math.inf


@pytest.mark.parametrize("sd,target", [(0.5, 0.25), (0.27, 0.25), (0.27, 0.4), (1.0, 0.1)])
def test_seeds_needed_is_the_fewest_that_reach_the_target(sd: float, target: float) -> None:
    n = proxy_noise.seeds_needed(sd, target)
    if n is None:
        assert proxy_noise.half_width(sd, proxy_noise.MAX_SEEDS) > target
    else:
        assert proxy_noise.half_width(sd, n) <= target < proxy_noise.half_width(sd, n - 1)


def test_a_seed_costs_one_run_per_configuration_and_one_of_the_baseline() -> None:
    assert proxy_noise.affordable_seeds(600, 10, 5) == 10  # 6 runs of 10 s per seed
    assert proxy_noise.affordable_seeds(599, 10, 5) == 9


def test_the_test_subset_is_the_one_the_trainer_draws() -> None:
    ds = TensorDataset(torch.arange(1000))
    drawn = [int(x[0]) for x in subset(ds, 300, 0)]
    assert proxy_noise.subset_indices(1000, 300).tolist() == drawn
    assert proxy_noise.subset_indices(1000, 0).tolist() == list(range(1000))


def test_packed_correctness_round_trips_at_any_length() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 7, 8, 9, 10_000):
        bits = rng.random(n) < 0.7
        assert (quality.unpack_bits(quality.pack_bits(bits), n) == bits).all()


def _result(vectors: dict[tuple[str, int], np.ndarray]) -> dict:
    return {"profile": "smoke", "runs": [
        {"key": f"{proxy}-{seed}", "labels": {"proxy": proxy}, "seed": seed, "trained": True,
         "test_correct": quality.pack_bits(c),
         "history": [{"test_examples": len(c), "test_acc": float(c.mean()), "test_loss": 1.0, "train_examples": 10, "epoch_s": 2.0}]}
        for (proxy, seed), c in vectors.items()]}


def test_pairs_count_disagreements_and_the_interval_of_two_identical_models_is_zero() -> None:
    a = np.array([True] * 90 + [False] * 10)
    b = a.copy()
    b[:5] = False  # b misses 5 that a gets
    pairs = proxy_noise.pairs_table(_result({("p", 0): a, ("p", 1): a, ("p", 2): b}))
    same = pairs[pairs.seeds == "0-1"].iloc[0]
    assert same.disagree_pct == 0 and same.change == 0 and same.half_width == 0 and same.covers_zero
    other = pairs[pairs.seeds == "0-2"].iloc[0]
    assert other.disagree_pct == pytest.approx(5.0) and other.change == pytest.approx(5.0) and not other.covers_zero


def test_the_summary_spread_is_the_sample_sd_of_the_seeds_accuracies_in_points() -> None:
    p = config.load("proxy_noise", None, proxies=[{"name": "p"}], seeds=[0, 1, 2], test_subset=50)
    rng = np.random.default_rng(1)
    vectors = {("p", s): rng.random(100) < q for s, q in enumerate((0.6, 0.7, 0.8))}
    res = _result(vectors)
    runs_df, pairs = proxy_noise.runs_table(p, res), proxy_noise.pairs_table(res)
    table = proxy_noise.summary(p, runs_df, pairs)
    accs = [100 * v.mean() for v in vectors.values()]
    assert table.sd_full_test.iloc[0] == pytest.approx(np.std(accs, ddof=1))
    sub = proxy_noise.subset_indices(100, 50)
    assert table.sd_subset_test.iloc[0] == pytest.approx(np.std([100 * v[sub].mean() for v in vectors.values()], ddof=1))
    assert table.run_s.iloc[0] == 2.0


def test_frozen_results_refuse_a_file_of_other_runs_and_say_how_to_rerun(tmp_path) -> None:
    p = config.load("proxy_noise", None)
    p.profile = "cpu"  # only smoke runs are made on the spot
    path = tmp_path / "r.json"
    runs.write_json(path, _result({("elsewhere", 0): np.ones(4, dtype=bool)}))
    with pytest.raises(ParamError, match="rerun them: python -m"):
        train_stage.frozen_results("proxy_noise", p, path, proxy_noise.COMMAND)


def test_a_smoke_run_beside_another_profiles_committed_file_leaves_that_file_alone(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LOWMEM_RUNS", str(tmp_path / "store"))
    p = config.load("proxy_noise", None, proxies=[{"name": "1 epoch"}], seeds=[0, 1, 2])
    p.train["data_root"] = str(tmp_path / "raw")
    committed = {**_result({("3 epochs", 0): np.ones(4, dtype=bool)}), "profile": "cpu"}
    path = tmp_path / "proxy_noise_train.json"
    runs.write_json(path, committed)
    res = train_stage.frozen_results("proxy_noise", p, path, proxy_noise.COMMAND, progress=False)
    assert res["profile"] == "smoke" and [r["seed"] for r in res["runs"]] == [0, 1, 2]
    assert runs.read_json(path) == committed and (tmp_path / "proxy_noise_train-smoke.json").exists()


@pytest.mark.parametrize("kw,name", [({"seeds": [0, 1]}, "seeds"), ({"proxies": [{"name": "a", "lr": 1}]}, "proxies"),
                                     ({"proxies": [{"name": "a"}, {"name": "a"}]}, "proxies"), ({"targets": [0]}, "targets")])
def test_bad_proxy_noise_parameters_name_themselves(kw: dict, name: str) -> None:
    with pytest.raises(ParamError, match=name):
        config.load("proxy_noise", None, **kw)
