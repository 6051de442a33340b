"""The headline's WRN configurations measured for real on this CPU: WRN-28-2 at B = 128 (stage memory_profile's
resolved parameters), one real step each, the CPU allocator's peak through the profiler, beside the accountant.

    python -m lowmem.pipeline cpu-check [--params data/params/memory_profile.yaml] [--out metrics/cpu_check.json]
        [--table figures/00_cpu_check] [--comparison CSV]

The accountant counts tensors; a device holds more (an op's scratch, a library's workspace). The GPU check measures
that on a lent GPU; this measures it on the machine that runs the pipeline, so that the headline's reductions have
a measured column with no GPU. The configurations are the baseline and every WRN row of the combination study's
comparison with the paper (``figures/09_paper_comparison.csv``), the rows the headline shows. Each is measured as the
GPU check measures it (``lowmem.studies.gpu_memory.memory_row``, on the CPU): one step at full size, and the
accountant with and without each op's CPU workspace (``lowmem.memory.measure.CPUWorkspace``).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml
from tqdm import tqdm

from lowmem import runs
from lowmem.cpu import cpu_class
from lowmem.memory.measure import CPUWorkspace
from lowmem.studies import gpu_memory
from lowmem.techniques.step import Techniques
from lowmem.wrn import memory as wrn_memory

ROOT = Path(__file__).parents[2]
COMPARISON = ROOT / "figures/09_paper_comparison.csv"  # stage combinations' comparison: the headline's rows
SWEEP = ROOT / "data/combinations/wrn_sweep.csv"  # each grid configuration's levers
COLUMNS = {"configuration": "configuration", "measured_mib": "measured (MiB)", "accounted_mib": "accounted (MiB)",
           "gap_pct": "gap (%)", "accounted_with_workspace_mib": "accounted + op workspace (MiB)",
           "gap_with_workspace_pct": "gap with workspace (%)", "measured_reduction": "measured reduction",
           "accounted_reduction": "accounted reduction", "seconds": "seconds"}


def configurations(check: gpu_memory.Check, comparison: Path = COMPARISON, sweep: Path = SWEEP) -> list[tuple[str, Techniques]]:
    """(name, techniques): the baseline, then each WRN configuration of the comparison once, in its order; a
    ValueError names a configuration the sweep does not hold."""
    grid = {r["name"]: json.loads(r["config"]) for r in csv.DictReader(sweep.open())}
    # A row without a reduction names no configuration ("none trained within ..."): nothing to measure.
    rows = [r["our_config"] for r in csv.DictReader(comparison.open()) if r["task"] == "wrn" and r.get("our_reduction", "?")]
    missing = sorted({n for n in rows if n not in grid})
    if missing:
        raise ValueError(f"{comparison.name} names {missing}, which {sweep.name} does not hold: rerun stage "
                         "combinations first (dvc repro combinations)")
    names = list(dict.fromkeys(rows))
    return [("baseline", Techniques()), *((n, gpu_memory._named(check, grid[n])) for n in names)]


def measure(check: gpu_memory.Check, configs: list[tuple[str, Techniques]]) -> list[dict[str, Any]]:
    """One row per configuration (``gpu_memory.memory_row``), with its reduction from the baseline's peak, measured
    and accounted."""
    workspace = gpu_memory._Real(CPUWorkspace())
    rows = [gpu_memory.memory_row(check, name, "baseline" if name == "baseline" else "headline", tech, workspace)
            for name, tech in tqdm(configs, desc="cpu check", unit="configuration")]
    base = rows[0]
    for r in rows:
        r["measured_reduction"] = base["measured_mib"] / r["measured_mib"]
        r["accounted_reduction"] = base["accounted_mib"] / r["accounted_mib"]
    return rows


def caption(res: dict[str, Any]) -> str:
    return (f"The headline's WRN configurations measured on this CPU ({res['cpu']}, torch {res['torch']}): "
            f"{res['model']} at batch {res['batch_size']} (full size, random inputs), one real training step each; "
            "measured: the CPU allocator's peak through torch.profiler; accounted: lowmem's accountant (tensors); + op "
            "workspace: each op's scratch measured once per call signature (lowmem.memory.measure.CPUWorkspace). "
            "Reductions: the baseline's peak over the configuration's. Not a profile's result: no quality is measured "
            "here, and the sizes are the paper's in every profile.")


def table(res: dict[str, Any]) -> pd.DataFrame:
    return pd.DataFrame(res["rows"])[list(COLUMNS)].rename(columns=COLUMNS).round(3)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--params", type=Path, default=Path("data/params/memory_profile.yaml"),
                    help="stage memory_profile's resolved parameters (model, reference_batch_size, the input's shape)")
    ap.add_argument("--out", type=Path, default=Path("metrics/cpu_check.json"))
    ap.add_argument("--table", type=Path, default=Path("figures/00_cpu_check"), help="CSV and Markdown, without suffix")
    ap.add_argument("--raw", type=Path, help="also write the result here (stage cpu_check: DVC's cached copy, which a "
                    "fresh clone lacks, so that `make repro` measures this machine again)")
    ap.add_argument("--comparison", type=Path, default=COMPARISON, help="the rows to measure (task, our_config)")


def run(args: argparse.Namespace) -> int:
    mp = yaml.safe_load(args.params.read_text())
    check = gpu_memory.Check(torch.device("cpu"), wrn_memory.Shape(mp["model"], mp["reference_batch_size"], mp["num_classes"],
                                                                    mp["in_channels"], mp["image_size"]), [], False)
    try:
        configs = configurations(check, args.comparison)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = {"cpu": cpu_class(), "torch": torch.__version__, "when": time.strftime("%Y-%m-%d"), "model": mp["model"],
           "batch_size": mp["reference_batch_size"], "rows": measure(check, configs)}
    for path in (args.out, args.raw) if args.raw else (args.out,):
        runs.write_json(path, res)
    t = table(res)
    t.to_csv(args.table.with_suffix(".csv"), index=False)
    args.table.with_suffix(".md").write_text(caption(res) + "\n\n" + t.to_markdown(index=False) + "\n")
    return 0
