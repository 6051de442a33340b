"""The WRN-28-2 / CIFAR-10 training recipe (paper notes: the DSR authors' setup, which the paper builds on)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class SGDRecipe:
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4


def make_optimizer(model: nn.Module, recipe: SGDRecipe = SGDRecipe()) -> torch.optim.SGD:
    return torch.optim.SGD(
        model.parameters(), lr=recipe.lr, momentum=recipe.momentum, nesterov=recipe.nesterov, weight_decay=recipe.weight_decay
    )
