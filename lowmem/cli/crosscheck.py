"""The accountant against PyTorch's own ``MemTracker`` (``torch.distributed._tools.mem_tracker``), on the same model
and step, both on fake CPU tensors: total peaks and the breakdown at each one's peak.

The two categorize differently. MemTracker's ``Activation`` is every tensor made in the forward pass and still
alive, saved for backward or not; the accountant's ``activations`` are the tensors autograd saves (its other
forward tensors are ``other``). MemTracker files the batch and the loss's tensors as ``Temp`` or ``Input`` where the
accountant says ``other``. So the totals should agree where both see the same storages, and the categories need
not; ``TOTALS`` maps both to the accountant's five categories for the table.
"""

from __future__ import annotations

from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from lowmem.cli import models
from lowmem.cli.profile import Request, account, chains, step_of
from lowmem.memory.accounting import CATEGORIES
from lowmem.techniques import precision
from lowmem.techniques.step import Techniques

# MemTracker's reference types, under the accountant's category names.
TOTALS = {"Parameter": "model", "Buffer": "model", "Gradient": "gradients", "Optstate": "optimizer",
          "Activation": "activations", "Temp": "other", "Input": "other", "Other": "other"}


def memtracker(req: Request, tech: Techniques = Techniques()) -> dict[str, Any]:
    """MemTracker's peak of one step (after a warm-up step, as the accountant's) and its breakdown at that peak,
    beside the accountant's, in bytes."""
    model = precision.prepare(models.build(req.spec, "meta"), precision.parse(tech.precision))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        step, model, opt, (x, y) = step_of(req, tech, "cpu", model=model)
        step(lambda _: None)  # optimizer state exists, as in every step but the first
        opt.zero_grad(set_to_none=True)
        mt = MemTracker()
        mt.track_external(model, opt, x, y)
        with mt:
            step(lambda _: None)
        snap = next(iter(mt.get_tracker_snapshot("peak").values()))
    theirs = dict.fromkeys(CATEGORIES, 0)
    for kind, b in snap.items():
        if kind in TOTALS:
            theirs[TOTALS[kind]] += b
    ours = account(req, tech)
    return {"model": req.model, "memtracker_peak": snap["Total"], "accountant_peak": ours.peak,
            "gap_pct": 100 * (ours.peak - snap["Total"]) / snap["Total"],
            **{f"memtracker_{c}": theirs[c] for c in CATEGORIES}, **{f"accountant_{c}": ours.at_peak[c] for c in CATEGORIES}}


# The families of the README's table, small, each plain and with checkpointing where it has chains of blocks.
FAMILIES = {
    "residual CNN": Request("torchvision:resnet18", 8, (3, 64, 64), "adamw"),
    "depthwise + squeeze-excitation CNN": Request("torchvision:mobilenet_v3_small", 8, (3, 64, 64), "adamw"),
    "attention + embeddings": Request("lowmem.cli.examples:transformer", 8, (64,), "adamw", 1000),
    "recurrent (GRU)": Request("lowmem.cli.examples:gru", 8, (64,), "adamw", 1000),
    "recurrent (LSTM)": Request("lowmem.cli.examples:lstm", 8, (64,), "adamw", 1000),
    "1-d convolutions": Request("lowmem.cli.examples:conv1d", 8, (8, 256), "adamw"),
}


def table() -> Any:
    """One row per family and checkpointing (none, sqrt), in MiB."""
    import pandas as pd

    rows = []
    for family, req in FAMILIES.items():
        for ckpt in ("none", "sqrt"):
            if ckpt != "none" and not chains(models.build(req.spec, "meta")):
                continue
            r = memtracker(req, Techniques(checkpoint=ckpt))
            rows.append({"family": family, "checkpoint": ckpt, **{k: (v / 2**20 if isinstance(v, int) else v)
                                                                for k, v in r.items()}})
    return pd.DataFrame(rows)


CAPTION = ("The accountant against PyTorch's MemTracker (torch.distributed._tools.mem_tracker), one training step "
           "after a warm-up step, both on fake CPU tensors, AdamW; MiB. Peaks are totals; the categories are at each "
           "tool's own peak, MemTracker's under the accountant's names (lowmem.cli.crosscheck.TOTALS): MemTracker "
           "counts every live forward tensor as an activation and the optimizer step's temporaries as optimizer "
           "state, the accountant only tensors saved for backward, and the rest as other.")


if __name__ == "__main__":
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, required=True, help="write the Markdown table here (and a CSV beside it)")
    out = ap.parse_args().table
    t = table()
    t.to_csv(out.with_suffix(".csv"), index=False)
    out.write_text(CAPTION + "\n\n" + t.round(2).to_markdown(index=False) + "\n")
