"""The CPU as the budgets and the measured tables tell machines of this kind apart."""

from __future__ import annotations

from pathlib import Path


def cpu_class(cpuinfo: str | None = None) -> str:
    """The CPU's model and its widest vector instructions (AMX, AVX-512 or AVX2): bf16 training is about 30x slower
    without AVX-512's bf16 or AMX, and oneDNN's kernels, with their scratch memory, differ by instruction set."""
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "unknown CPU")
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []))
    isa = ("AVX-512, AMX" if "amx_bf16" in flags else "AVX-512, bf16" if "avx512_bf16" in flags
           else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2")
    return f"{model} ({isa})"
