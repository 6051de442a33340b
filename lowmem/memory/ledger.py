"""The accountant's ledger: every tensor storage alive during one training step, and when each is freed.

``_Ledger``, a ``TorchDispatchMode``, sees every op's outputs and records each new storage (``StorageRecord``);
its ``pack``, as a ``saved_tensors_hooks`` pack hook, marks what autograd saves for backward; a weakref on each
storage records the moment it is freed, and storages resized in place are followed at each op. Views share a
storage and are counted once. A ``Workspace`` model adds each op's scratch memory as a spike at the op, and
``recomputing`` marks what gradient checkpointing recomputes. ``forward_saved_bytes`` runs one module's forward
under a ledger of its own. ``lowmem.memory.accounting`` runs a whole training step under a ledger and builds the
report from its records.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

_recomputing = 0  # > 0 while gradient checkpointing recomputes a segment's forward


@dataclass
class StorageRecord:
    """One storage in the ledger. ``name`` is the parameter (or buffer) it belongs to, where it belongs to one."""

    nbytes: int
    dtype: torch.dtype
    numel: int
    alloc: int  # event index at which it appeared
    free: int | None = None  # event index at which it was freed; None if alive at the end
    saved: bool = False  # saved for backward by autograd
    role: str = ""  # "param", "buffer", "weight-copy", "grad", "state", "input", "recomputed" where known
    name: str = ""
    category: str = "other"


class Workspace(Protocol):
    """Bytes an op allocates internally beyond its outputs (a backend property; see ``lowmem.memory.measure``)."""

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> int: ...


class _Ledger(TorchDispatchMode):
    """Records every storage an op creates, and when each is freed."""

    def __init__(self, workspace: Workspace | None = None) -> None:
        super().__init__()
        self.workspace = workspace
        self.records: list[StorageRecord] = []
        self.phases: list[str] = []  # phase of each event
        self.phase = "setup"
        self._live: dict[int, int] = {}  # id(storage) -> record index
        self._refs: dict[int, weakref.ref] = {}
        self._resizable: dict[int, tuple[torch.UntypedStorage, StorageRecord]] = {}  # see ``resizable``

    def _event(self) -> int:
        self.phases.append(self.phase)
        return len(self.phases) - 1

    def track(self, t: torch.Tensor, role: str = "", name: str = "") -> StorageRecord | None:
        if is_traceable_wrapper_subclass(t):
            # A DTensor (FSDP2's sharded parameter) holds no storage of its own: its bytes are its local shard's.
            inner = [self.track(x, role, name) for a in t.__tensor_flatten__()[0]
                     if isinstance(x := getattr(t, a), torch.Tensor)]
            return inner[0] if len(inner) == 1 else None
        if t.layout != torch.strided:
            return None
        st = t.untyped_storage()
        key = id(st)
        if key in self._live:
            rec = self.records[self._live[key]]
        else:
            idx = len(self.records)
            rec = StorageRecord(st.nbytes(), t.dtype, st.nbytes() // t.element_size(), self._event())
            if _recomputing:
                # Recomputed forward tensors are kept for the segment's backward by checkpoint's own hooks, not ours.
                rec.role = "recomputed"
            self.records.append(rec)
            self._live[key] = idx
            # PyTorch keeps a storage's Python object alive as long as the storage, so this fires on the real free.
            self._refs[key] = weakref.ref(st, lambda _, key=key, idx=idx: self._freed(key, idx))
        if role and not rec.role:
            rec.role, rec.name = role, name
        return rec

    def watch(self, t: torch.Tensor, role: str, name: str) -> None:
        st = t.untyped_storage()
        rec = self.track(t, role, name) if st.nbytes() else None
        self._resizable.setdefault(id(st), (st, rec or StorageRecord(0, t.dtype, 0, self._event(), free=0, role=role, name=name)))

    def _resized(self) -> None:
        # A storage resized in place (FSDP2 frees and refills its unsharded parameters so) keeps its Python object,
        # so no weakref fires: its size is compared at each op instead.
        for key, (st, rec) in self._resizable.items():
            n = st.nbytes()
            if n == (rec.nbytes if rec.free is None else 0):
                continue
            if rec.free is None:
                rec.free = self._event()
            if n:
                new = StorageRecord(n, rec.dtype, n // rec.dtype.itemsize, self._event(), role=rec.role, name=rec.name)
                self.records.append(new)
                self._live[key] = len(self.records) - 1
                rec = new
            else:
                self._live.pop(key, None)
            self._resizable[key] = (st, rec)

    def _freed(self, key: int, idx: int) -> None:
        self.records[idx].free = self._event()
        self._live.pop(key, None)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self._resizable:
            self._resized()
        out = func(*args, **(kwargs or {}))
        if self._resizable:
            self._resized()
        role, name = "", ""
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            # A cast of a parameter is autocast's working copy of a weight (mixed precision): model memory.
            src = self._live.get(id(args[0].untyped_storage())) if args[0].layout == torch.strided else None
            if src is not None and self.records[src].role == "param":
                role, name = "weight-copy", self.records[src].name
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t, role, name)
        if self.workspace is not None:
            ws = self.workspace(func, args, kwargs or {})
            if ws > 0:  # a spike on top of the op's outputs, gone when the op returns
                rec = StorageRecord(ws, torch.uint8, ws, self._event(), role="workspace")
                rec.free = self._event()
                self.records.append(rec)
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        rec = self.track(t)
        if rec is not None:
            rec.saved = True
        # A detached alias shares the storage, so saving it costs nothing and avoids a grad_fn <-> output cycle.
        return t.detach()


@contextmanager
def recomputing() -> Iterator[None]:
    """Marks tensors created inside as recomputed activations (entered by ``lowmem.techniques.checkpoint`` on recompute)."""
    global _recomputing
    _recomputing += 1
    try:
        yield
    finally:
        _recomputing -= 1


def forward_saved_bytes(module: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes autograd saves when ``module`` runs forward on ``inputs``: its inputs count if saved, its parameters
    and buffers do not. Works on the meta device; the per-block costs of the checkpoint planner come from here."""
    ledger = _Ledger()
    for t in (*module.parameters(), *module.buffers()):
        ledger.track(t, "param")
    with ledger, torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda t: t):
        module(*inputs)
    return sum(r.nbytes for r in ledger.records if r.saved and r.role != "param")
