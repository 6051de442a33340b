"""Checkpointing keeps the maths (gradients, BN statistics, dropout masks), and the planner finds the optimum."""

import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowmem.memory.accounting import profile_step
from lowmem.techniques import checkpoint
from lowmem.techniques.checkpoint import BlockCost
from lowmem.wrn.models import build_model
from lowmem.wrn.train import Techniques, train_step

SPECS = ["block", "every-2", "every-3", "sqrt", "selective", "optimal-0.3", "optimal-0"]


def _grads_and_stats(model: nn.Module, spec: str, x: torch.Tensor, y: torch.Tensor) -> tuple[list, list]:
    checkpoint.apply(model, spec, tuple(x.shape))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    torch.manual_seed(1)  # the same dropout masks for every strategy, if checkpoint restores the RNG on recompute
    train_step(model, opt, x, y)
    return [p.grad for p in model.parameters()], [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("spec", SPECS)
def test_wrn_gradients_and_bn_statistics_equal_the_unmodified_step(spec: str) -> None:
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    torch.manual_seed(0)
    plain = build_model("wrn-16-1")
    ckpt = build_model("wrn-16-1")
    ckpt.load_state_dict(plain.state_dict())
    g0, b0 = _grads_and_stats(plain, "none", x, y)
    g1, b1 = _grads_and_stats(ckpt, spec, x, y)
    assert isinstance(ckpt.blocks, checkpoint.CheckpointedChain) or spec == "optimal-0"
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    # Running mean/var moved once, and num_batches_tracked counted the step once.
    for a, b in zip(b0, b1):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert int(ckpt.blocks[0].bn1.num_batches_tracked) == 1


@pytest.mark.parametrize("prec", ["mixed-bf16", "half-bf16"])
@pytest.mark.parametrize("level", [0.0, 0.9])
@pytest.mark.parametrize("spec", ["block", "sqrt"])
def test_checkpointing_is_bit_equal_in_every_precision_and_with_sparse_layers(spec: str, level: float, prec: str) -> None:
    """What lets a run's key leave the checkpoint strategy out (lowmem.wrn.train.run_techniques): three optimizer steps
    with and without checkpointing give the same weights, bit for bit."""
    from lowmem.techniques import precision, sparsity

    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    finals = []
    for s in ("none", spec):
        torch.manual_seed(0)
        m = build_model("wrn-10-1")
        if level:
            sparsity.sparsify(m, level, "static", 0)
        mode = precision.parse(prec)
        precision.prepare(m, mode)
        checkpoint.apply(m, s, tuple(x.shape))
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        scaler = precision.make_scaler(mode, "cpu")
        tech = Techniques(precision=prec)
        for _ in range(3):
            train_step(m, opt, precision.cast_batch(x, mode), y, tech, scaler=scaler)
        finals.append([t.detach().clone() for t in m.state_dict().values()])
    assert len(finals[0]) == len(finals[1])
    for a, b in zip(*finals):
        assert torch.equal(a, b)


class DropoutChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.5)) for _ in range(4)])
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


@pytest.mark.parametrize("spec", ["block", "every-2", "sqrt", "selective"])
def test_dropout_draws_the_same_mask_when_recomputed(spec: str) -> None:
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    torch.manual_seed(0)
    plain = DropoutChain()
    ckpt = DropoutChain()
    ckpt.load_state_dict(plain.state_dict())
    g0, _ = _grads_and_stats(plain, "none", x, y)
    g1, _ = _grads_and_stats(ckpt, spec, x, y)
    assert any(g.abs().sum() > 0 for g in g0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def _brute_force(costs: list[BlockCost], max_recompute: float, forced: tuple[int, ...] = ()) -> int:
    """The least modelled memory of every segmentation (cut after each block or not; ``forced``: blocks after
    which a cut is always made, the ends of chains)."""
    n, best = len(costs), None
    for cuts in itertools.product([False, True], repeat=n - 1):
        if not all(cuts[i - 1] for i in forced):
            continue
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        spans = list(zip(bounds, bounds[1:]))
        for flags in itertools.product([False, True], repeat=len(spans)):
            segs = [(s, e, f) for (s, e), f in zip(spans, flags)]
            mem, rec = checkpoint.modelled(costs, segs)
            if rec <= max_recompute and (best is None or mem < best):
                best = mem
    assert best is not None
    return best


@pytest.mark.parametrize("trial", range(6))
def test_the_planner_matches_brute_force_on_small_chains(trial: int) -> None:
    rng = random.Random(trial)
    costs = []
    for _ in range(6):
        x = rng.randint(1, 20)
        costs.append(BlockCost(input_bytes=x, saved_bytes=x + rng.randint(0, 60), flops=rng.randint(1, 10)))
    total = sum(c.flops for c in costs)
    for frac in (0.0, 0.2, 0.5, 0.8, 1.0):
        segs = checkpoint.optimal(costs, max_recompute=frac * total)
        mem, rec = checkpoint.modelled(costs, segs)
        assert rec <= frac * total
        assert mem == _brute_force(costs, frac * total)


@pytest.mark.parametrize("trial", range(4))
def test_the_planner_over_several_chains_never_crosses_a_chain_and_matches_brute_force(trial: int) -> None:
    rng = random.Random(100 + trial)
    lengths = [3, 2, 2]
    costs = [BlockCost(x, x + rng.randint(0, 60), rng.randint(1, 10)) for x in (rng.randint(1, 20) for _ in range(7))]
    total = sum(c.flops for c in costs)
    for frac in (0.0, 0.3, 0.6, 1.0):
        segs = checkpoint.optimal(costs, max_recompute=frac * total, lengths=lengths)
        assert all(not (s < 3 < e or s < 5 < e) for s, e, _ in segs)  # no segment spans two chains
        per_chain = checkpoint.split(segs, lengths)
        assert [sum(e - s for s, e, _ in c) for c in per_chain] == lengths and per_chain[1][0][0] == 0
        mem, rec = checkpoint.modelled(costs, segs)
        assert rec <= frac * total
        assert mem == _brute_force(costs, frac * total, forced=(3, 5))
        assert mem >= checkpoint.modelled(costs, checkpoint.optimal(costs, max_recompute=frac * total))[0]


def test_the_memory_budget_form_picks_the_least_recompute_that_fits() -> None:
    costs = [BlockCost(4, 20, 3), BlockCost(4, 30, 5), BlockCost(2, 10, 1), BlockCost(2, 12, 2)]
    front = checkpoint.frontier(costs)
    for mem, rec, segs in front:
        chosen = checkpoint.optimal(costs, max_memory=mem)
        assert checkpoint.modelled(costs, chosen) == (mem, rec)
    with pytest.raises(ValueError, match="no segmentation fits"):
        checkpoint.optimal(costs, max_memory=min(m for m, _, _ in front) - 1)


@pytest.mark.parametrize("spec", SPECS[:-1])
def test_every_strategy_lowers_the_accounted_peak_of_wrn_28_2(spec: str) -> None:
    def peak(s: str) -> int:
        with torch.device("meta"):
            m = build_model("wrn-28-2")
            batch = (torch.empty(32, 3, 32, 32), torch.zeros(32, dtype=torch.long))
        checkpoint.apply(m, s, (32, 3, 32, 32))
        return profile_step(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), batch, F.cross_entropy).peak

    assert peak(spec) < peak("none")


def test_the_trainer_takes_a_checkpoint_strategy() -> None:
    """The trainer's step under a strategy checkpoints the chain and gives the plain step's loss, weights and
    BatchNorm statistics, bit for bit."""
    torch.manual_seed(0)
    plain = build_model("wrn-10-1")
    ckpt = build_model("wrn-10-1")
    ckpt.load_state_dict(plain.state_dict())
    checkpoint.apply(ckpt, Techniques(checkpoint="block").checkpoint)
    assert isinstance(ckpt.blocks, checkpoint.CheckpointedChain) and not isinstance(plain.blocks, checkpoint.CheckpointedChain)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    losses = [train_step(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), x, y) for m in (plain, ckpt)]
    assert losses[0] == losses[1]
    after = plain.state_dict()
    assert list(ckpt.state_dict()) == list(after)
    for name, value in ckpt.state_dict().items():
        torch.testing.assert_close(value, after[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("bad", ["blocks", "every-0", "every-1.5", "optimal", "optimal-x", "sqrt-2"])
def test_unknown_strategies_list_the_valid_ones(bad: str) -> None:
    with pytest.raises(ValueError, match="none, block, every-K, sqrt, selective, optimal-B"):
        checkpoint.parse(bad)


def test_strategies_are_a_registry_and_an_unknown_name_lists_them() -> None:
    from lowmem.techniques import checkpoint

    assert checkpoint.plan("every-2", 5) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert checkpoint.plan("sqrt", 9) == checkpoint.plan("every-3", 9)
    assert checkpoint.plan("none", 4) == [(0, 4, False)]
    for bad in ("fastest", "every", "every-0", "every-1.5", "block-2", "optimal"):
        with pytest.raises(ValueError, match="none, block, every-K, sqrt, selective, optimal-B"):
            checkpoint.parse(bad)
