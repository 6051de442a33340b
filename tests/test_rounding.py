"""The stochastic-rounding lever (lowmem.techniques.rounding): bf16 weights follow the small updates that rounding
to nearest loses, unbiased; fp32 is torch's SGD bit for bit; it keeps no state beyond the momentum; its random bits
are its own and resume with it."""

import copy

import pytest
import torch
from torch import nn

from lowmem.techniques import registry, rounding
from lowmem.techniques.step import Techniques
from lowmem.wrn import memory as wrn_memory
from lowmem.wrn.memory import Shape
from lowmem.wrn.models import build_model
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.train import TRAIN_CODE, store_run

BF16 = 2


def _step(opt: torch.optim.Optimizer, p: torch.Tensor, grad: float) -> None:
    p.grad = torch.full_like(p, grad)
    opt.step()


def test_bf16_weights_follow_updates_that_round_to_nearest_loses() -> None:
    """10,000 weights of 1.0 stepped 64 times by lr · grad = 2^-12, a sixteenth of bf16's half-spacing above 1
    (2^-8): round to nearest never moves them; stochastic rounding moves their mean by 64 · 2^-12 = 2^-6, within
    five standard errors (each step rounds up by 2^-7 with probability 1/32: a Bernoulli's variance per step)."""
    torch.manual_seed(0)
    plain, sr = (torch.ones(10_000, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    o_plain = registry.make_optimizer([plain], "sgd", 2**-12, 0.0, False, 0.0)
    o_sr = registry.make_optimizer([sr], "sr-sgd", 2**-12, 0.0, False, 0.0)
    for _ in range(64):
        _step(o_plain, plain, -1.0)
        _step(o_sr, sr, -1.0)
    assert bool((plain == 1.0).all())
    moved = sr.float() - 1.0
    per_weight_sd = 2**-7 * (64 * (1 / 32) * (31 / 32)) ** 0.5
    assert abs(moved.mean().item() - 2**-6) < 5 * per_weight_sd / 10_000**0.5
    assert set(moved.unique().tolist()) <= {k * 2**-7 for k in range(65)}  # whole bf16 spacings, never a fraction


def test_in_fp32_it_is_torch_sgd_without_nesterov_bit_for_bit() -> None:
    """An fp32 weight needs no rounding: the heavy-ball update with L2 weight decay, op for op torch's SGD, over many
    steps; the control arm of the lever."""
    torch.manual_seed(0)
    a, b = nn.Linear(8, 4), nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    ta = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, foreach=False)
    tb = registry.make_optimizer(b.parameters(), "sr-sgd", 0.05, 0.9, True, 5e-4)
    for i in range(30):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
        for m, opt in ((a, ta), (b, tb)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_its_bits_are_its_own_and_a_resumed_optimizer_rounds_as_the_uninterrupted_one() -> None:
    """The step leaves the global generator where it was (the run's augmentation draws the same as its paired
    arms'), and an optimizer loaded from a state dict after 5 steps ends 10 steps later where the other does."""
    def make(seed: int) -> tuple[torch.Tensor, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        p = torch.ones(1000, dtype=torch.bfloat16, requires_grad=True)
        return p, registry.make_optimizer([p], "sr-sgd", 2**-10, 0.9, False, 0.0)

    p, opt = make(3)
    before = torch.get_rng_state()
    for _ in range(5):
        _step(opt, p, -1.0)
    assert torch.equal(torch.get_rng_state(), before)
    saved, weights = copy.deepcopy(opt.state_dict()), p.detach().clone()  # as the trainer's checkpoint on disk
    for _ in range(10):
        _step(opt, p, -1.0)
    q, resumed = make(99)  # another seed: only the state dict may carry the rounding's stream
    with torch.no_grad():
        q.copy_(weights)
    resumed.load_state_dict(saved)
    for _ in range(10):
        _step(resumed, q, -1.0)
    assert torch.equal(p, q)
    other, o = make(4)
    for _ in range(15):
        _step(o, other, -1.0)
    assert not torch.equal(other, p)  # another seed, other roundings


def test_wrn_28_2_in_half_bf16_keeps_only_the_bf16_momentum() -> None:
    """Stochastic rounding needs no buffer: the optimizer state is plain half-bf16's one bf16 copy of the weights
    (Kahan's is two), and the activations are the same."""
    shape = Shape(batch_size=8)
    half = wrn_memory.account(Techniques(precision="half-bf16"), shape)
    sr = wrn_memory.account(Techniques(precision="half-bf16", optimizer="sr-sgd"), shape)
    weights = sum(p.numel() for p in build_model("wrn-28-2").parameters()) * BF16
    assert sr.category_max["optimizer"] == half.category_max["optimizer"] == weights
    assert sr.category_max["activations"] == half.category_max["activations"]


def test_fp16_weights_and_unknown_names_are_refused() -> None:
    p = torch.ones(4, dtype=torch.float16, requires_grad=True)
    with pytest.raises(ValueError, match="stochastic rounding is to bf16"):
        _step(rounding.make([p], "sr-sgd", 0.1, 0.0, False, 0.0), p, 1.0)
    with pytest.raises(ValueError, match="not one of sr-sgd"):
        rounding.check("sr-adam")


def test_the_lever_is_on_the_code_path_of_its_runs_only() -> None:
    """Added after the trainer, the lever's module joins the key of the runs that set it, and of no other."""
    p = BaselineParams()
    plain, kahan, sr = (store_run(p, 0, Techniques(precision="half-bf16", optimizer=o)) for o in ("sgd", "optimi-sgd", "sr-sgd"))
    assert plain.code == kahan.code == sorted(TRAIN_CODE)
    assert sr.code == sorted({*TRAIN_CODE, "lowmem.techniques.rounding"})
    assert len({plain.key, kahan.key, sr.key}) == 3
