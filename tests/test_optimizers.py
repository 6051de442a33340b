"""The optimizer lever (lowmem.techniques.optimizers): torch-optimi's Kahan-compensated SGD keeps the small updates
that bf16 weights round away, its state is counted at its real bytes, and bad names stop before any compute."""

from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from lowmem.memory.accounting import profile_step
from lowmem.techniques import optimizers
from lowmem.techniques.step import Techniques
from lowmem.wrn import memory as wrn_memory
from lowmem.wrn.memory import Shape
from lowmem.wrn.models import build_model

BF16, F32 = 2, 4
ROOT = Path(__file__).parents[1]


def test_kahan_keeps_the_updates_that_bf16_rounds_away() -> None:
    """A weight of 1.0 stepped 200 times by lr · grad = 1e-4: bf16's spacing below 1 is 2^-8, so each plain bf16
    step rounds back to 1.0; with Kahan summation the weight follows fp32 to within one bf16 spacing."""
    ref, plain, kahan = (torch.ones(1, dtype=d, requires_grad=True) for d in (torch.float32, torch.bfloat16, torch.bfloat16))
    opts = [optimizers.make([ref], "sgd", 1e-4, 0.0, False, 0.0), optimizers.make([plain], "sgd", 1e-4, 0.0, False, 0.0),
            optimizers.make([kahan], "optimi-sgd", 1e-4, 0.0, False, 0.0)]
    for _ in range(200):
        for p, opt in zip((ref, plain, kahan), opts):
            p.grad = torch.ones_like(p)
            opt.step()
    assert plain.item() == 1.0  # every step lost
    assert ref.item() == pytest.approx(0.98, abs=1e-5)
    assert abs(kahan.float().item() - ref.item()) <= 2 ** -8


def test_optimi_sgd_in_fp32_is_torch_sgd_without_nesterov() -> None:
    """No compensation in fp32: the same heavy-ball update with L2 weight decay as torch's SGD, to rounding, over
    many steps (what the fp32 arm of the lever measures is the recipe without Nesterov)."""
    torch.manual_seed(0)
    a = nn.Linear(8, 4)
    b = nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    ta = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    tb = optimizers.make(b.parameters(), "optimi-sgd", 0.05, 0.9, True, 5e-4)
    for i in range(30):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
        for m, opt in ((a, ta), (b, tb)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    assert tb.state[b.weight]["kahan_comp"] is None  # fp32: no compensation buffer


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_compensation_buffer_is_counted_as_optimizer_state(device: str) -> None:
    """bf16 momentum and bf16 Kahan compensation, each the parameters' shape: 2 + 2 bytes per weight."""
    with torch.device(device):
        m = nn.Linear(12, 5).to(torch.bfloat16)
        batch = (torch.randn(3, 12, dtype=torch.bfloat16), torch.zeros(3))
    opt = optimizers.make(m.parameters(), "optimi-sgd", 0.1, 0.9, False, 0.0)
    r = profile_step(m, opt, batch, lambda out, _: out.float().sum())
    n = 12 * 5 + 5
    assert r.category_max["model"] == n * BF16
    assert r.category_max["optimizer"] == 2 * n * BF16


def test_wrn_28_2_in_half_bf16_with_kahan_adds_one_bf16_copy_of_the_weights() -> None:
    shape = Shape(batch_size=8)
    half = wrn_memory.account(Techniques(precision="half-bf16"), shape)
    kahan = wrn_memory.account(Techniques(precision="half-bf16", optimizer="optimi-sgd"), shape)
    weights = sum(p.numel() for p in build_model("wrn-28-2").parameters()) * BF16  # BatchNorm's running stats are not optimized
    assert half.category_max["optimizer"] == weights  # bf16 momentum
    assert kahan.category_max["optimizer"] == 2 * weights  # bf16 momentum + bf16 compensation
    assert kahan.category_max["activations"] == half.category_max["activations"]


def test_an_unknown_optimizer_is_refused_with_the_allowed_names() -> None:
    with pytest.raises(ValueError, match="optimizer='adam' is not one of sgd, optimi-sgd"):
        Techniques(optimizer="adam")


def test_the_levers_table_pairs_each_arm_by_seed_and_reduces_against_the_baseline() -> None:
    from lowmem.studies import levers

    mem = {"baseline": 100.0, "half-bf16": 50.0, "optimi-sgd": 100.0, "half-bf16+optimi-sgd": 52.0}
    acc = {"baseline": [0.90, 0.91, 0.92], "half-bf16": [0.89, 0.89, 0.91], "optimi-sgd": [0.90, 0.90, 0.93],
           "half-bf16+optimi-sgd": [0.90, 0.91, 0.91]}
    res = {"profile": "cpu", "model": "m", "data": "d", "epochs": 1, "batch_size": 32, "seeds": [0, 1, 2],
           "arms": {a: {"per_seed_acc": acc[a], "step_s": [0.1, 0.1, 0.1],
                        "memory": {"optimizer_mib": 1.0, "total_mib": mem[a]}} for a in mem}}
    kahan = levers.studies(yaml.safe_load((ROOT / "params.yaml").read_text()))["kahan"]
    t = levers.table(res, kahan).set_index(["arm", "against"])
    row = t.loc[("half-bf16+optimi-sgd", "half-bf16")]
    assert row.accuracy_change == pytest.approx((1 + 2 + 0) / 3)  # per seed: +1, +2, 0 points
    assert row.reduction == pytest.approx(100 / 52)
    assert t.loc[("half-bf16", "baseline")].low < t.loc[("half-bf16", "baseline")].accuracy_change
    assert len(t) == len(kahan["pairs"]) == 5


def test_the_levers_study_refuses_an_unknown_arm_before_any_training(tmp_path, capsys) -> None:
    from lowmem.pipeline import commands

    assert commands.main(["levers", "--metrics", str(tmp_path / "m.json"), "--only", "baseline", "nope"]) == 2
    assert "--only: arm 'nope': 'nope' is none of the levers' short names (" in capsys.readouterr().err
    assert commands.main(["levers", "--metrics", str(tmp_path / "m.json"), "--only", "half-bf16+half-fp16"]) == 2
    assert "sets precision twice" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()
