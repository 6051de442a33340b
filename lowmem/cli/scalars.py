"""Python numbers read off tensors without values: what the accountant's fake and meta tensors cannot give."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode


def has_values(t: torch.Tensor) -> bool:
    return t.device.type != "meta" and not isinstance(t, FakeTensor)


class HostScalars(TorchDispatchMode):
    """Gives ``.item()`` of a tensor without values (meta, fake) the value 1. Adafactor reads norms and its step
    count as Python numbers, which such a tensor has not; they scale the update but allocate nothing, so the bytes
    are those of a real step (tests/test_cli.py checks Adafactor's account against the real tensors')."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default and not has_values(args[0]):
            return 1.0 if args[0].is_floating_point() else 1
        return func(*args, **(kwargs or {}))
