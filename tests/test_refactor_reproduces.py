"""Deliberate changes to the training code (the subpackages, the merged WRN model builder, the sparse-method, norm
and checkpoint registries, the shared sparse-weight storage) retrain the runs they touch, and those runs give the
metrics the code before them gave, bit for bit.

The code before is commit 574a700's ``lowmem/``, taken from this clone's git history; both sides train here, in
fresh interpreters, by tests/make_refactor_reference.py, since floating-point results differ between CPUs (a
reference file written on another machine failed on this one by the last bits of a loss)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
BEFORE = "574a700"  # the last commit with the flat lowmem/ and the step builders, sparse storage and norms unmerged
BEFORE_REGISTRY = "c4c749a"  # the last commit before the lever registry
SCRIPT = Path(__file__).parent / "make_refactor_reference.py"


def _histories(code: Path, out: Path, *options: str) -> str:
    subprocess.run([sys.executable, str(SCRIPT), str(out), *options], cwd=code, env={**os.environ, "PYTHONPATH": str(code)},
                   check=True, capture_output=True, text=True, timeout=600)
    return out.read_text()


def _checkout(commit: str, tmp_path: Path) -> Path:
    has = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
    if has.returncode != 0:
        pytest.fail(f"commit {commit} is not in this clone's history; fetch it (git fetch --unshallow) to run this test")
    before = tmp_path / "before"
    before.mkdir()
    archive = subprocess.run(["git", "archive", commit, "lowmem"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
    return before


@pytest.mark.slow
def test_the_optimizer_levers_through_the_registry_train_to_the_metrics_of_the_code_before(tmp_path: Path) -> None:
    """The lever registry changed the training path (the trainer's optimizer comes from the lever that declares it),
    so every WRN run key moved once; the runs give what they gave before it, bit for bit."""
    old = _histories(_checkout(BEFORE_REGISTRY, tmp_path), tmp_path / "before.json", "--registry")
    now = _histories(ROOT, tmp_path / "now.json", "--registry")
    assert '"half-bf16+optimi-sgd"' in old and '"bnb-sgd8bit"' in old
    assert now == old


@pytest.mark.slow
def test_every_touched_lever_trains_to_the_metrics_of_the_code_before(tmp_path: Path) -> None:
    old = _histories(_checkout(BEFORE, tmp_path), tmp_path / "before.json")
    now = _histories(ROOT, tmp_path / "now.json")
    assert '"baseline"' in old and '"mb8-renorm"' in old  # every lever ran on the old code
    assert now == old
