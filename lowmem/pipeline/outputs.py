"""Writing results so that a failed run never leaves a half-written file: each goes to a temporary name first."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from lowmem import runs


def save_figure(fig: Figure, path: str | Path) -> Path:
    return runs.atomic_write(Path(path), lambda p: fig.savefig(p, dpi=120, bbox_inches="tight", format="png"))


def save_table(df: pd.DataFrame, path: str | Path, caption: str) -> tuple[Path, Path]:
    """Writes ``path`` as CSV and a Markdown twin (``.md``) that starts with ``caption`` (profile, data, method)."""
    path = Path(path)
    csv = runs.atomic_write(path.with_suffix(".csv"), lambda p: df.to_csv(p, index=False))
    # A missing value is blank, not 'nan' (tabulate leaves only None blank).
    shown = df.astype(object).where(df.notna(), None)
    md_text = f"{caption}\n\n{shown.to_markdown(index=False, floatfmt='.4g', missingval='')}\n"
    md = runs.atomic_write(path.with_suffix(".md"), lambda p: Path(p).write_text(md_text))
    return csv, md


def save_tables(tables: dict[str, tuple[pd.DataFrame, str]], folder: str | Path) -> None:
    """Every table of a study's ``tables()`` (file name without suffix -> (table, caption)) under ``folder``."""
    for name, (df, caption) in tables.items():
        save_table(df, Path(folder) / name, caption)


def save_metrics(metrics: dict[str, Any], path: str | Path) -> Path:
    return runs.atomic_write(Path(path), lambda p: Path(p).write_text(json.dumps(metrics, indent=2, sort_keys=False) + "\n"))


# --- publishing a stage's outputs ---------------------------------------------------------------------------------
# A notebook stage writes its figures, tables and metrics into data/staging/<stage>/ and only then, when papermill
# has run every cell, moves them into figures/ and metrics/: a stage that fails part-way leaves the committed
# results as they were (dvc.yaml marks them persist, so DVC does not delete them before the stage runs either).


def reader_copy(executed: Path, dst: Path) -> Path:
    """The executed notebook as a reader opens it (figures/notebooks/): its tables and figures, without the
    stderr streams (progress bars, warnings) and papermill's per-cell timings."""
    nb = json.loads(Path(executed).read_text())
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("papermill", None)
        cell.get("metadata", {}).pop("execution", None)
        if "outputs" in cell:
            cell["outputs"] = [o for o in cell["outputs"] if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
    nb.get("metadata", {}).pop("papermill", None)
    text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    return runs.atomic_write(Path(dst), lambda p: Path(p).write_text(text))


def publish(staging: Path, root: Path, executed: Path | None = None) -> list[Path]:
    """Moves every file of ``staging`` to the same place under ``root``, and the reader's copy of ``executed``
    to ``root/figures/notebooks/``; returns the published paths."""
    staging, root = Path(staging), Path(root)
    done = []
    for f in sorted(p for p in staging.rglob("*") if p.is_file()):
        dst = root / f.relative_to(staging)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(f, dst)
        done.append(dst)
    if executed is not None:
        done.append(reader_copy(executed, root / "figures" / "notebooks" / Path(executed).name))
    return done


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("step", choices=("publish", "clear"))
    ap.add_argument("staging", type=Path, help="the stage's staging folder, e.g. data/staging/memory_profile")
    ap.add_argument("--root", type=Path, default=Path("."))
    ap.add_argument("--notebook", type=Path, help="publish: the executed notebook, copied for readers")


def run(args: argparse.Namespace) -> int:
    import shutil

    if args.step == "clear":  # before the notebook runs: nothing of an earlier failed attempt is published
        shutil.rmtree(args.staging, ignore_errors=True)
        args.staging.mkdir(parents=True)
        return 0
    for path in publish(args.staging, args.root, args.notebook):
        print(f"published {path}")
    return 0
