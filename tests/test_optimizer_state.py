"""Quantized optimizer state (lowmem.techniques.optimizers, ``bnb-sgd8bit``): bitsandbytes' SGD with 8-bit block-wise
momentum. Its bytes come from first principles, its update is the fp32 heavy-ball update of the dequantized momentum,
the stored momentum is within half the code book's widest step (times its block's maximum) of the exact one, DSR's
rewiring keeps it, and resuming is exact."""

import pytest
import torch
from torch import nn

from lowmem.memory.accounting import profile_step
from lowmem.techniques import optimizers, sparsity
from lowmem.techniques.step import Techniques
from lowmem.wrn import memory as wrn_memory
from lowmem.wrn.memory import Shape
from lowmem.wrn.models import build_model

F32, U8 = 4, 1
LR, MOMENTUM, WD = 0.1, 0.9, 5e-4
# bitsandbytes' CPU quantizer picks a code by comparing the value scaled in fp32 with midpoints, so a value within
# float rounding of a midpoint can go to the farther code: measured up to 0.34% of a half step over it. 1% allows that.
SLACK = 1.01


def _state_bytes(numels: list[int]) -> int:
    """8-bit momentum from first principles: a uint8 code per element and an fp32 maximum per block of 256 for each
    parameter of at least 4096 elements, fp32 momentum for the rest, and one 256-entry fp32 code book."""
    big = [n for n in numels if n >= 4096]
    small = [n for n in numels if n < 4096]
    return sum(n * U8 + -(-n // 256) * F32 for n in big) + sum(n * F32 for n in small) + (256 * F32 if big else 0)


def _bound(state: dict) -> torch.Tensor:
    """Half the widest gap between neighbouring codes of the code book, times each element's block maximum: the most
    that rounding to the nearest code can move a value."""
    codes = state["qmap1"].sort().values
    half_gap = (codes[1:] - codes[:-1]).max() / 2
    return (state["absmax1"].repeat_interleave(256)[: state["state1"].numel()] * half_gap).view_as(state["state1"])


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_8bit_momentum_is_counted_at_its_real_bytes(device: str) -> None:
    with torch.device(device):
        m = nn.Sequential(nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 10))  # 6144 + 64 + 640 + 10 elements
        batch = (torch.randn(4, 96), torch.zeros(4))
    opt = optimizers.make(m.parameters(), "bnb-sgd8bit", LR, MOMENTUM, False, WD)
    r = profile_step(m, opt, batch, lambda out, _: out.sum())
    assert r.category_max["optimizer"] == _state_bytes([6144, 64, 640, 10])
    assert r.category_max["model"] == (6144 + 64 + 640 + 10) * F32


def test_wrn_28_2_momentum_in_8_bits_from_first_principles() -> None:
    numels = [p.numel() for p in build_model("wrn-28-2").parameters()]
    plain = wrn_memory.account(Techniques(), Shape(batch_size=8))
    eight = wrn_memory.account(Techniques(optimizer="bnb-sgd8bit"), Shape(batch_size=8))
    assert plain.category_max["optimizer"] == sum(numels) * F32
    assert eight.category_max["optimizer"] == _state_bytes(numels)
    assert eight.category_max["activations"] == plain.category_max["activations"]


def test_without_8bit_state_it_is_torch_sgd_without_nesterov_bitwise() -> None:
    """Every parameter under 4096 elements keeps fp32 momentum: then it is torch's heavy-ball SGD, to the bit."""
    torch.manual_seed(0)
    a, b = nn.Linear(16, 8), nn.Linear(16, 8)
    b.load_state_dict(a.state_dict())
    ta = torch.optim.SGD(a.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD, foreach=False)
    tb = optimizers.make(b.parameters(), "bnb-sgd8bit", LR, MOMENTUM, True, WD)
    for i in range(30):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        for m, opt in ((a, ta), (b, tb)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert tb.state[b.weight]["state1"].dtype == torch.float32


def test_each_step_is_the_fp32_update_of_the_dequantized_momentum_and_stores_it_within_half_a_code() -> None:
    """Over many steps of an 8192-element weight: the new weight is exactly w - lr (mu m + g + wd w) computed in fp32
    from the momentum m as stored (dequantized), and the stored new momentum is within half a code step times its
    block's maximum of that exact value, never further."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 128))
    opt = optimizers.make([w], "bnb-sgd8bit", LR, MOMENTUM, False, WD)
    worst = 0.0
    for i in range(40):
        g = torch.randn(64, 128, generator=torch.Generator().manual_seed(i)) * (1 + i % 3)
        w_before = w.detach().clone()
        state = opt.state.get(w)
        m_before = optimizers.dequantized(state) if state else None
        w.grad = g.clone()
        opt.step()
        state = opt.state[w]
        d = g + WD * w_before if m_before is None else g.add(w_before, alpha=WD)
        m_exact = d if m_before is None else m_before.mul(MOMENTUM).add_(d)
        assert torch.equal(w.detach(), w_before.add(m_exact, alpha=-LR))
        assert state["state1"].dtype == torch.uint8
        err = (optimizers.dequantized(state) - m_exact).abs()
        assert (err <= _bound(state) * SLACK).all()
        worst = max(worst, (err / _bound(state)).max().item())
    assert worst > 0.5  # rounding does happen: the bound is not slack by orders of magnitude


def test_dsr_rewiring_keeps_the_8bit_momentum_of_survivors_and_zeroes_the_regrown_to_rounding() -> None:
    """A sparse layer's 8-bit momentum is moved with its values: dequantized, realigned, quantized again. Kept
    weights keep their momentum to within two roundings; regrown ones start at zero to within one."""
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 64, 3, padding=1, bias=False)
    layer = sparsity.SparseConv2d(conv, torch.rand(conv.weight.shape, generator=torch.Generator().manual_seed(0)) < 0.5)
    assert layer.values.numel() >= optimizers.MIN_8BIT_SIZE
    opt = optimizers.make([layer.values], "bnb-sgd8bit", LR, MOMENTUM, False, 0.0)
    for i in range(3):
        opt.zero_grad()
        layer(torch.randn(2, 64, 6, 6, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        opt.step()
    before = dict(zip(layer.indices.tolist(), optimizers.dequantized(opt.state[layer.values]).tolist()))
    kept = {k for k, v in zip(layer.indices.tolist(), layer.values.tolist()) if abs(v) >= 0.01}  # DSR's threshold
    bound_before = _bound(opt.state[layer.values]).max().item()
    dsr = sparsity.DSR({"c": layer}, 10, reallocate=2000, periods=(1,), phases=(0.0,), stop=2.0, threshold=0.01, seed=0)
    dsr.rewire(opt)
    state = opt.state[layer.values]
    after = dict(zip(layer.indices.tolist(), optimizers.dequantized(state).tolist()))
    assert state["state1"].dtype == torch.uint8 and state["state1"].shape == layer.values.shape
    regrown = after.keys() - kept  # new positions, and pruned ones drawn again: both start from zero
    assert regrown and kept < after.keys() and len(kept) < len(before)
    bound = (bound_before + _bound(state).max().item()) * SLACK
    assert all(abs(after[k] - before[k]) <= bound for k in kept)
    # Within rounding of zero, not zero: bitsandbytes' CPU quantizer stores 0 as its code 2.1e-5, not its zero code.
    new_bound = _bound(state).max().item() * SLACK
    assert all(abs(after[k]) <= new_bound for k in regrown)


def test_resuming_from_the_state_dict_continues_the_same_steps() -> None:
    torch.manual_seed(0)
    a = nn.Linear(128, 64)
    opt = optimizers.make(a.parameters(), "bnb-sgd8bit", LR, MOMENTUM, False, WD)

    def step(m: nn.Module, o: torch.optim.Optimizer, i: int) -> None:
        o.zero_grad()
        m(torch.randn(4, 128, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        o.step()

    for i in range(3):
        step(a, opt, i)
    b = nn.Linear(128, 64)
    b.load_state_dict(a.state_dict())
    resumed = optimizers.make(b.parameters(), "bnb-sgd8bit", LR, MOMENTUM, False, WD)
    resumed.load_state_dict(opt.state_dict())
    for i in range(3, 6):
        step(a, opt, i)
        step(b, resumed, i)
    assert torch.equal(a.weight, b.weight)


def test_a_missing_library_stops_before_any_compute_naming_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ValueError, match="optimizer='bnb-sgd8bit' needs bitsandbytes, which is not installed: `make setup`"):
        Techniques(optimizer="bnb-sgd8bit")
    with pytest.raises(ValueError, match="lowmem_adamw8bit\\) needs bitsandbytes, which is not installed: `make setup`"):
        optimizers.adamw8bit([nn.Parameter(torch.zeros(2))], lr=1e-3)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optimi" else real(name, *a))
    with pytest.raises(ValueError, match="lowmem_adamw_kahan\\) needs torch-optimi, which is not installed: `make setup`"):
        optimizers.adamw_kahan([nn.Parameter(torch.zeros(2))], lr=1e-3)
