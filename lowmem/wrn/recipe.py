"""The WRN-28-2 / CIFAR-10 training recipe (paper notes: the DSR authors' setup, which the paper builds on)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lowmem.techniques import registry


@dataclass(frozen=True)
class SGDRecipe:
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4


def make_optimizer(model: nn.Module, recipe: SGDRecipe = SGDRecipe(), name: str = "sgd") -> torch.optim.Optimizer:
    """The recipe's optimizer, or an optimizer lever's (``lowmem.techniques.registry``) with the recipe's settings."""
    return registry.make_optimizer(model.parameters(), name, recipe.lr, recipe.momentum, recipe.nesterov, recipe.weight_decay)
