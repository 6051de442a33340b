"""GPUs by name, for ``lowmem plan --budget NAME``: the memory a training step can use on each, and how that is known.

A device's memory is nvidia-smi's ``memory.total``, cited in ``devices.yaml``. What a step can use is that less what
the CUDA context and the libraries hold (cuBLAS keeps a workspace from its first call on). Those are deducted only
where this project measured them: for a GPU the GPU check ran on (``lowmem.studies.gpu_check``), its files say the
total and the library memory it found beside the step. The CUDA context is not measured yet, so nothing is deducted
for it, and ``Budget.notes`` says so: the budget is then an upper bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

MIB = 2**20
TABLE = Path(__file__).with_name("devices.yaml")
ROOT = Path(__file__).parents[2]  # the checkout, whose metrics/ hold the GPU check's measurements


@dataclass(frozen=True)
class Budget:
    """The bytes a training step can use on a named device, what was deducted, and what was not."""

    device: str
    name: str
    bytes: int
    total: int
    deducted: dict[str, int]  # what: bytes, each measured
    notes: tuple[str, ...]  # where each figure comes from, and what is not deducted


def names(table: Path = TABLE) -> list[str]:
    return list(yaml.safe_load(table.read_text())["devices"])


def budget(device: str, table: Path = TABLE, root: Path = ROOT) -> Budget:
    """The budget of ``device`` (a name of ``devices.yaml``); ValueError naming the known ones otherwise."""
    devices = yaml.safe_load(table.read_text())["devices"]
    if device not in devices:
        raise ValueError(f"unknown device {device!r}: one of {', '.join(devices)}")
    entry = devices[device]
    deducted: dict[str, int] = {}
    if "measured" in entry:
        if not (root / entry["measured"]).is_dir():
            raise ValueError(f"device {device!r} is known from this project's GPU check, in {entry['measured']}/ of a "
                             "checkout, which this installation lacks: give --budget in bytes (e.g. 140GiB)")
        total, library, where = _measured(root / entry["measured"], entry["name"])
        notes = [f"{entry['name']}: {total / MIB:,.0f} MiB (nvidia-smi memory.total, {where})"]
        if library is not None:
            deducted["library memory"] = library
            notes.append(f"less {library / MIB:.1f} MiB of library memory held beside the baseline step (cuBLAS's "
                         f"workspace; {where})")
    else:
        total = entry["total_mib"] * MIB
        notes = [f"{entry['name']}: {entry['total_mib']:,} MiB (nvidia-smi memory.total; {entry['source']})"]
        notes.append("library memory (cuBLAS's workspace, cuDNN's) not deducted: not measured on this GPU here")
    notes.append("CUDA context not deducted: not measured here, so this budget is an upper bound")
    return Budget(device, entry["name"], total - sum(deducted.values()), total, deducted, tuple(notes))


def _measured(folder: Path, name: str) -> tuple[int, int | None, str]:
    """(total bytes, library bytes beside the baseline step or None, where) from the GPU check's files in ``folder``."""
    smi = (folder / "nvidia_smi.txt").read_text().splitlines()
    head = [h.strip() for h in smi[0].split(",")]
    row = next(dict(zip(head, (v.strip() for v in line.split(",")))) for line in smi[1:] if line.startswith(name))
    total = int(row["memory.total [MiB]"].removesuffix(" MiB")) * MIB
    check = json.loads((folder / "gpu_check.json").read_text())
    base = next((r for r in check["memory"] if r["configuration"] == "baseline"), None)
    library = None if base is None or base.get("persistent_library_mib") is None else round(base["persistent_library_mib"] * MIB)
    return total, library, f"this project's GPU check of {check['when'][:10]}, torch {check['torch']}"
