"""Low precision (Sohoni et al. 2019, the second technique): which training tensors are stored in 16 bits.

"Mixed precision" is not one thing, and which tensors it keeps in fp32 decides how much memory it saves, so each
variant is its own mode, written ``KIND-FORMAT``:

- ``fp32``: the baseline; nothing changes.
- ``mixed-bf16`` / ``mixed-fp16``: ``torch.autocast``. Ops run in 16 bits, so activations are saved in 16 bits,
  but the weights (the fp32 master copy), their gradients and the optimizer state stay fp32, and autocast adds a
  16-bit copy of every weight for the forward pass. fp16 uses ``torch.amp.GradScaler``.
- ``half-bf16`` / ``half-fp16``: the model itself is cast, so weights, gradients, momentum, activations and the
  batch are all 16-bit; no fp32 copy exists anywhere. PyTorch has no scaler for this (``GradScaler`` refuses to
  unscale fp16 gradients), so ``LossScaler`` below is hand-written, with the same kernel ``GradScaler`` uses.

bf16 has fp32's exponent range, so it needs no loss scaling: its scaler keeps the scale at 1 and only guards
against non-finite gradients. In every 16-bit mode a step whose gradients are not finite is skipped (counted), so a
non-finite loss never reaches the weights; when skips pile up (the fp16 scale falls below ``min_scale``, or bf16
skips ``max_skips`` steps in a row) training stops with ``LossScaleCollapse`` rather than going on with NaNs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

FORMATS = {"fp16": torch.float16, "bf16": torch.bfloat16}
MODES = ("fp32", "mixed-bf16", "mixed-fp16", "half-bf16", "half-fp16")

LEVER = dict(  # lowmem.techniques.registry
    name="precision",
    what="which training tensors are stored in 16 bits: activations (mixed) or everything (half)",
    settings=MODES,
    field="precision",
    short="",
    wrn="Techniques(precision=MODE): torch.autocast for mixed, the model cast for half, with the loss scaler",
    fairseq="the plugin's --precision mixed-bf16|half-bf16 (fairseq 0.12 trains 16-bit on CUDA only, with --fp16)",
    any_model="lowmem plan's precision column (fp32, mixed-bf16, half-bf16), and --levers with --max-batch",
    accounted="each tensor at its dtype's bytes, autocast's 16-bit weight copies included",
    exact="lossy",
    proof="tests/test_precision.py::test_16bit_training_of_a_small_problem_reaches_fp32s_loss",
    quality="metrics/precision_train.json",
)


@dataclass(frozen=True)
class Precision:
    kind: str  # "fp32", "mixed" or "half"
    dtype: torch.dtype  # the 16-bit format (float32 for fp32)

    @property
    def name(self) -> str:
        return "fp32" if self.kind == "fp32" else f"{self.kind}-{'fp16' if self.dtype == torch.float16 else 'bf16'}"


def parse(spec: str) -> Precision:
    if spec not in MODES:
        raise ValueError(f"precision {spec!r} is not one of {', '.join(MODES)}")
    if spec == "fp32":
        return Precision("fp32", torch.float32)
    kind, fmt = spec.split("-")
    return Precision(kind, FORMATS[fmt])


def prepare(model: nn.Module, prec: Precision) -> nn.Module:
    """Casts the model's parameters and buffers to 16 bits in half mode (BatchNorm's running statistics included);
    the other modes keep it fp32."""
    return model.to(prec.dtype) if prec.kind == "half" else model


def cast_batch(x: torch.Tensor, prec: Precision) -> torch.Tensor:
    """The input as the model expects it: 16-bit in half mode (autocast casts it itself in mixed mode)."""
    return x.to(prec.dtype) if prec.kind == "half" else x


def autocast(prec: Precision, device_type: str) -> AbstractContextManager[Any]:
    """The forward pass's context: autocast in mixed mode, nothing otherwise."""
    if prec.kind == "mixed" and device_type == "meta":
        raise ValueError(
            "autocast does not act on meta tensors: account mixed precision on fake CPU tensors "
            "(torch._subclasses.fake_tensor.FakeTensorMode), as lowmem.studies.precision does"
        )
    return torch.autocast(device_type, dtype=prec.dtype) if prec.kind == "mixed" else nullcontext()


def shapes_only(prec: Precision) -> tuple[AbstractContextManager[Any], torch.device]:
    """Where to build a full-size step for the accountant: (context, device) with tensors of shapes and dtypes only.

    The meta device, except in mixed modes: autocast acts on a device type and meta is none, so those use fake CPU
    tensors (torch's FakeTensorMode), equally free of data, which autocast sees as CPU tensors. The two give the same
    bytes for the same step (fp32 checked in the tests). Real tensors are taken beside the fake ones: bitsandbytes'
    8-bit optimizers build their code books as real CPU tensors (lowmem.techniques.optimizers._on_cpu)."""
    if prec.kind == "mixed":
        return FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu")
    return nullcontext(), torch.device("meta")


class LossScaleCollapse(FloatingPointError):
    """Training skipped so many steps for non-finite gradients that it cannot go on."""


class LossScaler:
    """Dynamic loss scaling with step skipping, for gradients of any dtype.

    Hand-written because ``torch.amp.GradScaler`` refuses fp16 gradients, which is what half-fp16 has. It follows
    GradScaler's rule (scale x0.5 on a non-finite step, x2 after ``growth_interval`` finite ones) and its fused
    check-and-unscale kernel. ``dynamic=False`` keeps the scale fixed (bf16). ``sync=False`` never reads the
    non-finite flag on the host, so the step runs on tensors without values (the accountant's fake tensors); it
    then always takes the update branch, the one that holds more memory.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        dynamic: bool = True,
        growth_interval: int = 2000,
        min_scale: float = 2.0**-14,
        max_skips: int = 30,
        sync: bool = True,
    ) -> None:
        self.scale_value = init_scale if dynamic else 1.0
        self.dynamic, self.growth_interval, self.min_scale, self.max_skips, self.sync = (
            dynamic, growth_interval, min_scale, max_skips, sync
        )
        self.skipped = 0  # steps skipped so far
        self._run = 0  # consecutive skips
        self._good = 0  # finite steps since the last change of scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value if self.scale_value != 1.0 else loss

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscales the gradients in place and steps, unless one is not finite; returns whether it stepped."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        found_inf = torch.zeros((), device=grads[0].device)
        inv_scale = torch.full((), 1.0 / self.scale_value, device=grads[0].device)
        # GradScaler's own kernel: one pass over the grads, unscaling them and setting found_inf if any is not finite.
        # Its CUDA build has no bf16 (PyTorch 2.11), so half-bf16 on a GPU checks and unscales those grads itself.
        kernel = [g for g in grads if g.device.type != "cuda" or g.dtype != torch.bfloat16]
        if kernel:
            torch._amp_foreach_non_finite_check_and_unscale_(kernel, found_inf, inv_scale)
        for g in grads:
            if g.device.type == "cuda" and g.dtype == torch.bfloat16:
                found_inf += torch.isfinite(g).logical_not().any()
                g.mul_(inv_scale)
        if self.sync and found_inf.item():
            self._skip()
            return False
        optimizer.step()
        self._run = 0
        self._good += 1
        if self.dynamic and self._good >= self.growth_interval:
            self.scale_value *= 2.0
            self._good = 0
        return True

    def _skip(self) -> None:
        self.skipped += 1
        self._run += 1
        self._good = 0
        if self.dynamic:
            self.scale_value /= 2.0
        if self.scale_value < self.min_scale or self._run > self.max_skips:
            raise LossScaleCollapse(
                f"{self._run} steps in a row had non-finite gradients (loss scale now {self.scale_value:g}): the "
                "run diverged. Lower the learning rate, or use a mode that keeps more in fp32 (mixed-*, or bf16)."
            )

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "skipped": self.skipped, "run": self._run, "good": self._good}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_value, self.skipped, self._run, self._good = state["scale"], state["skipped"], state["run"], state["good"]


class AmpScaler:
    """``torch.amp.GradScaler`` (mixed-fp16, where it fits) behind ``LossScaler``'s interface: a step it skips is
    one after which it lowered the scale, as its documentation suggests checking."""

    def __init__(self, device_type: str, min_scale: float = 2.0**-14) -> None:
        self.scaler = torch.amp.GradScaler(device_type)
        self.min_scale = min_scale
        self.skipped = 0

    @property
    def scale_value(self) -> float:
        return self.scaler.get_scale()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() >= before:
            return True
        self.skipped += 1
        if self.scaler.get_scale() < self.min_scale:
            raise LossScaleCollapse(
                f"loss scale fell to {self.scaler.get_scale():g} after repeated non-finite gradients: the run "
                "diverged. Lower the learning rate, or use bf16."
            )
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state["scaler"])
        self.skipped = state["skipped"]


Scaler = LossScaler | AmpScaler


def make_scaler(prec: Precision, device_type: str, sync: bool = True) -> Scaler | None:
    """The scaler a mode trains with: none for fp32 (the baseline, untouched), GradScaler for mixed-fp16, the
    hand-written one otherwise. ``sync=False`` (the accountant) always gives the hand-written one, since GradScaler
    reads its non-finite flag on the host; both unscale in place, so the bytes are the same."""
    if prec.kind == "fp32":
        return None
    fp16 = prec.dtype == torch.float16
    if prec.kind == "mixed" and fp16 and sync:
        return AmpScaler(device_type)
    return LossScaler(dynamic=fp16, sync=sync)
