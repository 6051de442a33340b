import logging
import os
import tempfile

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_configure(config: pytest.Config) -> None:
    # The CPU profiler logs its start/stop at INFO through glog; keep the test output readable.
    logging.getLogger("torch").setLevel(logging.WARNING)
    # One run store for the whole test session (nbval's kernels inherit it), never the checkout's data/runs: a test
    # must train what it asserts on, and must not fill the store a reader's pipeline uses.
    os.environ["LOWMEM_RUNS"] = tempfile.mkdtemp(prefix="lowmem-test-runs-")
