"""Writing results so that a failed run never leaves a half-written file: each goes to a temporary name first."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure


def _atomic(path: Path, write: Any, suffix: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=suffix)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def save_figure(fig: Figure, path: str | Path) -> Path:
    return _atomic(Path(path), lambda p: fig.savefig(p, dpi=120, bbox_inches="tight", format="png"), ".png")


def save_table(df: pd.DataFrame, path: str | Path, caption: str) -> tuple[Path, Path]:
    """Writes ``path`` as CSV and a Markdown twin (``.md``) that starts with ``caption`` (profile, data, method)."""
    path = Path(path)
    csv = _atomic(path.with_suffix(".csv"), lambda p: df.to_csv(p, index=False), ".csv")
    md_text = f"{caption}\n\n{df.to_markdown(index=False, floatfmt='.4g')}\n"
    md = _atomic(path.with_suffix(".md"), lambda p: Path(p).write_text(md_text), ".md")
    return csv, md


def save_metrics(metrics: dict[str, Any], path: str | Path) -> Path:
    return _atomic(Path(path), lambda p: Path(p).write_text(json.dumps(metrics, indent=2, sort_keys=False) + "\n"), ".json")
