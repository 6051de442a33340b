"""WRN under a configuration of the four levers, built as the trainer builds it, and one step of it on a random
batch: what every WRN accountant, check and timer of the studies runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from lowmem.techniques import checkpoint, microbatch, precision, sparsity
from lowmem.techniques.step import Techniques, train_step
from lowmem.wrn.models import build_model
from lowmem.wrn.recipe import make_optimizer


def wrn_model(model_name: str, num_classes: int, in_channels: int, tech: Techniques, device: torch.device, seed: int,
               batch_shape: tuple[int, ...]) -> torch.nn.Module:
    """The model as ``lowmem.wrn.train.train`` builds it, in its order: norms, sparse layers, precision, checkpoints."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = build_model(model_name, num_classes=num_classes, in_channels=in_channels)
    microbatch.convert_norm(model, tech.norm)
    if tech.sparsity:
        sparsity.sparsify(model, tech.sparsity, tech.sparse_method, seed)
    precision.prepare(model, precision.parse(tech.precision))
    checkpoint.apply(model, tech.checkpoint, batch_shape)
    return model


def wrn_step(model_name: str, num_classes: int, in_channels: int, image_size: int, batch_size: int, tech: Techniques,
             device: torch.device, seed: int, sync: bool = True) -> tuple[Callable[..., torch.Tensor], torch.nn.Module, torch.optim.Optimizer,
                                                      tuple[torch.Tensor, torch.Tensor]]:
    """``(step, model, optimizer, batch)``: the trainer's step of the model under ``tech`` on a random batch of
    ``batch_size`` images, with the recipe's optimizer; ``step(mark)`` runs it (``mark`` as ``train_step``'s).
    ``sync=False`` for the accountant (a scaler that never reads a flag on the host)."""
    tech = tech if tech.microbatch < batch_size else dataclasses.replace(tech, microbatch=0)
    prec = precision.parse(tech.precision)
    shape = (tech.microbatch or batch_size, in_channels, image_size, image_size)
    model = wrn_model(model_name, num_classes, in_channels, tech, device, seed, shape)
    with torch.device(device):
        x = precision.cast_batch(torch.randn(batch_size, in_channels, image_size, image_size), prec)
        y = torch.randint(0, num_classes, (batch_size,))
    opt = make_optimizer(model)
    scaler = precision.make_scaler(prec, device.type, sync=sync)

    def step(mark: Callable[[str], None] = lambda phase: None) -> torch.Tensor:
        return train_step(model, opt, x, y, tech, mark, scaler)

    return step, model, opt, (x, y)
