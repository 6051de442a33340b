"""The memory accountant: where the bytes of one training step go (Sohoni et al. 2019, Sec. 2, "memory profile").

It follows one step (forward, backward, optimizer step) op by op and keeps a ledger of every tensor storage alive
during it. Each storage is put in one category:

- ``model``: parameters and buffers, and the 16-bit working copies autocast makes of the (fp32 master) weights;
- ``gradients``: the ``.grad`` of parameters;
- ``optimizer``: optimizer state (momentum, Adam moments, ...);
- ``activations``: tensors autograd saves for the backward pass;
- ``other``: the batch, and temporaries (the loss, gradients of activations, ...).

Why hand-written: PyTorch's profiler sees allocations only as they really happen, so it cannot run on the meta
device (a full-size model at the paper's batch in seconds) and cannot count a tensor in a storage format other than
its own (16-bit, CSR). Here a ``TorchDispatchMode`` sees every op's outputs, ``saved_tensors_hooks`` names the
tensors saved for backward, and a weakref on each storage records the moment it is freed. Views share a storage and
are counted once.

The ledger itself (``lowmem.memory.ledger``) is the level below: this module runs one step under a ledger
(``account_step``), takes the hooks that levers call to tell the accountings in progress what the ledger cannot
see (``gradient_ready``, ``saved``, ``resizable``), and builds the report: the peak, by category and phase
(``MemoryReport``).

The accounted bytes of a storage come from a pluggable ``StorageFormat``; the default counts ``nbytes``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from lowmem.memory.ledger import StorageRecord, Workspace, _Ledger

CATEGORIES = ("model", "gradients", "optimizer", "activations", "other")
PHASES = ("setup", "forward", "backward", "optimizer")
MIB = 2**20


class StorageFormat(Protocol):
    """Bytes that one storage needs in the format being accounted (dense, 16-bit, CSR, ...)."""

    def __call__(self, record: StorageRecord) -> int: ...


def dense(record: StorageRecord) -> int:
    """The storage as PyTorch holds it."""
    return record.nbytes


@dataclass
class MemoryReport:
    """Peak memory of one training step, by category, in bytes."""

    peak: int
    at_peak: dict[str, int]
    category_max: dict[str, int]
    peak_phase: str
    device: str
    at_peak_roles: dict[str, int] = field(default_factory=dict)  # the peak's bytes by role ("" = unnamed temporaries)
    measured_peak: int | None = None
    measured_method: str = ""
    timeline: list[tuple[str, dict[str, int]]] = field(default_factory=list, repr=False)

    @property
    def gap_pct(self) -> float | None:
        """How far the accounted peak lies from the measured one, in percent of the measured."""
        if not self.measured_peak:
            return None
        return 100.0 * (self.peak - self.measured_peak) / self.measured_peak

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak,
            "peak_phase": self.peak_phase,
            "at_peak_bytes": dict(self.at_peak),
            "category_max_bytes": dict(self.category_max),
            "at_peak_role_bytes": dict(self.at_peak_roles),
            "device": self.device,
            "measured_peak_bytes": self.measured_peak,
            "measured_method": self.measured_method,
            "gap_pct": self.gap_pct,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """A Markdown table of the breakdown at the peak and of each category's own maximum, in MiB."""
        rows = ["| category | at peak (MiB) | own max (MiB) |", "|---|---:|---:|"]
        for c in CATEGORIES:
            rows.append(f"| {c} | {self.at_peak[c] / MIB:.2f} | {self.category_max[c] / MIB:.2f} |")
        rows.append(f"| **total** | **{self.peak / MIB:.2f}** | |")
        if self.measured_peak is not None:
            rows.append(f"| measured ({self.measured_method}) | {self.measured_peak / MIB:.2f} | gap {self.gap_pct:+.2f}% |")
        return "\n".join(rows)


_ledgers: list[tuple[_Ledger, dict[nn.Parameter, str]]] = []  # the steps being accounted now, and their parameter names


def gradient_ready(param: nn.Parameter) -> None:
    """Tells the accountings in progress that ``param.grad`` is a gradient. For an optimizer that steps inside
    backward (``lowmem.techniques.fused_step``): it frees each gradient before the step ends, where the accountant
    would otherwise learn which tensors were gradients."""
    for ledger, names in _ledgers:
        if param.grad is not None:
            ledger.track(param.grad, "grad", names.get(param, ""))


def saved(t: torch.Tensor) -> None:
    """Tells the accountings in progress that ``t`` is kept for backward. For a lever with saved-tensor hooks of its
    own (``lowmem.techniques.compress``): only the innermost pair of hooks runs, so the accountant's ``pack`` never
    sees what such a lever saves."""
    for ledger, _ in _ledgers:
        rec = ledger.track(t)
        if rec is not None:
            rec.saved = True


def resizable(t: torch.Tensor, role: str, name: str = "") -> None:
    """Tells the accountings in progress that ``t``'s storage is resized in place, and what it holds. For FSDP2's
    unsharded parameters (``lowmem.techniques.sharding``): FSDP2 frees them after use by resizing their storage to
    0 bytes and refills the same storage before the next use, which no op the accountant sees does."""
    for ledger, _ in _ledgers:
        ledger.watch(t, role, name)


def _categorize(rec: StorageRecord) -> str:
    if rec.role in ("param", "buffer", "weight-copy"):
        return "model"
    if rec.role in ("grad", "bucket"):
        return "gradients"
    if rec.role == "state":
        return "optimizer"
    if rec.role == "recomputed" or (rec.role != "input" and rec.saved):
        return "activations"
    return "other"


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> Iterable[tuple[str, torch.Tensor]]:
    for p, state in optimizer.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                yield f"{names.get(p, '?')}.{k}", v


StepFn = Callable[[Callable[[str], None]], Any]


def account_step(
    step: StepFn,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Iterable[torch.Tensor] = (),
    fmt: StorageFormat = dense,
    warmup: bool = True,
    workspace: Workspace | None = None,
    held: Iterable[tuple[str, torch.Tensor]] = (),
) -> MemoryReport:
    """Accounts one call of ``step(mark)``, a full training step that calls ``mark(phase)`` as it enters each phase.

    With ``warmup`` the step runs once untracked first, so optimizer state that is created lazily exists, as it
    does in every step but the first. This updates the model like any training step. ``workspace``, if given,
    adds each op's internal workspace (counted as "other") at the moment the op runs. ``held``: (role, tensor)
    that a wrapper keeps for the whole step beyond the model and optimizer (role "bucket": DDP's gradient buckets,
    ``lowmem.techniques.sharding``).
    """
    if warmup:
        step(lambda _: None)
    optimizer.zero_grad(set_to_none=True)  # as measure_step does, so both start from the same live set
    names = {p: n for n, p in model.named_parameters()}
    ledger = _Ledger(workspace)
    for n, p in model.named_parameters():
        ledger.track(p, "param", n)
        if p.grad is not None:
            ledger.track(p.grad, "grad", n)
    for n, b in model.named_buffers():
        ledger.track(b, "buffer", n)
    for n, s in optimizer_tensors(optimizer, names):
        ledger.track(s, "state", n)
    for x in inputs:
        ledger.track(x, "input", "batch")
    for role, t in held:
        ledger.track(t, role)

    def mark(phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; use one of {PHASES}")
        ledger.phase = phase

    _ledgers.append((ledger, names))
    try:
        with ledger, torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda t: t):
            step(mark)
    finally:
        _ledgers.pop()
    # Roles only known at the end: what became a .grad or optimizer state.
    for n, p in model.named_parameters():
        if p.grad is not None:
            ledger.track(p.grad, "grad", n)
    for n, s in optimizer_tensors(optimizer, names):
        ledger.track(s, "state", n)
    return _build_report(ledger, fmt, device=str(next(model.parameters()).device))


def _build_report(ledger: _Ledger, fmt: StorageFormat, device: str) -> MemoryReport:
    n_events = len(ledger.phases)
    delta = [dict.fromkeys(CATEGORIES, 0) for _ in range(n_events + 1)]
    roles = sorted({rec.role for rec in ledger.records})
    role_delta = [dict.fromkeys(roles, 0) for _ in range(n_events + 1)]
    for rec in ledger.records:
        rec.category = _categorize(rec)
        b = fmt(rec)
        delta[rec.alloc][rec.category] += b
        role_delta[rec.alloc][rec.role] += b
        if rec.free is not None:
            delta[rec.free][rec.category] -= b
            role_delta[rec.free][rec.role] -= b
    current = dict.fromkeys(CATEGORIES, 0)
    current_roles = dict.fromkeys(roles, 0)
    cat_max = dict.fromkeys(CATEGORIES, 0)
    peak, at_peak, at_peak_roles, peak_phase = -1, dict(current), dict(current_roles), "setup"
    timeline: list[tuple[str, dict[str, int]]] = []
    for i in range(n_events):
        for c in CATEGORIES:
            current[c] += delta[i][c]
            cat_max[c] = max(cat_max[c], current[c])
        for r in roles:
            current_roles[r] += role_delta[i][r]
        timeline.append((ledger.phases[i], dict(current)))
        total = sum(current.values())
        if total > peak:
            peak, at_peak, at_peak_roles, peak_phase = total, dict(current), dict(current_roles), ledger.phases[i]
    return MemoryReport(peak, at_peak, cat_max, peak_phase, device, at_peak_roles, timeline=timeline)


def standard_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> StepFn:
    """The plain training step: forward, loss, backward, optimizer step, gradients freed before the next one."""
    inputs, targets = batch

    def step(mark: Callable[[str], None]) -> None:
        optimizer.zero_grad(set_to_none=True)
        mark("forward")
        loss = loss_fn(model(inputs), targets)
        mark("backward")
        loss.backward()
        mark("optimizer")
        optimizer.step()

    return step


def profile_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    fmt: StorageFormat = dense,
) -> MemoryReport:
    """Accounts one standard training step of ``model`` on ``batch``. Works on the meta device."""
    return account_step(standard_step(model, optimizer, batch, loss_fn), model, optimizer, batch, fmt)
