"""Wide residual networks (Zagoruyko & Komodakis 2016), pre-activation, for 32x32 inputs.

The paper's image benchmark is WRN-28-2 on CIFAR-10 (Sohoni et al. 2019, Sec. 3). The layout follows the
authors' reference code: BN -> ReLU -> conv inside each block, a 1x1 shortcut where the width or stride
changes, no dropout, and convolutions without bias. WRN-28-2 with 3 input channels and 10 classes has
1,467,610 parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, out_planes: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_planes)
        self.conv2 = nn.Conv2d(out_planes, out_planes, 3, stride=1, padding=1, bias=False)
        self.shortcut: nn.Module | None = None
        if in_planes != out_planes or stride != 1:
            self.shortcut = nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = F.relu(self.bn1(x))
        # The reference code feeds the shortcut the pre-activated input when the shape changes.
        residual = x if self.shortcut is None else self.shortcut(o)
        o = self.conv1(o)
        o = self.conv2(F.relu(self.bn2(o)))
        return o + residual


class WideResNet(nn.Module):
    def __init__(self, depth: int = 28, widen_factor: int = 2, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        if depth < 10 or (depth - 4) % 6 != 0:
            raise ValueError(f"WRN depth must be 6n+4 with n >= 1 (10, 16, 22, 28, ...), got {depth}")
        if widen_factor < 1 or num_classes < 1 or in_channels < 1:
            raise ValueError(
                f"widen_factor, num_classes and in_channels must be >= 1, got {widen_factor}, {num_classes}, {in_channels}"
            )
        n = (depth - 4) // 6
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        layers: list[nn.Module] = []
        for stage, stride in zip(range(3), (1, 2, 2)):
            for i in range(n):
                layers.append(BasicBlock(widths[stage] if i == 0 else widths[stage + 1], widths[stage + 1], stride if i == 0 else 1))
        # A flat Sequential of blocks, so checkpointing can segment the chain at block boundaries.
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(widths[3])
        self.fc = nn.Linear(widths[3], num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.conv1(x))
        x = F.relu(self.bn(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


MODEL_EXAMPLES = ("wrn-28-2", "wrn-16-2", "wrn-28-10")


def parse_model_name(name: str) -> tuple[int, int]:
    """``wrn-<depth>-<widen_factor>`` -> (depth, widen_factor); raises ValueError naming the allowed form."""
    parts = name.split("-") if isinstance(name, str) else []
    if len(parts) != 3 or parts[0] != "wrn" or not (parts[1].isdigit() and parts[2].isdigit()):
        raise ValueError(f"unknown model {name!r}: use 'wrn-<depth>-<width>', e.g. one of {', '.join(MODEL_EXAMPLES)}")
    depth, width = int(parts[1]), int(parts[2])
    if depth < 10 or (depth - 4) % 6 != 0 or width < 1:
        raise ValueError(f"model {name!r}: WRN depth must be 6n+4 >= 10 (10, 16, 22, 28, ...) and width >= 1")
    return depth, width


def build_model(name: str, num_classes: int = 10, in_channels: int = 3) -> WideResNet:
    """Builds a model by name, e.g. ``wrn-28-2``."""
    depth, width = parse_model_name(name)
    return WideResNet(depth, width, num_classes=num_classes, in_channels=in_channels)
