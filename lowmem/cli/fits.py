"""Does a step fit: the budget as a size or a device's name, ``lowmem plan --check`` (exit 0 fits, 1 does not) and
``lowmem plan --max-batch`` (the largest batch that fits, under the plain step or named levers)."""

from __future__ import annotations

import dataclasses

from lowmem.cli.models import SpecError
from lowmem.cli.plan import budget_bytes, followed
from lowmem.cli.profile import Request
from lowmem.memory import devices
from lowmem.techniques import short_names
from lowmem.techniques.step import Techniques

PLANNED = ("precision", "microbatch", "checkpoint", "activation_bits")  # the Techniques fields --levers may set
MAX_BATCH_CAP = 2**16  # the batch search stops here: a batch that still fits is reported as "at least" this


def budget(text: str) -> tuple[int, tuple[str, ...]]:
    """(bytes, where they come from) of ``--budget``: a size (4GiB, 512MiB, 1.5GB) or a device of
    ``lowmem.memory.devices`` (t4, a100-40gb, h100-80gb, ...), less what was measured of its context and libraries."""
    if text in devices.names():
        try:
            b = devices.budget(text)
        except ValueError as e:
            raise SpecError(str(e)) from None
        return b.bytes, b.notes
    try:
        return budget_bytes(text), ()
    except SpecError:
        raise SpecError(f"budget {text!r} is neither a size with a unit (e.g. 4GiB, 512MiB, 1.5GB) nor a device: one of "
                        f"{', '.join(devices.names())}") from None


def parse_levers(text: str) -> Techniques:
    """'mixed-bf16+microbatch-8+checkpoint-block+activations-8' (the levers' short names,
    ``lowmem.techniques.short_names.parse``; 'plain' for none) as Techniques."""
    try:
        fields = short_names.parse(text)
        other = sorted(set(fields) - set(PLANNED))
        if other:  # the optimizer is --optimizer's, and sparsity is the model's own choice
            raise ValueError(f"--max-batch plans {', '.join(PLANNED)} only, not {', '.join(other)}")
        return Techniques(**fields)
    except (TypeError, ValueError) as e:
        raise SpecError(f"--levers {text!r}: {e}") from None


def peak(req: Request, tech: Techniques = Techniques()) -> int:
    """The accounted peak of ``req``'s step under ``tech``, as ``lowmem plan`` accounts it."""
    return followed(req, tech).peak


@dataclasses.dataclass(frozen=True)
class MaxBatch:
    batch: int  # the largest batch that fits; 0 when the smallest does not
    peak: int  # its peak (the smallest batch's when none fits)
    smallest_peak: int  # the peak at the smallest batch (one example per device)
    capped: bool  # the search stopped at its cap with the batch still fitting: the answer is at least ``batch``


def max_batch(req: Request, limit: int, tech: Techniques = Techniques(), cap: int = MAX_BATCH_CAP) -> MaxBatch:
    """The largest batch whose step fits ``limit`` bytes under ``tech``. Batches are multiples of ``req.devices``
    (each device steps on its share); the peak grows with the batch, so the search doubles, then bisects."""
    unit = req.devices

    def at(k: int) -> int:
        return peak(dataclasses.replace(req, batch=k * unit), tech)

    first = at(1)
    if first > limit:
        return MaxBatch(0, first, first, False)
    lo, lo_peak, hi = 1, first, 2
    while True:
        if hi * unit > cap:
            return MaxBatch(lo * unit, lo_peak, first, True)
        p = at(hi)
        if p > limit:
            break
        lo, lo_peak, hi = hi, p, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = at(mid)
        if p <= limit:
            lo, lo_peak = mid, p
        else:
            hi = mid
    return MaxBatch(lo * unit, lo_peak, first, False)
