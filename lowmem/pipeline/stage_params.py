"""Every stage's parameters resolved and checked at once, before any stage runs.

    python -m lowmem.pipeline params [--params params.yaml] [--out data/params]

This is the pipeline's first stage and every other stage depends on its output, so a bad value anywhere in
``params.yaml`` (under ``dvc repro`` or ``dvc exp run -S``) stops the pipeline here, before DVC has removed any
stage's outputs. The files are written only when every block has passed, each one atomically, and a file whose
content is unchanged is left alone, so a change to one block reruns only the stages that read it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from lowmem import config, runs
from lowmem.config import ParamError

# Imported for their @stage registrations: every stage's dataclass.
from lowmem.studies import planner_params as _planner_params  # noqa: F401
from lowmem.dynamicconv import params as _dynamicconv_params  # noqa: F401
from lowmem.studies import combination_grid as _combination_grid  # noqa: F401
from lowmem.studies import params as _study_params  # noqa: F401


def resolve_all(params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each stage's resolved parameters, by file stem; the first bad value raises ``ParamError``."""
    return {name: config.resolve(name, params) for name in sorted(config.STAGES)}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--params", default="params.yaml", type=Path)
    ap.add_argument("--out", default=Path("data/params"), type=Path)


def run(args: argparse.Namespace) -> int:
    try:
        resolved = resolve_all(yaml.safe_load(args.params.read_text()))
    except ParamError as e:
        print(f"error: {e}\nNothing was run and no result was touched; fix params.yaml and run again.", file=sys.stderr)
        return 2
    for name, values in resolved.items():
        path, text = args.out / f"{name}.yaml", yaml.safe_dump(values, sort_keys=False)
        if not path.exists() or path.read_text() != text:
            runs.atomic_write(path, lambda p, t=text: Path(p).write_text(t))
    return 0
