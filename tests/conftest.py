import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import papermill
import pytest
import torch
from _pytest.nodeid import NodeId

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"
RUNS = pytest.StashKey[str]()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_configure(config: pytest.Config) -> None:
    # The CPU profiler logs its start/stop at INFO through glog; keep the test output readable.
    logging.getLogger("torch").setLevel(logging.WARNING)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # `make test` runs two pytest-xdist workers on 2 cores: one torch thread each (and in the processes they
        # start), so that the workers do not take turns on each other's cores.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    # One run store for the whole test session (one per xdist worker; nbval's kernels inherit it), never the
    # checkout's data/runs: a test
    # must train what it asserts on, and must not fill the store a reader's pipeline uses.
    os.environ["LOWMEM_RUNS"] = tempfile.mkdtemp(prefix="lowmem-test-runs-")
    config.stash[RUNS] = os.environ["LOWMEM_RUNS"]
    # lowmem profile's cache of measured op workspace (lowmem.cli.device_bytes): not the user's ~/.cache.
    os.environ["LOWMEM_CACHE"] = os.path.join(os.environ["LOWMEM_RUNS"], "cache")


def pytest_unconfigure(config: pytest.Config) -> None:
    if RUNS in config.stash:  # each process's own store, not left in /tmp after the session
        shutil.rmtree(config.stash[RUNS], ignore_errors=True)


# The test tiers (README, "Tests"): unit tests; `slow` ones that run a pipeline or many training steps; and the
# notebooks' tier, nbval's run of every notebook and the assertions on the metrics they wrote
# (tests/test_notebook_metrics.py). `make test` runs them in one session, in that order: the notebooks take the runs
# the pipeline test trained from the session's run store, and the assertions read what nbval's run wrote.
METRICS_TESTS = "test_notebook_metrics.py"
# Under pytest-xdist (`make test`: -n 2 --dist loadgroup) these share one worker, in collection order, since they share
# its run store and the notebooks' output folder: the pipeline copy, the notebooks, then the assertions on what they
# wrote (but for OWN_GROUPS, below). The other tests spread over both workers.
IN_ORDER = ("test_pipeline.py", METRICS_TESTS)
GROUP = "pipeline-and-notebooks"
# Notebooks that need no run the pipeline copy trained, with the assertions on their metrics, are groups of their own,
# in the same order: xdist runs each beside the pipeline's group, on either worker, not after it. 12 and 13 only
# account; 07 and 08 train their fairseq runs (translation_train's smoke run again, a few seconds) and share the smoke
# corpus they prepare in data/smoke/translation.
OWN_GROUPS = {"12": "accounting-notebooks", "13": "accounting-notebooks", "07": "translation-notebooks",
              "08": "translation-notebooks"}
# Modules whose expensive module-scoped fixtures (a trained fairseq model, a binarized corpus, the GPU check's dry run,
# a planned table, JupyterLab's server) would otherwise be built once on each worker: each module's tests share one
# worker, as a group of its own. (The browser test runs notebook 09, which reads committed results only; its files
# in data/smoke are nbval's run's, byte for byte, and both write them by rename.)
ONE_WORKER_MODULES = ("test_translation.py", "test_translation_techniques.py", "test_translation_microbatch.py",
                      "test_gpu_check.py", "test_plan_output.py", "test_lab.py")
SESSION_START = time.time()


@pytest.hookimpl(tryfirst=True)  # before pytest's -m selection sees the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.suffix == ".ipynb" or item.path.name == METRICS_TESTS:
            item.add_marker(pytest.mark.notebook)
        if (item.path.suffix == ".ipynb" or item.path.name in IN_ORDER) and getattr(config.option, "loadgroup", False):
            # xdist 3.8.0 groups by the "@group" suffix of a nodeid, which it writes to item._nodeid; pytest 9.2 reads
            # the nodeid from item._id, so the suffix is set there (xdist's own rewrite then has no effect).
            item._id = NodeId.parse(f"{item.nodeid}@{OWN_GROUPS.get(_notebook_number(item), GROUP)}")
        elif item.path.name in ONE_WORKER_MODULES and getattr(config.option, "loadgroup", False):
            item._id = NodeId.parse(f"{item.nodeid}@{item.path.stem}")
    items.sort(key=lambda item: item.path.name == METRICS_TESTS)  # stable: everything else keeps its order


def _notebook_number(item: pytest.Item) -> str:
    """The two digits a notebook's name, or an assertion on its metrics (test_NN_...), starts with; else ''."""
    name = item.path.stem if item.path.suffix == ".ipynb" else item.name.removeprefix("test_")
    return name[:2] if name[:2].isdigit() else ""


@pytest.fixture
def notebook_metrics(tmp_path: Path) -> Callable[[str, str], dict]:
    """``metrics(notebook, name)``: the metrics JSON ``name`` that notebook wrote at its smoke parameters, from nbval's
    run in this session where there was one, else from running the notebook here through papermill."""

    def metrics(notebook: str, name: str) -> dict:
        written = NOTEBOOKS.parent / "data" / "smoke" / "metrics" / f"{name}.json"
        if not (written.exists() and written.stat().st_mtime >= SESSION_START):
            papermill.execute_notebook(NOTEBOOKS / f"{notebook}.ipynb", tmp_path / f"{notebook}.ipynb", cwd=NOTEBOOKS,
                                       kernel_name="lowmem", progress_bar=False)
        return json.loads(written.read_text())

    return metrics
