"""What ``lowmem profile`` says a CPU holds at the step's peak: the tensors (the accountant), plus each op's scratch
memory (``lowmem.memory.measure.CPUWorkspace``: every distinct op call run once, alone, on real tensors of the
step's shapes), kept on disk so that the next request with the same calls measures nothing.

oneDNN's kernels allocate scratch that no tensor holds; how much depends on the CPU's instruction set and the
library's version (on an AVX2-only AMD EPYC it was a quarter of a ResNet-18 step's peak, on a Xeon about 1%). PyTorch
has no query for it, so it is measured. The cache file is keyed by the CPU class, torch's version and oneDNN's, and
each call's signature (op, shapes, strides, dtypes, scalar arguments); ``LOWMEM_CACHE`` moves it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from lowmem import runs
from lowmem.cpu import cpu_class
from lowmem.memory.measure import CPUWorkspace


def cache_path() -> Path:
    return Path(os.environ.get("LOWMEM_CACHE", Path.home() / ".cache" / "lowmem")) / "cpu_workspace.json"


def machine_key() -> str:
    """What the measured scratch depends on besides the call: the CPU class, torch's and oneDNN's versions, and the
    instruction sets the two are allowed (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``)."""
    found = re.search(r"MKL-DNN (v[\d.]+)", torch.__config__.show())  # torch has no other query for oneDNN's version
    onednn = found.group(1) if found else "none"
    return (f"{cpu_class()} | torch {torch.__version__} | oneDNN {onednn} "
            f"(max ISA {os.environ.get('ONEDNN_MAX_CPU_ISA', 'all')}) | ATen {torch.backends.cpu.get_cpu_capability()}")


class DiskWorkspace(CPUWorkspace):
    """``CPUWorkspace`` with its measurements kept in ``cache_path()`` under ``machine_key()``: ``new`` counts the
    calls measured now, ``cached`` those read back."""

    def __init__(self, path: Path | None = None) -> None:
        super().__init__()
        self.path = path or cache_path()
        self.machine = machine_key()
        data = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.disk: dict[str, int] = data.get(self.machine, {})
        self.new = 0
        self.cached = 0

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> int:
        key = (func, *(self._sig(a) for a in torch.utils._pytree.tree_leaves((args, kwargs))))
        if key in self.cache:
            return self.cache[key]
        text = repr(key)
        if text in self.disk:
            self.cached += 1
            self.cache[key] = self.disk[text]
        else:
            self.new += 1
            self.cache[key] = self.disk[text] = self._measure(func, args, kwargs)
        return self.cache[key]

    def save(self) -> None:
        if not self.new:
            return
        data = json.loads(self.path.read_text()) if self.path.exists() else {}
        data[self.machine] = {**data.get(self.machine, {}), **self.disk}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        runs.atomic_write(self.path, lambda p: Path(p).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n"))
