"""Levers beyond the paper, trained: 16-bit weights with a Kahan-compensated update (torch-optimi's SGD), against
the recipe in fp32 and in half-bf16, on the combination study's proxy and seeds.

Four arms, each on ``combinations_wrn.train_seeds`` with the training block of ``combinations_wrn`` (so the baseline
and half-bf16 are the combination study's own runs, from the run store where they have run):
- ``baseline``: fp32, the recipe's SGD with Nesterov momentum;
- ``half-bf16``: every tensor in bf16, the same SGD (which rounds small updates away);
- ``optimi-sgd``: fp32 with torch-optimi's SGD, which has no Nesterov momentum: that change alone;
- ``half-bf16+optimi-sgd``: bf16 with torch-optimi's Kahan-compensated SGD.

Each arm's accuracy change is paired over seeds with Student's t (``lowmem.studies.quality.paired``), against the
baseline and, for the Kahan arm, against its two neighbours, which separate what Kahan summation recovers from
what dropping Nesterov costs. Memory is accounted at full size (WRN-28-2 at B = 128, ``combinations_wrn.wrn``).

    python -m lowmem.studies.levers --metrics metrics/levers_train.json --table figures/11_levers_kahan.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from lowmem import runs
from lowmem.config import ParamError
from lowmem.memory.accounting import CATEGORIES
from lowmem.studies import quality
from lowmem.studies.combinations import CombinationsParams, resolve_task, wrn_shape
from lowmem.techniques.step import Techniques
from lowmem.wrn import memory as wrn_memory
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.train import store_run, train

MIB = 2**20
ARMS = {"baseline": Techniques(), "half-bf16": Techniques(precision="half-bf16"),
        "optimi-sgd": Techniques(optimizer="optimi-sgd"),
        "half-bf16+optimi-sgd": Techniques(precision="half-bf16", optimizer="optimi-sgd")}
# (arm, against): what each comparison isolates
PAIRS = {("half-bf16", "baseline"): "the paper's 16-bit weights",
         ("optimi-sgd", "baseline"): "torch-optimi's SGD without Nesterov, fp32",
         ("half-bf16+optimi-sgd", "baseline"): "16-bit weights with Kahan summation, all told",
         ("half-bf16+optimi-sgd", "optimi-sgd"): "Kahan bf16 against the same optimizer in fp32",
         ("half-bf16+optimi-sgd", "half-bf16"): "Kahan bf16 against plain bf16"}


def memory(p: CombinationsParams, tech: Techniques) -> dict[str, Any]:
    """The accounted peak of one full-size step under ``tech``, by category at the peak, in MiB."""
    r = wrn_memory.account(tech, wrn_shape(p), p.seed)
    return {f"{c}_mib": r.at_peak[c] / MIB for c in CATEGORIES} | {"total_mib": r.peak / MIB}


def train_arms(p: CombinationsParams, progress: bool = True) -> dict[str, Any]:
    """Every arm on every seed (through the run store), with its accounted memory."""
    base = BaselineParams(**p.train)
    arms = {}
    for name, tech in ARMS.items():
        print(f"== {name}", flush=True)
        store = [store_run(base, s, tech) for s in p.train_seeds]
        fresh = [r.result() is None for r in store]
        final = [train(base, s, tech, progress=progress)[-1] for s in p.train_seeds]
        arms[name] = {"techniques": {"precision": tech.precision, "optimizer": tech.optimizer},
                      "runs": [{"key": r.key, "seed": s, "trained": t} for r, s, t in zip(store, p.train_seeds, fresh)],
                      "per_seed_acc": [r["test_acc"] for r in final], "step_s": [r["step_s"] for r in final],
                      "memory": memory(p, tech)}
    return {"profile": p.profile, "model": base.model, "data": final[0]["data"], "epochs": base.epochs,
            "batch_size": base.batch_size, "seeds": list(p.train_seeds), "arms": arms}


def table(res: dict[str, Any]) -> pd.DataFrame:
    """Each comparison of ``PAIRS``: the paired accuracy change (points) with its 95% interval, and the accounted
    memory reduction of the arm against the baseline (WRN-28-2 at full size)."""
    arms, base_mib = res["arms"], res["arms"]["baseline"]["memory"]["total_mib"]
    rows = []
    for (arm, against), what in PAIRS.items():
        by_seed = {n: {s: 100 * a for s, a in zip(res["seeds"], arms[n]["per_seed_acc"])} for n in (arm, against)}
        c = quality.paired(quality.seed_pairs(by_seed[arm], by_seed[against]))
        m = arms[arm]["memory"]
        rows.append({"arm": arm, "against": against, "isolates": what, "accuracy_change": c.mean, "low": c.low,
                     "high": c.high, "seeds": c.n, "optimizer_mib": m["optimizer_mib"], "total_mib": m["total_mib"],
                     "reduction": base_mib / m["total_mib"]})
    return pd.DataFrame(rows)


def caption(res: dict[str, Any]) -> str:
    return (f"Profile `{res['profile']}`: {res['model']} on {res['data']}, {res['epochs']} epochs at batch "
            f"{res['batch_size']}, seeds {res['seeds']} (every arm on each; changes paired by seed, Student's t, 95%). "
            f"Memory: WRN-28-2 at batch 128, full size, accounted; reduction against the fp32 baseline.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="the profile's combinations_wrn block is read")
    ap.add_argument("--data-root", default="data/raw", help="image datasets (Fashion-MNIST at the cpu profile)")
    ap.add_argument("--metrics", type=Path, required=True, help="write every arm's per-seed accuracy and memory here")
    ap.add_argument("--table", type=Path, help="also write the paired comparisons as Markdown here")
    args = ap.parse_args(argv)
    try:
        p = resolve_task("wrn", yaml.safe_load(args.params.read_text()))
        p.train["data_root"] = args.data_root
        res = train_arms(p)
    except (ParamError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs.write_json(args.metrics, res)
    if args.table:
        args.table.write_text(caption(res) + "\n\n" + table(res).round(3).to_markdown(index=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
