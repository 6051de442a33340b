"""Deliberate changes to the training code (the subpackages, the merged WRN model builder, the sparse-method, norm
and checkpoint registries, the shared sparse-weight storage) retrain the runs they touch, and those runs give the
metrics the code before them gave, bit for bit: tests/data/refactor_reference.json was written by
tests/make_refactor_reference.py in a checkout of the commit before the refactoring (574a700)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from make_refactor_reference import histories  # noqa: E402

REFERENCE = json.loads((Path(__file__).parent / "data" / "refactor_reference.json").read_text())


@pytest.mark.slow
def test_every_touched_lever_trains_to_the_metrics_of_the_code_before(tmp_path: Path) -> None:
    now = histories(tmp_path)
    assert list(now) == list(REFERENCE)
    for name in REFERENCE:
        assert now[name] == REFERENCE[name], name
