"""One training step with the paper's four memory levers: plain torch only.

``Techniques`` names a configuration and ``train_step`` runs one optimizer step of any model under it. The WRN
trainer (``lowmem.wrn.train``), the studies' accountants and the GPU check (which runs with a stock PyTorch and
nothing else) share them, so all of them measure the same step; ``lowmem.wrn.step`` builds WRN under a
configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowmem.techniques import checkpoint, compress, microbatch, precision, registry, sparsity


@dataclass(frozen=True)
class Techniques:
    """The paper's four memory levers for one run; all off by default, and any combination can be written.

    Sparsity's storage format (CSR index width) changes only what the accountant counts, not training.
    """

    sparsity: float = 0.0  # fraction of the 3x3 block-conv weights that are zero; 0 = dense, see lowmem.techniques.sparsity
    sparse_method: str = "dsr"  # dsr (dynamic sparse reparameterization) or static (magnitude-pruned at init)
    sparse_format: str = "csr32"  # accounted CSR indices: csr32, or csr16 (16-bit where they fit)
    dsr_periods: tuple[int, ...] = (100, 200, 400, 800)  # steps between rewirings, per phase of the run
    dsr_reallocate: int = 20000  # weights moved per rewiring, for WRN-28-2; scaled to the model's sparse layers
    precision: str = "fp32"  # what is stored in 16 bits, see lowmem.techniques.precision: fp32, mixed-bf16/fp16, half-bf16/fp16
    microbatch: int = 0  # examples per forward/backward pass, gradients accumulated over the batch; 0 = whole batch
    norm: str = "batch"  # normalization layers, see lowmem.techniques.microbatch: batch (per-microbatch statistics), group, renorm
    checkpoint: str = "none"  # gradient-checkpointing strategy, see lowmem.techniques.checkpoint: none, block, every-K, sqrt, ...
    optimizer: str = "sgd"  # beyond the paper: sgd (the recipe's), or an optimizer lever's (lowmem.techniques.registry.optimizers())
    activation_bits: int = 0  # beyond the paper, see lowmem.techniques.compress: bits of each saved activation, 0 = as computed

    def __post_init__(self) -> None:
        if not isinstance(self.sparsity, (int, float)) or not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"sparsity must be in [0, 1) (0 = dense), got {self.sparsity!r}")
        if self.sparse_method not in sparsity.METHODS:
            raise ValueError(f"sparse_method={self.sparse_method!r} is not one of {', '.join(sparsity.METHODS)}")
        object.__setattr__(self, "dsr_periods", tuple(self.dsr_periods))  # a list from YAML; one config key either way
        if self.sparse_format not in sparsity.INDEX_FORMATS:
            raise ValueError(f"sparse_format={self.sparse_format!r} is not one of {', '.join(sparsity.INDEX_FORMATS)}")
        precision.parse(self.precision)
        checkpoint.parse(self.checkpoint)
        if not isinstance(self.microbatch, int) or self.microbatch < 0:
            raise ValueError(f"microbatch must be an integer >= 0 (0 = no microbatching), got {self.microbatch!r}")
        if self.norm not in microbatch.NORMS:
            raise ValueError(f"norm={self.norm!r} is not one of {', '.join(microbatch.NORMS)}")
        registry.check_optimizer(self.optimizer)
        compress.check(self.activation_bits)


def _noop(_: str) -> None:
    pass


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    tech: Techniques = Techniques(),
    mark: Callable[[str], None] = _noop,
    scaler: precision.Scaler | None = None,
) -> torch.Tensor:
    """One optimizer step on the batch (x, y); returns its mean loss, detached (no host sync, so it also runs on the
    meta device for the accountant). ``mark`` names the phases for the accountant. A 16-bit ``tech.precision``
    needs the run's ``scaler`` (``precision.make_scaler``), which may skip the step; fp32 takes none."""
    prec = precision.parse(tech.precision)
    if (scaler is None) != (prec.kind == "fp32"):
        raise ValueError(f"precision {prec.name} needs {'a' if scaler is None else 'no'} loss scaler (precision.make_scaler)")
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=x.device)
    for xb, yb, weight in microbatch.microbatches(x, y, tech.microbatch):
        mark("forward")
        with precision.autocast(prec, x.device.type), compress.compressing(tech.activation_bits):
            out = model(xb)
        # The loss in fp32 even from 16-bit logits (a no-op in fp32); weighted by the microbatch's share of the
        # batch, so the accumulated gradient is the full batch's mean-loss gradient.
        loss = F.cross_entropy(out.float(), yb) * weight
        mark("backward")
        (loss if scaler is None else scaler.scale(loss)).backward()
        total += loss.detach()
    mark("optimizer")
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
    return total
