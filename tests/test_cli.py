"""`lowmem profile` and `lowmem plan` (lowmem.cli): the accountant on models no one here wrote, against the real
tensors' account and PyTorch's profiler; the budget's units; the plan's filters and Pareto set; bad input."""

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from lowmem.cli import main, models, plan, profile
from lowmem.cli.models import SpecError
from lowmem.cli.profile import Request
from lowmem.memory.accounting import account_step
from lowmem.techniques import checkpoint
from lowmem.techniques.step import Techniques

# Families the accountant counts exactly at a small size, and a token-id input where it takes one.
EXACT_FAMILIES = {
    "residual CNN": Request("torchvision:resnet18", 4, (3, 32, 32), "adamw"),
    "depthwise + squeeze-excitation CNN": Request("torchvision:mobilenet_v3_small", 4, (3, 32, 32), "adamw"),
    "1-d convolutions": Request("lowmem.cli.examples:conv1d", 4, (8, 128), "adam"),
    "attention (nn.TransformerEncoder, embeddings)": Request("lowmem.cli.examples:transformer", 4, (32,), "adamw", vocab=1000),
    "recurrent (nn.GRU)": Request("lowmem.cli.examples:gru", 4, (32,), "adam", vocab=1000),
}


def _real_account(req: Request, tech: Techniques = Techniques()) -> int:
    step, model, opt, batch = profile.step_of(req, tech, "cpu")
    return account_step(step, model, opt, batch).peak


@pytest.mark.parametrize("family", sorted(EXACT_FAMILIES))
def test_meta_account_equals_the_real_tensor_account_and_the_profiler(family):
    req = EXACT_FAMILIES[family]
    report, with_workspace = profile.measure(req)
    assert report.peak == _real_account(req)
    # The CPU's op workspace (oneDNN's scratch) is the rest: with it the account is the profiler's peak within 2%.
    assert abs(with_workspace - report.measured_peak) <= 0.02 * report.measured_peak


def test_an_lstm_is_named_as_not_exact_and_really_is_not():
    req = Request("lowmem.cli.examples:lstm", 4, (32,), "adam", vocab=1000)
    notes = profile.gap_notes(models.build(req.spec, "meta"))
    assert len(notes) == 1 and "nn.LSTM" in notes[0]
    assert profile.account(req).peak != _real_account(req)  # the gap the note names is real
    assert profile.gap_notes(models.build(EXACT_FAMILIES["residual CNN"].spec, "meta")) == []


@pytest.mark.parametrize("name", ["regnet_y_400mf", "googlenet"])
def test_torchvision_models_that_lay_out_with_tensors_or_train_auxiliary_heads_profile(name):
    # RegNet computes its widths with torch.arange and .tolist(), which meta tensors cannot; GoogLeNet returns its
    # auxiliary heads' logits beside the main ones in training, and those heads train too.
    req = Request(f"torchvision:{name}", 2, (3, 64, 64), "sgd-momentum")
    assert profile.account(req).peak == _real_account(req)
    step, model, opt, _ = profile.step_of(req, Techniques(), "cpu")
    step(lambda _: None)
    heads = [p for n, p in model.named_parameters() if n.startswith("model.aux")]
    assert (name == "googlenet") == bool(heads) and all(p.grad is not None and p in opt.state for p in heads)


def test_attention_is_accounted_on_fake_cpu_tensors_not_meta():
    # The meta device's attention saves the whole attention matrix; the CPU's flash kernel does not. Fake CPU
    # tensors take the CPU's kernel, as the real step does.
    req = EXACT_FAMILIES["attention (nn.TransformerEncoder, embeddings)"]
    assert profile.account(req).peak == _real_account(req) != profile.account(req, shapes="meta").peak


@pytest.mark.parametrize("optimizer", ["adamw-8bit", "bnb-sgd8bit"])
def test_8bit_optimizer_state_is_accounted_on_fake_tensors_as_on_real_ones_and_as_the_profiler_sees_it(optimizer):
    """bitsandbytes' state is built on fake tensors as on real ones; its CPU kernel dequantizes each parameter's state
    to fp32 temporaries, which the account leaves out (a fused GPU kernel has none) and the CPU workspace adds."""
    req = Request("torchvision:resnet18", 4, (3, 32, 32), optimizer)
    report, with_workspace = profile.measure(req)
    assert report.peak == _real_account(req)
    assert with_workspace == report.measured_peak > report.peak


def test_adafactor_is_accounted_on_meta_as_on_real_tensors():
    req = Request("torchvision:resnet18", 4, (3, 32, 32), "adafactor")
    assert profile.account(req).peak == _real_account(req)


@pytest.mark.parametrize("tech", [Techniques(precision="half-bf16"), Techniques(checkpoint="block"),
                                  Techniques(microbatch=2), Techniques(activation_bits=4)])
@pytest.mark.parametrize("family", ["residual CNN", "depthwise + squeeze-excitation CNN"])
def test_levers_are_accounted_on_meta_as_on_real_tensors(tech, family):
    # MobileNetV3 holds in-place activations: its checkpointed chains must leave them whole (profile.chains).
    req = EXACT_FAMILIES[family]
    assert profile.account(req, tech).peak == _real_account(req, tech)


def test_checkpointing_finds_the_chains_of_blocks():
    assert [name for _, name, _ in profile.chains(models.build(models.parse("torchvision:resnet50"), "meta"))] == \
        ["layer1", "layer2", "layer3", "layer4"]
    assert [name for _, name, _ in profile.chains(models.build(models.parse("torchvision:vit_b_16"), "meta"))] == ["layers"]
    req = EXACT_FAMILIES["residual CNN"]
    assert profile.account(req, Techniques(checkpoint="block")).category_max["activations"] < \
        profile.account(req).category_max["activations"]


@pytest.mark.parametrize("text,expected", [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                           ("64KB", 64_000), ("100B", 100)])
def test_budget_units(text, expected):
    assert plan.budget_bytes(text) == expected


@pytest.mark.parametrize("text", ["4", "4 gigs", "GiB", "-1GiB", "4gib"])
def test_a_bad_budget_names_the_units(text):
    with pytest.raises(SpecError, match="KiB, MiB, GiB"):
        plan.budget_bytes(text)


SMALL = plan.Levers(precision=("fp32", "half-bf16"), checkpoint=("none", "planned"), activation_bits=(0, 4),
                    optimizer_state=("given",), step=("plain",), microbatch_steps=2)


def test_plan_keeps_what_fits_and_its_pareto_set():
    req = Request("wrn:wrn-10-1", 8, (3, 32, 32), "sgd-momentum")
    full = profile.account(req).peak
    cache: dict = {}  # the accounted configurations, shared by the plans of this request, as the planner's stage does
    p = plan.make_plan(req, full // 2, progress=False, levers=SMALL, cache=cache)
    assert (p.fitting.peak_bytes <= full // 2).all() and len(p.fitting) >= 1
    # Each fitting row's microbatch is the largest that fits: twice as large does not (or it is the whole batch).
    for r in p.fitting.itertuples():
        if r.microbatch < req.batch:
            larger = Techniques(precision=r.precision, activation_bits=r.tech.activation_bits,
                                microbatch=0 if 2 * r.microbatch == req.batch else 2 * r.microbatch)
            if r.checkpoint == "none":
                assert profile.account(req, larger).peak > full // 2
    # Pareto: no fitting row is at least as good as another in all three costs and better in one.
    pts = p.fitting[["peak_bytes", "time", "risk_key"]].to_numpy()
    assert not any((q <= r).all() and (q < r).any() for i, r in enumerate(pts) for j, q in enumerate(pts) if i != j)
    # Every row's peak is the account of its configuration, its checkpoint placement included.
    for row in p.fitting.itertuples():
        assert profile.account(req, row.tech, segments=row.segments).peak == row.peak_bytes
    exact = plan.make_plan(req, full, exact_only=True, progress=False, levers=SMALL, cache=cache).fitting
    assert set(exact.quality_risk) == {"exact"} and set(exact.precision) == {"fp32"}
    # --max-loss filters on the low end of each row's interval, not on its mean.
    every = plan.make_plan(req, full, progress=False, levers=SMALL, cache=cache).rows
    kept = plan.make_plan(req, full, max_loss=1.0, progress=False, levers=SMALL, cache=cache).fitting
    assert (kept.predicted_low >= -1.0).all() and (every.predicted_low < -1.0).any()


def test_the_planned_placement_is_the_least_recompute_that_fits():
    # WRN-16-2 at a budget between the plain step's peak and the most checkpointed step's: some checkpointing is
    # needed, and of the DP's front the placement is the one of least recompute that fits by the accountant.
    req = Request("wrn:wrn-16-2", 16, (3, 32, 32), "sgd-momentum")
    plain = profile.account(req).peak
    costs, lengths, _ = profile.chain_costs(req, Techniques(), 16)
    front = checkpoint.frontier(costs, lengths)
    least = min(profile.account(req, segments=checkpoint.split(s, lengths)).peak for _, _, s in front)
    budget = (plain + least) // 2
    levers = plan.Levers(precision=("fp32",), checkpoint=("planned",), activation_bits=(0,), optimizer_state=("given",),
                         step=("plain",), microbatch_steps=1)
    p = plan.make_plan(req, budget, progress=False, levers=levers)
    (row,) = p.fitting.itertuples()
    assert row.checkpoint == "planned" and row.peak_bytes <= budget
    rec = sum(sum(c.flops for c in costs[s:e]) for s, e, on in [seg for chain in row.segments for seg in chain] if on)
    assert row.recompute == rec / plan.step_flops(req, "none")
    # No placement on the front with less recompute fits.
    for _, r, segs in front:
        if r < rec:
            assert profile.account(req, segments=checkpoint.split(segs, lengths)).peak > budget
    assert "checkpoint_chains(model, segments=[[" in row.how_to_apply


def test_the_optimizer_state_lever_swaps_the_optimizer_and_its_measured_risk():
    from lowmem.studies import levers as lever_study

    req = Request("wrn:wrn-10-1", 8, (3, 32, 32), "sgd-momentum")
    levers = plan.Levers(precision=("fp32", "half-bf16"), checkpoint=("none",), activation_bits=(0,), step=("plain",),
                         microbatch_steps=1)
    # Kahan only under 16-bit weights; every other setting once per optimizer state.
    assert [(t.precision, o) for t, _, o in plan.grid(req, True, levers)] == [
        ("fp32", "sgd-momentum"), ("fp32", "bnb-sgd8bit"), ("half-bf16", "sgd-momentum"), ("half-bf16", "bnb-sgd8bit"),
        ("half-bf16", "optimi-sgd")]
    assert [o for *_, o in plan.grid(Request("wrn:wrn-10-1", 8, (3, 32, 32), "adam"), True, levers)] == ["adam", "adam"]
    # The user's own optimizer is the reference: stepping with bitsandbytes' SGD8bit from the start is not a swap.
    own = plan.make_plan(dataclasses.replace(req, optimizer="bnb-sgd8bit"), 2**40, progress=False,
                         levers=dataclasses.replace(levers, precision=("fp32",), optimizer_state=("given",))).rows
    assert list(own.quality_risk) == ["exact"]
    with pytest.raises(ValueError, match="optimizer_state"):
        plan.grid(req, True, plan.Levers(optimizer_state=("4-bit",)))
    sharded = Request("wrn:wrn-10-1", 8, (3, 32, 32), "sgd-momentum", devices=2, shard="full")
    assert {o for *_, o in plan.grid(sharded, True, levers)} == {"sgd-momentum"}  # no swap over devices
    rows = plan.make_plan(req, 2**40, progress=False, levers=levers).rows.set_index(["precision", "optimizer"])
    for (precision, opt), r in rows.iterrows():  # each row is the account of its own optimizer
        assert r.peak_bytes == profile.account(dataclasses.replace(req, optimizer=opt), r.tech).peak
    assert rows.peak_bytes[("fp32", "bnb-sgd8bit")] < rows.peak_bytes[("fp32", "sgd-momentum")]
    assert rows.peak_bytes[("half-bf16", "optimi-sgd")] > rows.peak_bytes[("half-bf16", "sgd-momentum")]  # Kahan's buffer
    eight = rows.loc[("fp32", "bnb-sgd8bit")]
    assert "bitsandbytes.optim.SGD8bit" in eight.how_to_apply and eight.quality_risk.startswith("optimizer=bnb-sgd8bit: ")
    # The risks are the committed studies' paired changes against the same update with fp32 state.
    root = plan.ROOT / "metrics"
    c = lever_study.change(json.loads((root / "levers_state_train.json").read_text()), "bnb-sgd8bit", "optimi-sgd")
    assert (eight.predicted_change, eight.predicted_low) == (c.mean, c.low)
    kahan = rows.loc[("half-bf16", "optimi-sgd")]
    k = lever_study.change(json.loads((root / "levers_train.json").read_text()), "half-bf16+optimi-sgd", "optimi-sgd")
    assert kahan.quality_risk.startswith("precision=half-bf16+kahan: ") and kahan.predicted_change == k.mean
    both = rows.loc[("half-bf16", "bnb-sgd8bit")]  # two lossy levers: their effects add
    plain16 = rows.loc[("half-bf16", "sgd-momentum")]
    assert both.predicted_change == pytest.approx(plain16.predicted_change + c.mean)


FUSABLE = Request("lowmem.cli.examples:transformer", 1, (16,), "adamw", 1000)  # at batch 1 its peak is at AdamW's step


def test_the_fused_step_frees_every_gradient_but_one_layers_and_the_account_is_the_allocators():
    m = models.build(FUSABLE.spec, "meta")
    grads = sum(4 * p.numel() for p in m.parameters())
    layer = max(sum(4 * p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())
    plain, plain_ws = profile.measure(FUSABLE)
    fused, fused_ws = profile.measure(dataclasses.replace(FUSABLE, step="fused"))
    assert plain.peak_phase == "optimizer" and plain.category_max["gradients"] == grads  # every gradient at the step
    assert fused.category_max["gradients"] == layer < grads  # one layer's (the output projection's weight and bias)
    assert fused.category_max["optimizer"] == plain.category_max["optimizer"]  # the same AdamW state
    assert fused.peak < plain.peak
    for r, ws in ((plain, plain_ws), (fused, fused_ws)):  # accounted on fake tensors = the CPU allocator's peak
        assert abs(ws - r.measured_peak) <= 1e-4 * r.measured_peak, (ws, r.measured_peak)


def test_the_plan_fuses_the_step_where_it_lowers_the_peak_and_only_where_it_can_run():
    fused_peak = profile.account(dataclasses.replace(FUSABLE, step="fused")).peak
    budget = (fused_peak + profile.account(FUSABLE).peak) // 2
    levers = plan.Levers(precision=("fp32", "half-bf16"), checkpoint=("none",), activation_bits=(0,), optimizer_state=("given",))
    p = plan.make_plan(FUSABLE, budget, progress=False, levers=levers)
    fused = p.fitting[p.fitting.step == "fused"]
    assert len(fused) == 1 and fused.peak_bytes.iloc[0] == fused_peak and fused.quality_risk.iloc[0] == "exact"
    assert "fused_step.FusedOptimizer(model.parameters()" in fused.how_to_apply.iloc[0]
    # Where it cannot run, no row: 16-bit weights (a loss scaler), a microbatch (accumulation).
    batch4 = dataclasses.replace(FUSABLE, batch=4)
    rows = plan.make_plan(batch4, 2**40, progress=False, levers=levers).rows
    assert set(rows.step) == {"plain", "fused"}
    assert set(rows[rows.step == "fused"].precision) == {"fp32"} and set(rows[rows.step == "fused"].microbatch) == {4}
    assert plan.fusable(batch4, Techniques()) and not plan.fusable(batch4, Techniques(microbatch=2))
    assert not plan.fusable(batch4, Techniques(precision="mixed-bf16"))
    assert not plan.fusable(dataclasses.replace(batch4, devices=2), Techniques())
    # At a budget the plain step meets at its peak, the fused row with the same peak is dominated (it rules out
    # clipping by the global norm), and one with a lower peak stays.
    rows = pd.DataFrame({"peak_bytes": [100, 100, 90], "time": 1.0, "risk_key": 0.0, "lossy": 0.0,
                         "step": ["plain", "fused", "fused"]})
    assert list(plan.pareto(rows)) == [True, False, True]
    with pytest.raises(SpecError, match="microbatch=1"):
        profile.account(dataclasses.replace(batch4, step="fused"), Techniques(microbatch=1))
    with pytest.raises(SpecError, match="over 2 devices"):
        dataclasses.replace(batch4, step="fused", devices=2)
    with pytest.raises(SpecError, match="fairseq-train steps after backward"):
        Request("fairseq:lightconv_iwslt_de_en", 4, (16,), "adam", 100, step="fused")


def test_plan_refuses_a_budget_nothing_meets_naming_the_smallest_peak():
    req = Request("wrn:wrn-10-1", 8, (3, 32, 32), "sgd-momentum")
    with pytest.raises(SpecError, match=r"the smallest peak is .* GiB, with half-bf16\S* \(Techniques\("):
        plan.make_plan(req, 1000, progress=False, levers=SMALL)


@pytest.mark.parametrize("argv,says", [
    (["profile", "torchvision:resnet5", "--input", "3x32x32"], "torchvision has no classification model 'resnet5'"),
    (["profile", "resnet50", "--input", "3x32x32"], "write KIND:NAME"),
    (["profile", "torchvision:resnet18", "--input", "3xa"], "is not positive integers joined by x"),
    (["profile", "torchvision:resnet18", "--input", "3x32x32", "--optimizer", "lion"], "is not one of sgd, sgd-momentum"),
    (["profile", "torchvision:resnet18", "--input", "3x4x4"], "the training step fails on this model and input"),
    (["plan", "lowmem.cli.examples:conv1d", "--batch", "2", "--input", "8x16", "--budget", "1KiB"], "no configuration fits"),
    (["profile", "wrn:wrn-10-1", "--batch", "2", "--input", "3x8x8", "--devices", "2", "--step", "fused"], "over 2 devices"),
    (["plan", "fairseq:lightconv_iwslt_de_en", "--batch", "4", "--input", "16", "--vocab", "100", "--budget", "1GiB",
      "--step", "fused"], "add --step plain"),
    (["plan", "wrn:wrn-10-1", "--batch", "2", "--input", "3x8x8", "--devices", "2", "--budget", "1GiB", "--step", "fused"],
     "the fused step needs one device"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    assert main.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_plan_combines_only_the_optimizer_states_asked_for(capsys):
    def optimizers(out: str) -> set[tuple[str, str]]:  # (precision, optimizer) of each row of the plan's JSON
        return {(r["precision"], r["optimizer"]) for r in json.loads(out)["rows"]}

    argv = ["plan", "wrn:wrn-10-1", "--batch", "2", "--input", "3x8x8", "--budget", "1GiB", "--json"]
    assert main.main([*argv, "--optimizer-state", "given"]) == 0
    assert {o for _, o in optimizers(capsys.readouterr().out)} == {"sgd-momentum"}
    assert main.main([*argv, "--optimizer-state", "kahan"]) == 0  # Kahan's SGD: under half-bf16 only
    assert optimizers(capsys.readouterr().out) == {("half-bf16", "optimi-sgd")}
    with pytest.raises(SystemExit):  # argparse names the choices
        main.main([*argv, "--optimizer-state", "4-bit"])
    assert "invalid choice: '4-bit'" in capsys.readouterr().err
    # States with no counterpart for the optimizer leave nothing to plan: one line, exit 2.
    assert main.main([*argv, "--optimizer", "adam", "--optimizer-state", "8-bit", "kahan"]) == 2
    err = capsys.readouterr().err
    assert "has no setting for --optimizer adam" in err and len(err.strip().splitlines()) == 1


def test_profile_prints_the_breakdown(capsys):
    assert main.main(["profile", "torchvision:resnet18", "--batch", "4", "--input", "3x32x32", "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    req = Request("torchvision:resnet18", 4, (3, 32, 32), "adamw")
    assert f"**{profile.account(req).peak / 2**20:.2f}**" in out and "| optimizer |" in out


@pytest.mark.parametrize("tech", [Techniques(), Techniques(checkpoint="block")])
def test_the_accountant_and_memtracker_agree_on_the_peak(tech):
    from lowmem.studies import crosscheck

    r = crosscheck.memtracker(EXACT_FAMILIES["residual CNN"], tech)
    assert r["accountant_peak"] == r["memtracker_peak"]
    # Weights are weights in both; the categories may differ elsewhere (see lowmem.studies.crosscheck).
    assert r["accountant_model"] == r["memtracker_model"]


def test_pytorchs_estimators_get_flop_counters_count_as_runtime():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from lowmem.studies import crosscheck

    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    with FlopCounterMode(display=False) as counter:
        torch.ops.aten.convolution.default(*args)
    assert crosscheck._flops(torch.ops.aten.convolution.default, args, {})[1] == counter.get_total_flops() / 1e6
    assert crosscheck._flops(torch.ops.aten.relu.default, (x,), {})[1] == 0.0  # no formula: free, as the caption says


def test_the_sac_cross_check_asks_both_tools_to_free_more_and_each_recomputes_more():
    from lowmem.studies import crosscheck

    req = Request("wrn:wrn-10-1", 8, (3, 32, 32), "sgd-momentum")
    rows = crosscheck.sac_ilp(req, freed=(0.1, 0.2, 0.3))
    blocks = len(profile.chain_costs(req, Techniques(), 8)[0])
    assert [r["freed_share"] for r in rows] == [0.1, 0.2, 0.3]
    for tool in ("dp", "sac"):
        got = [r[f"{tool}_recompute_gflop"] for r in rows]
        assert all(g > 0 for g in got) and got == sorted(got)  # each budget is feasible, and a tighter one costs more
    assert all(0 < r["sac_blocks"] <= blocks and 0 < r["dp_segments"] <= blocks for r in rows)  # units: the blocks only


@pytest.mark.parametrize("block,says", [
    ({"budgets": ["4 gigs"]}, "budgets: budget '4 gigs' is not a number with a unit"),
    ({"models": [{"name": "x", "model": "torchvision:resnet5", "batch": 8, "input": "3x32x32", "optimizer": "sgd"}]},
     "torchvision has no classification model 'resnet5'"),
    ({"sac_models": [{"name": "x", "model": "wrn:wrn-10-1"}]}, "each model is a mapping with exactly"),
    ({"memtracker_families": ["cnn"]}, "memtracker_families: \\['cnn'\\] unknown"),
    ({"workers": 0}, "workers must be a whole number of processes, at least 1"),
    ({"models": [{"name": "x", "model": "wrn:wrn-10-1", "batch": 8, "input": "3x32x32", "optimizer": "sgd-momentum",
                  "optimizer_state": ["given", "4-bit"]}]}, "optimizer_state must list 'given' and some of"),
    ({"sac_models": [{"name": "x", "model": "wrn:wrn-10-1", "batch": 8, "input": "3x32x32", "optimizer": "sgd-momentum",
                      "optimizer_state": ["given"]}]}, "each model is a mapping with exactly"),
])
def test_the_planner_stage_refuses_bad_params_naming_them(block, says):
    from lowmem.studies import planner_params as _registers_the_stage  # noqa: F401
    from lowmem.config import ParamError, resolve

    params = yaml.safe_load((Path(__file__).parents[1] / "params.yaml").read_text())
    with pytest.raises(ParamError, match=says):
        resolve("planner", {**params, "planner": {**params["planner"], **block}})


def test_the_planner_stage_gives_the_same_tables_on_two_processes_as_on_one():
    from lowmem import config
    from lowmem.studies import planner as study

    # One small model and the cross-checks at smoke size: three jobs, which can finish out of order on two processes
    # (the order of several models' jobs: the test below), at a budget where some levers are needed and one where
    # nothing is.
    entry = {"model": "lowmem.cli.examples:conv1d", "input": "8x128", "optimizer": "adam"}
    p = dataclasses.replace(config.load("planner"), budgets=["600KiB", "1GiB"], models=[{"name": "conv1d at 4", "batch": 4, **entry}])
    assert len(study._jobs(p)) == 3
    one, two = study.run(p), study.run(dataclasses.replace(p, workers=2))
    assert list(one) == list(two)
    for key in one:
        pd.testing.assert_frame_equal(one[key], two[key])
    assert list(two["breakdown"].model) == ["conv1d at 4"] and set(two["plans"].budget) == {"600KiB", "1GiB"}


def test_the_planner_stage_keeps_its_jobs_order_when_they_finish_in_reverse(monkeypatch):
    import time
    from concurrent.futures import ThreadPoolExecutor
    from functools import partial

    from lowmem import config
    from lowmem.studies import crosscheck, planner as study

    p = dataclasses.replace(config.load("planner"), workers=4)
    models = [dict(p.models[0], name=n) for n in ("first", "second")]
    p = dataclasses.replace(p, models=models)
    results = [({"model": "first"}, [{"model": "first", "budget": "1GiB"}]),
               ({"model": "second"}, [{"model": "second", "budget": "1GiB"}]),
               pd.DataFrame({"family": ["memtracker's"]}), pd.DataFrame({"freed_share": list(crosscheck.FREED)})]

    def job(i: int) -> object:
        time.sleep(0.2 * (len(results) - i))  # the last submitted finishes first
        return results[i]

    # Threads in place of processes, so that the jobs need not be importable; the pool's logic is the same.
    monkeypatch.setattr(study, "_jobs", lambda _: [partial(job, i) for i in range(len(results))])
    monkeypatch.setattr(study, "ProcessPoolExecutor", lambda n, mp_context=None: ThreadPoolExecutor(n))
    res = study.run(p)
    assert list(res["breakdown"].model) == ["first", "second"] and list(res["plans"].model) == ["first", "second"]
    assert list(res["memtracker"].family) == ["memtracker's"] and list(res["sac"].freed_share) == list(crosscheck.FREED)


def test_the_sac_cross_check_is_the_same_whatever_numpys_global_generator_holds_and_leaves_it_as_it_was():
    import numpy as np

    from lowmem.studies import crosscheck

    req = Request("wrn:wrn-10-1", 8, (3, 32, 32), "sgd-momentum")
    rows = []
    for seed in (1, 2):
        np.random.seed(seed)
        before = np.random.get_state()
        rows.append(crosscheck.sac_ilp(req, freed=(0.2,)))
        after = np.random.get_state()
        assert before[0] == after[0] and (before[1] == after[1]).all() and before[2:] == after[2:]
    assert rows[0] == rows[1]


FAIRSEQ_ACCOUNTS: dict[tuple, object] = {}


@pytest.fixture
def fairseq_accounts(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """fairseq's accounting remembered by its arguments, across the tests that use it (each full-size account takes
    seconds). A row's
    printed command, accounted again, is then the very call that made the row when the command is the one accounted,
    and is accounted afresh when it is not: asserting the two peaks equal still checks that the command printed is the
    command accounted. Returns the accounting itself, not remembered, for a test to check that an account made
    afresh, after the others, is the remembered one (nothing the others left behind changes it)."""
    from lowmem.cli import plan_fairseq
    from lowmem.dynamicconv import memory as fairseq_memory

    seen = FAIRSEQ_ACCOUNTS  # shared by the tests that plan the same request: the accounting is a pure function
    real = fairseq_memory.account

    def account(recipe_args: list[str], *args: object, **kw: object) -> object:
        key = (tuple(recipe_args), args, tuple(sorted(kw.items())))
        if key not in seen:
            seen[key] = real(recipe_args, *args, **kw)
        return seen[key]

    monkeypatch.setattr(fairseq_memory, "account", account)
    # The planner's logic does not depend on the model's size, so these tests plan a small lightconv (one layer each
    # side, 64 wide): each account then takes a fraction of a second, not the full-size model's seconds. The
    # embeddings keep 64 x 64 = 4096 weights, bitsandbytes' least size for 8-bit state (smaller tensors keep 32-bit
    # moments, and the 8-bit rows would save nothing). The printed commands carry these flags, so every account of a
    # printed command below is of the model planned. (Other architectures, which take other flags, stay as they are.)
    base_args = plan_fairseq.base_args
    monkeypatch.setattr(plan_fairseq, "base_args",
                        lambda req: [*base_args(req), *(SMALL_LIGHTCONV if req.spec.name == plan_fairseq.PLUGIN_ARCH else [])])
    return real


SMALL_LIGHTCONV = [arg for side in ("encoder", "decoder")
                   for flag, value in (("embed-dim", "64"), ("ffn-embed-dim", "128"), ("layers", "1"),
                                       ("kernel-size-list", "[3]"), ("attention-heads", "2"))
                   for arg in (f"--{side}-{flag}", value)]


def test_plan_for_fairseq_prints_flags_whose_update_fits_and_the_least_update_freq(fairseq_accounts: Callable[..., Any]) -> None:
    from lowmem.cli import plan_fairseq
    from lowmem.dynamicconv import memory as fairseq_memory

    req = Request("fairseq:lightconv_iwslt_de_en", 2, (8,), "adam", vocab=64)  # 16 tokens: --update-freq 1 or 2
    opts = plan_fairseq.options(req)
    assert opts["checkpoint"] == [[], ["--checkpoint-activations"]] and len(opts["microbatch"]) == 2
    # The plugin's, already on the command line; no counterpart for SGD, no Kahan for fairseq's own architectures.
    assert opts["optimizer"] == {"given": [], "8-bit": ["--optimizer", "lowmem_adamw8bit"], "kahan": ["--optimizer", "lowmem_adamw_kahan"]}
    assert plan_fairseq.options(dataclasses.replace(req, optimizer="sgd"))["optimizer"] == {"given": []}
    plain = fairseq_memory.account(plan_fairseq.base_args(req) + opts["microbatch"][0], 64, 64, 16, 8).peak
    p = plan.make_plan(req, plain - 1, progress=False, levers=plan.Levers(optimizer_state=("given",)))  # the plain update does not fit
    assert len(p.fitting) >= 1
    for r in p.fitting.itertuples():
        args = r.how_to_apply.removeprefix("fairseq-train ").removesuffix(" (plus your data and recipe)").split()
        assert fairseq_memory.account(args, 64, 64, 16, 8).peak == r.peak_bytes <= plain - 1
        if "--update-freq" in args:  # the least k that fits: the same levers at k = 1 do not
            i = args.index("--update-freq")
            k1 = args[:i] + args[i + 2:]
            k1[k1.index("--max-tokens") + 1] = "16"
            assert fairseq_memory.account(k1, 64, 64, 16, 8).peak > plain - 1
        assert (r.quality_risk == "exact") == (r.precision == "fp32" and "--update-freq" not in args)
        if r.precision == "--precision half-bf16" and "--update-freq" not in args:  # fairseq's Adam: the precision's own risk
            assert r.quality_risk.startswith("--precision half-bf16: ")
    assert any(r.precision == "--precision half-bf16" and "--update-freq" not in r.how_to_apply for r in p.rows.itertuples())
    # 8-bit Adam moments: fewer bytes than fp32 moments, also under autocast (accounted on fake tensors, beside
    # bitsandbytes' real code books), with the DynamicConv study's measured risk.
    eight = opts["optimizer"]["8-bit"]
    for p16 in ([], ["--precision", "mixed-bf16"]):
        args = plan_fairseq.base_args(req) + p16 + opts["microbatch"][0]
        assert fairseq_memory.account(args + eight, 64, 64, 16, 8).peak < fairseq_memory.account(args, 64, 64, 16, 8).peak
    change, low, label = plan_fairseq.risk({"precision": [], "checkpoint": [], "microbatch": opts["microbatch"][0],
                                            "optimizer": eight}, plan_fairseq.measured(plan.ROOT))
    lever = plan_fairseq.measured(plan.ROOT)["--optimizer lowmem_adamw8bit"]
    assert (change, low) == (lever["change"], lever["low"]) and label.startswith("--optimizer lowmem_adamw8bit: ")
    # The risk carries the seed noise, as the headline's interval does: wider than the run's bootstrap alone.
    run = next(r for r in json.loads((plan.ROOT / "metrics" / "translation_levers_train.json").read_text())["trained"]
               if r["technique"] == "adamw-8bit")
    assert lever["low"] < run["sacrebleu_change_low"] and lever["high"] > run["sacrebleu_change_high"]
    assert "widened by the baseline's seed sd" in lever["where"]


def test_plan_for_fairseq_offers_kahan_adamw_under_bf16_weights_only_with_its_risk_keyed_with_them(fairseq_accounts: Callable[..., Any]) -> None:
    """The Kahan-compensated AdamW is a setting only beside the plugin's bf16 weights (with fp32 weights it
    compensates nothing), its row accounts the printed command, and its risk is all-bf16 with Kahan's measured change
    (stage translation_kahan_train) in place of the precision's own: all-bf16 without it loses 10 BLEU."""
    from lowmem.cli import plan_fairseq
    from lowmem.dynamicconv import memory as fairseq_memory

    req = Request("fairseq:lightconv_iwslt_de_en", 2, (8,), "adam", vocab=64)
    kahan = plan_fairseq.rows(req, 2**40, False, plan.ROOT, ("kahan",))
    assert kahan and {r["optimizer"] for r in kahan} == {"lowmem_adamw_kahan"}
    assert {r["precision"] for r in kahan} == {"--precision half-bf16"}
    assert {r["checkpoint"] for r in kahan} == {"none", "--checkpoint-activations"}
    lever = plan_fairseq.measured(plan.ROOT)["--precision half-bf16 --optimizer lowmem_adamw_kahan"]
    run = next(r for r in json.loads((plan.ROOT / "metrics" / "translation_kahan_train.json").read_text())["trained"]
               if r["technique"] == "all-bf16-kahan")
    assert lever["change"] == run["sacrebleu_change"] and lever["low"] < run["sacrebleu_change_low"]
    printed = kahan[0]["how_to_apply"].removeprefix("fairseq-train ").removesuffix(" (plus your data and recipe)").split()
    assert fairseq_accounts(printed, 64, 64, 16, 8).peak == kahan[0]["peak_bytes"]  # afresh, after the plan's accounts
    for r in kahan:
        args = r["how_to_apply"].removeprefix("fairseq-train ").removesuffix(" (plus your data and recipe)").split()
        assert fairseq_memory.account(args, 64, 64, 16, 8).peak == r["peak_bytes"]
        assert r["quality_risk"].startswith("--precision half-bf16 --optimizer lowmem_adamw_kahan: ")
        if "--update-freq" not in args:  # one lossy lever, the pair: its measured change alone
            assert (r["predicted_change"], r["predicted_low"]) == (lever["change"], lever["low"])
    # The same precision with fairseq's Adam (the command less the optimizer the setting appends) is its own lever, not
    # Kahan's; fairseq's Adam keeps fp32 moments for bf16 weights (8 bytes a weight), the compensated AdamW two bf16
    # moments and a bf16 compensation (6): a higher peak (accounted for the first row; the rest differ in activations).
    effects = plan_fairseq.measured(plan.ROOT)
    assert fairseq_memory.account(printed[:-2], 64, 64, 16, 8).peak > kahan[0]["peak_bytes"]
    for r in kahan:
        args = r["how_to_apply"].removeprefix("fairseq-train ").removesuffix(" (plus your data and recipe)").split()
        assert args[-2:] == ["--optimizer", "lowmem_adamw_kahan"]
        _, _, label = plan_fairseq.risk({"precision": r["precision"].split(), "checkpoint": [] if r["checkpoint"] == "none" else [r["checkpoint"]],
                                         "microbatch": r["microbatch"].split(), "optimizer": []}, effects)
        assert label.startswith("--precision half-bf16: ")
    # With --update-freq, fairseq's own lossy microbatching adds its effect beside the pair's.
    _, _, label = plan_fairseq.risk({"precision": ["--precision", "half-bf16"], "checkpoint": [], "optimizer": ["--optimizer", "lowmem_adamw_kahan"],
                                     "microbatch": ["--update-freq", "2", "--max-tokens", "8"]}, effects)
    assert [p.split(":")[0] for p in label.split("; ")] == ["--precision half-bf16 --optimizer lowmem_adamw_kahan", "--update-freq 2"]
    # fairseq's own architectures keep fp32 weights (--fp16 has fp32 master weights): no Kahan setting there.
    assert "kahan" not in plan_fairseq.options(Request("fairseq:transformer_iwslt_de_en", 2, (8,), "adam", vocab=64))["optimizer"]
    with pytest.raises(SpecError, match="'kahan' with --optimizer adam on lightconv_iwslt_de_en under --precision half-bf16"):
        plan_fairseq.rows(dataclasses.replace(req, optimizer="sgd"), 2**40, False, plan.ROOT, ("kahan",))
