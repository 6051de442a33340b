"""Microbatching (Sohoni et al. 2019, Sec. 4, "microbatching"): a minibatch of B examples runs forward and backward
as microbatches of b, the gradients accumulate, and one optimizer step follows. Activation memory then scales with b.

The loss of each microbatch is weighted by its share of the minibatch, so the accumulated gradient is the
minibatch's mean-loss gradient for any b, also when b does not divide B and the last microbatch is smaller. That
holds exactly only for models without batch statistics: BatchNorm normalizes each microbatch with its own mean and
variance, which is the accuracy risk. The normalizations offered, per run:

- ``batch``: BatchNorm with per-microbatch statistics (plain microbatching, the paper's setting);
- ``group``: GroupNorm (Wu & He 2018), which has no batch statistics, so microbatching is exact; it saves a mean
  and an inverse std per sample and group instead of per channel;
- ``renorm``: batch renormalization (Ioffe 2017), which corrects each microbatch's statistics towards the running
  ones, within limits r_max and d_max that widen over the first updates. PyTorch has no batch renormalization
  layer, hence ``BatchRenorm2d`` below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def microbatches(x: torch.Tensor, y: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(inputs, targets, weight) for each microbatch of ``size`` (0 = the whole batch); the weights sum to 1."""
    if size < 0:
        raise ValueError(f"microbatch size must be >= 0 (0 = no microbatching), got {size}")
    size = size or len(x)
    return [(xb, yb, len(xb) / len(x)) for xb, yb in zip(x.split(size), y.split(size))]


class BatchRenorm2d(nn.BatchNorm2d):
    """Batch renormalization: x_hat = (x - mu_B) / sigma_B * r + d, with r = sigma_B / sigma and d = (mu_B - mu) /
    sigma taken from the running statistics, clipped to [1/r_max, r_max] and [-d_max, d_max], and not
    back-propagated through. r_max and d_max grow linearly from 1 and 0 to their limits over ``warmup`` training
    forwards, so training starts as plain BatchNorm while the running statistics settle."""

    def __init__(self, num_features: int, r_max: float = 3.0, d_max: float = 5.0, warmup: int = 500, **kw: object) -> None:
        super().__init__(num_features, **kw)  # type: ignore[arg-type]
        self.r_limit, self.d_limit, self.warmup = r_max, d_max, warmup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        assert self.running_mean is not None and self.running_var is not None and self.num_batches_tracked is not None
        ramp = min(1.0, float(self.num_batches_tracked) / max(1, self.warmup)) if x.device.type != "meta" else 1.0
        r_max, d_max = 1.0 + (self.r_limit - 1.0) * ramp, self.d_limit * ramp
        mean = x.mean(dim=(0, 2, 3))
        var = x.var(dim=(0, 2, 3), unbiased=False)
        std = (var + self.eps).sqrt()
        running_std = (self.running_var + self.eps).sqrt()
        r = (std.detach() / running_std).clamp(1 / r_max, r_max)
        d = ((mean.detach() - self.running_mean) / running_std).clamp(-d_max, d_max)
        # ((x - mean) / std * r + d) * weight + bias, folded into one per-channel scale and shift so that autograd
        # saves the input once (as BatchNorm does) rather than every elementwise intermediate.
        scale = r / std * self.weight
        shift = self.bias + self.weight * d - mean * scale
        with torch.no_grad():
            n = x.numel() / x.size(1)
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / max(n - 1, 1), self.momentum)
            self.num_batches_tracked.add_(1)
        return x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)


def _group_norm(bn: nn.BatchNorm2d, name: str, groups: int) -> nn.Module:
    c = bn.num_features
    if c % groups:
        raise ValueError(f"GroupNorm with {groups} groups needs channels divisible by {groups}; {name} has {c}")
    return nn.GroupNorm(groups, c, eps=bn.eps)


def _batch_renorm(bn: nn.BatchNorm2d, name: str, groups: int) -> nn.Module:
    return BatchRenorm2d(bn.num_features, eps=bn.eps, momentum=bn.momentum)


LEVER = dict(  # lowmem.techniques.registry
    name="microbatching",
    what="the batch run as microbatches whose gradients accumulate: activations of one microbatch at a time",
    settings=(0, "examples per microbatch, dividing the batch"),
    field="microbatch",
    short="microbatch-N",
    wrn="Techniques(microbatch=M, norm=batch|group|renorm): BatchNorm then normalizes each microbatch on its own",
    fairseq="fairseq's --update-freq K with --max-tokens T/K, or the plugin's exact --microbatches K",
    any_model="lowmem plan's microbatch column: the largest microbatch that fits, by bisection",
    accounted="the step accounted at the microbatch's size; gradients and state at the model's",
    exact="exact up to summation order",
    proof="tests/test_microbatch.py::test_microbatched_gradients_equal_the_full_batch_without_batchnorm",
    quality="metrics/microbatching_train.json",
)

# The normalizations, by name: what replaces a BatchNorm2d (None: it stays). Group and renorm are the remedies for
# BatchNorm over small microbatches; GroupNorm makes microbatching exact.
NORM_LAYERS: dict[str, Callable[[nn.BatchNorm2d, str, int], nn.Module] | None] = {
    "batch": None,
    "group": _group_norm,
    "renorm": _batch_renorm,
}
NORMS = tuple(NORM_LAYERS)


def convert_norm(model: nn.Module, norm: str, groups: int = 8) -> nn.Module:
    """Replaces every BatchNorm2d of ``model`` (in place) by the normalization ``norm``; ``batch`` keeps them."""
    if norm not in NORM_LAYERS:
        raise ValueError(f"unknown normalization {norm!r}; use one of {', '.join(NORMS)}")
    make = NORM_LAYERS[norm]
    if make is None:
        return model
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(model, name, make(child, name, groups).to(child.weight.device))
        else:
            convert_norm(child, norm, groups)
    return model
