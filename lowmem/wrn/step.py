"""WRN under a configuration of the four levers, built as the trainer builds it: what the trainer, the accountant's
WRN configurations (``lowmem.wrn.memory``), the combination study and the GPU check all build."""

from __future__ import annotations

import torch

from lowmem.techniques import checkpoint, microbatch, precision, sparsity
from lowmem.techniques.step import Techniques
from lowmem.wrn.models import build_model


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

