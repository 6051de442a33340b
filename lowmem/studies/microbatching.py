"""Microbatching of WRN (notebook 05): memory against the microbatch size b at full size on the meta device, and
accuracy and throughput of real training with per-microbatch BatchNorm and its remedies."""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from lowmem.memory.accounting import CATEGORIES, MIB, account_step
from lowmem.studies.params import MicrobatchingParams
from lowmem.techniques.microbatch import convert_norm
from lowmem.wrn.models import build_model
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.recipe import make_optimizer
from lowmem.wrn.train import Techniques, summarize, train_step


def memory(p: MicrobatchingParams) -> pd.DataFrame:
    """Accounted breakdown at the step's peak for each normalization and microbatch size, at batch ``p.batch_size``."""
    rows = []
    for norm in p.norms:
        for b in p.memory_microbatches:
            torch.manual_seed(p.seed)
            with torch.device("meta"):
                model = convert_norm(build_model(p.model, p.num_classes, p.in_channels), norm)
                x = torch.empty(p.batch_size, p.in_channels, p.image_size, p.image_size)
                y = torch.zeros(p.batch_size, dtype=torch.long)
            opt = make_optimizer(model)
            tech = Techniques(microbatch=b if b < p.batch_size else 0, norm=norm)
            r = account_step(lambda mark: train_step(model, opt, x, y, tech, mark), model, opt, (x, y))
            row = {"norm": norm, "microbatch": b, **{f"{c}_mib": r.at_peak[c] / MIB for c in CATEGORIES}}
            rows.append({**row, "peak_mib": r.peak / MIB, "activations_max_mib": r.category_max["activations"] / MIB})
    return pd.DataFrame(rows)


def plan(p: MicrobatchingParams) -> list[tuple[dict[str, Any], BaselineParams, int, Techniques]]:
    """The trained runs: (labels, recipe, seed, techniques) for each (normalization, microbatch size, seed)."""
    base = BaselineParams(**p.train)
    out = []
    for norm in p.train_norms:
        for b in p.train_microbatches:
            size = b if 0 < b < base.batch_size else 0
            out += [({"norm": norm, "microbatch": size or base.batch_size}, base, seed, Techniques(microbatch=size, norm=norm))
                    for seed in p.train_seeds]
    return out


def summary(acc: pd.DataFrame) -> pd.DataFrame:
    """Accuracy (mean, sd over seeds) and throughput per (norm, b), throughput relative to b = B of the same norm."""
    rows = []
    for (norm, b), g in acc.groupby(["norm", "microbatch"], sort=False):
        rows.append({"norm": norm, "microbatch": b, **summarize(g.to_dict("records"))})
    out = pd.DataFrame(rows)
    full = out.groupby("norm").apply(lambda g: g.loc[g.microbatch.idxmax(), "images_per_s"], include_groups=False)
    out["throughput_vs_full_batch"] = out.images_per_s / out.norm.map(full)
    return out.drop(columns=["seeds", "peak_mem_method"])
