import logging

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_configure(config: pytest.Config) -> None:
    # The CPU profiler logs its start/stop at INFO through glog; keep the test output readable.
    logging.getLogger("torch").setLevel(logging.WARNING)
