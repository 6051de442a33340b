"""The accountant's peak for one WRN training step under any configuration of the four levers, at full size.

No data and no device: the step runs on meta tensors, or on fake CPU tensors where autocast needs a device type
(mixed modes, see ``lowmem.techniques.precision.shapes_only``). A sparse pattern is laid out on meta first, because a fake
tensor cannot pick positions (data-dependent shapes).

A step of k microbatches repeats microbatch 2's memory in microbatches 3 .. k-1: each starts from the same live
tensors (weights, gradients, optimizer state, the whole batch) and runs the same ops on the same shapes. So
``skip_repeats`` follows microbatches 1, 2 and the last one (a step on the first 3b examples of the same batch
storage), which keeps a microbatch of 1 at seconds instead of a minute; tests/test_combinations.py checks that
this gives the same bytes in every category as following all k.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lowmem.memory.accounting import MemoryReport, StorageFormat, account_step, dense
from lowmem.memory.ledger import Workspace
from lowmem.techniques import checkpoint, precision, sparsity
from lowmem.techniques.step import Techniques, train_step
from lowmem.wrn.recipe import make_optimizer
from lowmem.wrn.step import wrn_model


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model and batch a step is accounted at: WRN-28-2 on CIFAR-10 images at B = 128 unless told."""

    model: str = "wrn-28-2"
    batch_size: int = 128
    num_classes: int = 10
    in_channels: int = 3
    image_size: int = 32


def storage_format(model: torch.nn.Module, tech: Techniques, as_stored: bool = False) -> StorageFormat:
    """CSR for a sparse model (``tech.sparse_format``'s index width), or every tensor as PyTorch stores it: what a
    memory counter sees (``as_stored``), and what a dense model is."""
    if not tech.sparsity or as_stored:
        return dense
    return sparsity.CSRFormat(model, 2 if tech.sparse_format == "csr16" else 4)


def account(tech: Techniques, shape: Shape = Shape(), seed: int = 0, skip_repeats: bool = True, as_stored: bool = False,
            workspace: Workspace | None = None) -> MemoryReport:
    """The accounted report of one full training step of ``shape`` under ``tech`` (see the module's docstring)."""
    prec = precision.parse(tech.precision)
    B, b = shape.batch_size, tech.microbatch
    in_shape = (b or B, shape.in_channels, shape.image_size, shape.image_size)
    mixed = prec.kind == "mixed"
    model = wrn_model(shape.model, shape.num_classes, shape.in_channels, dataclasses.replace(tech, checkpoint="none"),
                      torch.device("meta"), seed, in_shape)
    ctx = FakeTensorMode(allow_non_fake_inputs=True) if mixed else torch.device("meta")
    device = torch.device("cpu") if mixed else torch.device("meta")
    with ctx:
        if mixed:
            model.to_empty(device=device)
        checkpoint.apply(model, tech.checkpoint, in_shape)
        x = precision.cast_batch(torch.empty(B, shape.in_channels, shape.image_size, shape.image_size, device=device), prec)
        y = torch.zeros(B, dtype=torch.long, device=device)
        opt = make_optimizer(model, name=tech.optimizer)
        scaler = precision.make_scaler(prec, device.type, sync=False)
        n = 3 * b if skip_repeats and b and B // b > 3 and B % b == 0 else B
        fmt = storage_format(model, tech, as_stored)
        return account_step(lambda mark: train_step(model, opt, x[:n], y[:n], tech, mark, scaler), model, opt, (x, y),
                            fmt=fmt, workspace=workspace)
