"""Microbatching: exact where the model has no batch statistics, per-microbatch statistics where it has BatchNorm."""

import pytest
import torch
from torch import nn

from lowmem.memory.accounting import account_step
from lowmem.techniques.microbatch import BatchRenorm2d, convert_norm, microbatches
from lowmem.wrn.models import build_model
from lowmem.wrn.train import Techniques, train_step


@pytest.mark.parametrize("size", [1, 3, 4, 7, 12, 0])
def test_microbatches_cover_the_batch_with_weights_summing_to_one(size: int) -> None:
    x, y = torch.arange(12.0).view(12, 1), torch.arange(12)
    parts = microbatches(x, y, size)
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert sum(w for _, _, w in parts) == pytest.approx(1.0)
    assert all(len(xb) == (size or 12) for xb, _, _ in parts[:-1])


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, tech: Techniques) -> list[torch.Tensor]:
    """Parameter gradients of one step; lr 0 leaves the weights as they were, so steps can be compared."""
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), x, y, tech)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("batch,micro", [(12, 4), (12, 5), (12, 1), (12, 12)])
def test_microbatched_gradients_equal_the_full_batch_without_batchnorm(batch: int, micro: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x, y = torch.randn(batch, 3, 8, 8), torch.randint(0, 5, (batch,))
    full, accumulated = (_grads(model, x, y, Techniques(microbatch=m)) for m in (0, micro))
    for f, a in zip(full, accumulated):
        torch.testing.assert_close(a, f, rtol=1e-5, atol=1e-6)


def test_microbatching_a_batchnorm_model_changes_its_gradient() -> None:
    # BN normalizes each microbatch with its own statistics, so the gradient is not the full batch's.
    torch.manual_seed(0)
    model = build_model("wrn-10-1")
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    full, micro = (_grads(model, x, y, Techniques(microbatch=m))[0] for m in (0, 2))  # conv1.weight
    assert not torch.allclose(full, micro, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("micro", [1, 3, 5])
def test_groupnorm_wrn_gradients_equal_the_full_batch(micro: int) -> None:
    # GroupNorm has no batch statistics, so microbatching a WRN with it is exact up to float rounding.
    torch.manual_seed(0)
    model = convert_norm(build_model("wrn-10-1"), "group")
    x, y = torch.randn(10, 3, 32, 32), torch.randint(0, 10, (10,))
    full, accumulated = (_grads(model, x, y, Techniques(microbatch=m, norm="group")) for m in (0, micro))
    for f, a in zip(full, accumulated):
        torch.testing.assert_close(a, f, rtol=1e-4, atol=1e-6)


def test_each_microbatch_is_normalized_with_its_own_statistics_and_running_stats_follow() -> None:
    torch.manual_seed(0)
    model = build_model("wrn-10-1")
    bn = model.blocks[0].bn1
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    bn.register_forward_hook(lambda m, args, out: seen.append((args[0].detach(), out.detach())))
    start_mean, start_var = bn.running_mean.clone(), bn.running_var.clone()
    x, y = torch.randn(12, 3, 32, 32), torch.randint(0, 10, (12,))
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), x, y, Techniques(microbatch=5))
    assert [len(i) for i, _ in seen] == [5, 5, 2]
    mean, var = start_mean, start_var
    for inp, out in seen:
        mu, v = inp.mean(dim=(0, 2, 3)), inp.var(dim=(0, 2, 3), unbiased=False)
        expected = (inp - mu.view(1, -1, 1, 1)) / (v.view(1, -1, 1, 1) + bn.eps).sqrt() * bn.weight.view(1, -1, 1, 1) + bn.bias.view(1, -1, 1, 1)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        # The documented expectation: one momentum update per microbatch, unbiased variance, in order.
        n = inp.numel() / inp.size(1)
        mean = (1 - bn.momentum) * mean + bn.momentum * mu
        var = (1 - bn.momentum) * var + bn.momentum * v * n / (n - 1)
    torch.testing.assert_close(bn.running_mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, var, rtol=1e-5, atol=1e-6)
    assert int(bn.num_batches_tracked) == 3


def test_activation_bytes_scale_linearly_with_the_microbatch() -> None:
    with torch.device("meta"):
        model = build_model("wrn-28-2")
        x, y = torch.empty(16, 3, 32, 32), torch.zeros(16, dtype=torch.long)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def activations(b: int) -> int:
        step = lambda mark: train_step(model, opt, x, y, Techniques(microbatch=b), mark)  # noqa: E731
        return account_step(step, model, opt, (x, y)).category_max["activations"]

    a2, a4, a8 = (activations(b) for b in (2, 4, 8))  # b = 1 would cost 16 accounted passes, and adds no check
    # Affine in b: saved feature maps grow with b, BN's per-channel statistics do not.
    slope = (a4 - a2) // 2
    assert slope > 0 and a4 - a2 == 2 * slope
    assert a8 - a4 == 4 * slope


def test_batch_renorm_starts_as_batchnorm_and_stays_finite() -> None:
    torch.manual_seed(0)
    brn, bn = BatchRenorm2d(4, warmup=10), nn.BatchNorm2d(4)
    x = torch.randn(6, 4, 5, 5) * 3 + 1
    torch.testing.assert_close(brn(x), bn(x), rtol=1e-4, atol=1e-5)  # r_max = 1, d_max = 0 at the start
    torch.testing.assert_close(brn.running_mean, bn.running_mean)
    torch.testing.assert_close(brn.running_var, bn.running_var)
    for _ in range(20):
        out = brn(torch.randn(2, 4, 5, 5) * 3 + 1)
    assert torch.isfinite(out).all()
    brn.eval()
    bn.load_state_dict(brn.state_dict())
    bn.eval()
    torch.testing.assert_close(brn(x), bn(x))  # inference uses the running statistics, like BatchNorm


def test_convert_norm_replaces_every_batchnorm() -> None:
    for norm, cls in (("group", nn.GroupNorm), ("renorm", BatchRenorm2d)):
        m = convert_norm(build_model("wrn-16-2"), norm)
        kinds = {type(mod) for mod in m.modules() if isinstance(mod, (nn.BatchNorm2d, nn.GroupNorm))}
        assert kinds == {cls}
        assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="batch, group, renorm"):
        convert_norm(build_model("wrn-10-1"), "layer")


def test_norms_are_a_registry_and_an_unknown_name_lists_them() -> None:
    from lowmem.techniques import microbatch

    assert microbatch.NORMS == ("batch", "group", "renorm")
    with pytest.raises(ValueError, match="batch, group, renorm"):
        microbatch.convert_norm(nn.Sequential(nn.BatchNorm2d(8)), "layer")
    m = microbatch.convert_norm(nn.Sequential(nn.BatchNorm2d(8), nn.Sequential(nn.BatchNorm2d(16))), "group")
    assert [type(x).__name__ for x in m.modules()] == ["Sequential", "GroupNorm", "Sequential", "GroupNorm"]
