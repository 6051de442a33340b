"""Small models of the families the accountant is tested on beyond CNNs, as ``MODULE:FACTORY`` specs for
``lowmem profile`` (``lowmem.cli.examples:lstm``, ...): each returns logits with the classes last. Token models take
ids below ``VOCAB``."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 1000


class _Recurrent(nn.Module):
    def __init__(self, cell: type[nn.RNNBase], width: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.rnn = cell(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return self.head(out[:, -1])


def lstm() -> nn.Module:
    """Embedding, 2-layer LSTM, linear head on the last step."""
    return _Recurrent(nn.LSTM)


def gru() -> nn.Module:
    """Embedding, 2-layer GRU, linear head on the last step."""
    return _Recurrent(nn.GRU)


class _Encoder(nn.Module):
    def __init__(self, width: int = 128, classes: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))  # (B, T, classes): a token per position


def transformer() -> nn.Module:
    """``nn.TransformerEncoder`` (3 layers, 4 heads) over embeddings, a token prediction per position."""
    return _Encoder()


def conv1d() -> nn.Module:
    """1-d convolutions over a (channels, length) signal, pooled to 10 classes."""
    return nn.Sequential(nn.Conv1d(8, 64, 5, padding=2), nn.ReLU(), nn.Conv1d(64, 64, 5, padding=2), nn.ReLU(),
                         nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(64, 10))
