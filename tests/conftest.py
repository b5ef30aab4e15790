"""Shared fixtures. `cluster`: one local Ray instance with two CPU devices for the whole test run."""

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a CUDA GPU: skipped where torch sees none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cluster():
    """A `Cluster(cpu_devices=2)` shared by every test that needs Ray; shut down at the end of the session."""
    from m2flow.runtime import Cluster

    # Worker processes import the Worker classes that tests define by module name (`test_group`, ...):
    # give them the test directories that pytest put on the driver's sys.path.
    test_dirs = [p for p in sys.path if p and Path(p).resolve().is_relative_to(TESTS)]
    test_dirs.append(str(TESTS.parent / "examples"))  # the example flows (tests/e2e/test_custom_flow.py)
    os.environ["PYTHONPATH"] = os.pathsep.join([*test_dirs, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    c = Cluster(cpu_devices=2)
    yield c
    c.shutdown()
