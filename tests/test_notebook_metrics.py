"""The notebooks' tier: each test runs one notebook at its smoke parameters and asserts on the metrics JSON it wrote.

nbval runs every notebook earlier in the same `make test` (tests/conftest.py orders this file last), and the
``notebook_metrics`` fixture reads what that run wrote; run alone, this file executes the notebook itself through papermill.
What they assert is what a wrong notebook or a wrong study function would get wrong: counts from the model itself,
exact byte ratios, categories that add up, and levers proven exact giving the same accuracy.
"""

import itertools
from collections.abc import Callable

import pytest
import yaml
from scipy import stats

from lowmem import config
from lowmem.studies import combination_grid, proxy_noise, quality_model
from lowmem.wrn.models import build_model

MIB = 2**20


def _bytes(tensors) -> int:  # type: ignore[no-untyped-def]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_01_memory_profile_counts_every_parameter_and_buffer_and_its_categories_add_up(notebook_metrics: Callable[[str, str], dict]) -> None:
    m = notebook_metrics("01_memory_profile", "memory_profile")
    model = build_model(m["model"])
    assert m["parameters"] == sum(p.numel() for p in model.parameters())
    assert m["at_peak_mib"]["model"] == round(_bytes(itertools.chain(model.parameters(), model.buffers())) / MIB, 3)
    assert m["at_peak_mib"]["optimizer"] == round(_bytes(model.parameters()) / MIB, 3)  # one momentum buffer per weight
    parts = sum(v for k, v in m["at_peak_mib"].items() if k != "total")
    assert abs(parts - m["at_peak_mib"]["total"]) <= 0.003  # five values rounded to 3 decimals


def test_02_baseline_reports_every_seed_and_accuracies_that_are_counts_of_test_images(notebook_metrics: Callable[[str, str], dict]) -> None:
    m = notebook_metrics("02_baseline_training", "baseline")
    assert m["seeds"] == config.load("baseline").seeds
    for acc in (m["test_acc_min"], m["test_acc_max"]):
        assert abs(acc * m["test_examples"] - round(acc * m["test_examples"])) < 1e-5 * m["test_examples"]
    assert m["test_acc_min"] <= m["test_acc_mean"] <= m["test_acc_max"]


def test_03_sparsity_stores_dense_weights_gradients_and_momentum_and_less_at_every_level(notebook_metrics: Callable[[str, str], dict]) -> None:
    m = notebook_metrics("03_sparsity", "sparsity")
    model = build_model(m["memory_model"])
    fixed = (_bytes(itertools.chain(model.parameters(), model.buffers())) + 2 * _bytes(model.parameters())) / MIB
    assert abs(m["memory"]["0.0_dense fp32"]["fixed_mib"] - fixed) <= 0.001
    for fmt in ("values 32-bit, indices 32-bit", "values 32-bit, indices 16-bit", "values 16-bit, indices 16-bit"):
        levels = sorted((float(k.split("_")[0]), v["fixed_mib"]) for k, v in m["memory"].items() if k.endswith(fmt))
        assert [f for _, f in levels] == sorted((f for _, f in levels), reverse=True), fmt  # sparser stores less


def test_04_precision_halves_every_byte_in_half_modes_and_bf16_fp16_cost_the_same(notebook_metrics: Callable[[str, str], dict]) -> None:
    m = notebook_metrics("04_low_precision", "precision")
    peak = m["peak_mib"]
    for b in config.load("precision").memory_microbatches:
        # Every stored tensor halves but the int64 labels and BatchNorm's step counters: within 0.1% of half.
        assert abs(2 * peak[f"half-bf16_b{b}"] - peak[f"fp32_b{b}"]) <= 1e-3 * peak[f"fp32_b{b}"]
        assert peak[f"half-bf16_b{b}"] == peak[f"half-fp16_b{b}"] and peak[f"mixed-bf16_b{b}"] == peak[f"mixed-fp16_b{b}"]
    trained = m["trained"]
    assert sorted(trained) == sorted(config.load("precision").train_modes)
    for mode, row in trained.items():  # each change is against fp32's mean accuracy, rounded to 4 places
        assert abs(row["acc_change_vs_fp32"] - (row["test_acc_mean"] - trained["fp32"]["test_acc_mean"])) <= 1.5e-4, mode


def test_05_microbatching_under_groupnorm_is_exact_in_accuracy(notebook_metrics: Callable[[str, str], dict]) -> None:
    m = notebook_metrics("05_microbatching", "microbatching")
    p = config.load("microbatching")
    group = {k: v["test_acc_mean"] for k, v in m["accuracy"].items() if k.startswith("group_")}
    assert len(group) == len(p.train_microbatches)
    images = notebook_metrics("02_baseline_training", "baseline")["test_examples"]  # the same smoke training block
    assert max(group.values()) - min(group.values()) <= 1 / images + 1e-9  # summation order may flip one image


def test_06_checkpointing_recomputes_nothing_without_a_strategy_and_stores_less_with_one(notebook_metrics: Callable[[str, str], dict]) -> None:
    m = notebook_metrics("06_checkpointing", "checkpointing")
    s = m["strategies"]
    assert list(s) == config.load("checkpointing").strategies
    assert s["none"]["extra_forward_flops"] == 0
    fixed = [k for k in s if k == "block" or k == "sqrt" or k.startswith("every-")]
    assert fixed
    for k in fixed:  # each segment's forward runs again in backward: more than nothing, less than a whole forward
        assert 0 < s[k]["extra_forward_flops"] < 1, k
    assert all(v["activations_mib"] < s["none"]["activations_mib"] for k, v in s.items() if k != "none")


def test_07_translation_accounts_what_it_measured(notebook_metrics: Callable[[str, str], dict]) -> None:
    m = notebook_metrics("07_translation", "translation")
    parts = sum(v for k, v in m["at_peak_mib"].items() if k != "total")
    assert abs(parts - m["at_peak_mib"]["total"]) <= 0.003
    assert all(r["accounted_mib"] == r["measured_mib"] for r in m["measured"].values())  # on the CPU, to the byte


def test_08_translation_techniques_fp16_halves_the_weights(notebook_metrics: Callable[[str, str], dict]) -> None:
    m = notebook_metrics("08_translation_techniques", "translation_techniques")
    mem = m["memory_mib"]
    assert abs(2 * mem["fp16"]["model"] - mem["baseline"]["model"]) <= 0.002
    for name, row in mem.items():
        assert abs(sum(row[c] for c in ("model", "gradients", "optimizer", "activations", "other")) - row["total"]) <= 0.003, name
    for name, row in m["bleu"].items():  # the paired bootstrap gives every other run an interval of some width
        if name != "baseline":
            assert row["sacrebleu_change_low"] < row["sacrebleu_change_high"], name
    for name, row in m["bleu"].items():
        assert row["sacrebleu_change_low"] <= row["sacrebleu_change"] <= row["sacrebleu_change_high"], name
    noise = m["bleu_noise"]  # every two seeds are one pair: k seeds give k(k-1)/2
    k = noise["seeds"]
    assert noise["pairs_covering_zero"].endswith(f"/{k * (k - 1) // 2}")


def test_09_combinations_accounts_every_combination_of_the_grid(notebook_metrics: Callable[[str, str], dict]) -> None:
    m = notebook_metrics("09_combinations", "combinations")
    params = yaml.safe_load(config.PARAMS_YAML.read_text())
    for track in ("wrn", "dynamicconv"):  # the committed sweeps, at the profile they name
        p = config.load(f"combinations_{track}", {**params, "base": {**params["base"], "profile": m["profile"][track]}})
        assert m[track]["accounted"] == len(combination_grid.grid(p))
        paper = [c for c in combination_grid.grid(p) if not quality_model.beyond_paper(quality_model.techniques_config(track, c))
                 and c.get("precision") not in quality_model.BEYOND_PAPER_DYNAMICCONV]  # WRN's activations, 8-bit momentum and Kahan; DynamicConv's 8-bit Adam and Kahan
        assert m[track]["accounted_paper_levers"] == len(paper)
        # The rows "the paper's" never pick a combination with a lever beyond the paper: no part of a picked name is
        # the name of a setting beyond the paper (WRN's compressed activations, 8-bit momentum and Kahan's bf16;
        # DynamicConv's precision settings beyond it and its compressed activations).
        beyond = {combination_grid.name(p, {d: v}) for d in quality_model.dims(track) for v in getattr(p, d)[1:]
                  if quality_model.beyond_paper(quality_model.techniques_config(track, {d: v}))
                  or v in quality_model.BEYOND_PAPER_DYNAMICCONV}
        assert {"activations-8", *({"bnb-sgd8bit", "half-bf16-kahan"} if track == "wrn" else {"adamw-8bit", "all-bf16-kahan"})} <= beyond
        picked = [(r["config"] or "").split("+") for b in m[track]["best_within"].values() for r in b.values()]  # names
        assert picked and not any(set(parts) & beyond for parts in picked)
    # DynamicConv's one-seed intervals hold the seed noise of the baseline at least: each is no narrower than
    # z · √2 · seed sd about its change (a bootstrap interval alone was about a third of that at 600 updates).
    noise = m["dynamicconv_seed_noise"]
    if noise is not None:
        rows = [r for rule in ("best_within", "best_within_beyond") for b in m["dynamicconv"].get(rule, {}).values()
                for r in b.values() if r["quality_low"] is not None and r["quality_low"] != r["quality_high"]]
        assert rows, "no one-seed DynamicConv row with an interval to check"
        for r in rows:
            half = stats.norm.ppf(0.975) * 2 ** 0.5 * noise["sd"] - 1e-3  # the metrics round to 4 places
            assert r["quality_high"] - r["quality_change"] >= half and r["quality_change"] - r["quality_low"] >= half, r


def test_10_proxy_noise_narrows_with_seeds_and_needs_more_seeds_for_a_tighter_target(notebook_metrics: Callable[[str, str], dict]) -> None:
    m = notebook_metrics("10_proxy_noise", "proxy_noise")
    for name, px in m["proxies"].items():
        widths = [px[f"half_width_{n}_seeds"] for n in proxy_noise.SEEDS_SHOWN]
        assert all(a > b for a, b in zip(widths, widths[1:])), name
        assert px["half_width_5_seeds"] == pytest.approx(proxy_noise.half_width(px["sd_full_test"], 5), abs=1e-3), name


def test_12_planner_reports_the_accountants_peak_and_only_configurations_that_fit(notebook_metrics: Callable[[str, str], dict]) -> None:
    from lowmem.cli import plan, profile
    from lowmem.studies import crosscheck, planner_params as params  # params: defines stage planner for config.load

    m = notebook_metrics("12_planner", "planner")
    p = config.load("planner")
    for entry in p.models:
        got = m["models"][entry["name"]]
        assert got["peak_bytes"] == profile.account(profile.request(entry)).peak
        assert sum(got["at_peak_bytes"].values()) == got["peak_bytes"]
        assert list(got["budgets"]) == p.budgets
        for budget, b in got["budgets"].items():
            assert not b["fits"] or b["least_peak_bytes"] <= plan.budget_bytes(budget)
        # a budget below the plain step's peak is met, with levers
        assert any(b["fits"] and plan.budget_bytes(budget) < got["peak_bytes"] for budget, b in got["budgets"].items())
    assert m["memtracker_worst_gap_pct"] == 0.0  # the smoke family (1-d convolutions) is accounted exactly
    assert [(r["model"], r["freed_share"]) for r in m["sac"]] == [(e["name"], s) for e in p.sac_models for s in crosscheck.FREED]
    first = m["sac"][0]  # the smallest share is within both tools' reach, and each recomputes something for it
    assert first["dp_gflop"] > 0 and first["sac_gflop"] > 0


def test_13_sharding_reports_per_device_peaks_that_fall_with_devices_and_a_step_equal_to_one_process(notebook_metrics: Callable[[str, str], dict]) -> None:
    m = notebook_metrics("13_sharding", "sharding")
    for setting, got in m["per_device"].items():
        for mode, by_devices in got["by_mode"].items():
            assert all(r["peak_bytes"] < got["single_device_peak_bytes"] for r in by_devices.values()), (setting, mode)
    assert all(r["max_abs_diff"] <= 1e-6 * r["max_abs_step"] for r in m["gloo_run"])
    assert all(abs(r["gap_less_collectives_pct"]) <= 2 for r in m["gloo_run"] if r["mode"] in ("replicate", "optimizer"))
    assert all(abs(r["one_process_gap_pct"]) <= 1e-3 for r in m["gloo_run"] if r["one_process_gap_pct"] is not None)
    for setting, got in m["per_device"].items():  # and falls further with every added device, in every mode
        for mode, by_devices in got["by_mode"].items():
            peaks = [by_devices[d]["peak_bytes"] for d in sorted(by_devices, key=int)]
            assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks), (setting, mode)
