"""The suite's own harness (tests/conftest.py): a test that outlives its timeout and swallows pytest-timeout's
exception (as a `ray.get` waiting for ever does) ends the run with every thread's stack, instead of hanging it."""

import subprocess
import sys
from pathlib import Path

import pytest

HUNG = '''
import time, pytest

@pytest.mark.timeout(1)
def test_swallows_its_timeout():
    while True:
        try:
            time.sleep(0.5)
        except BaseException:  # pytest-timeout's Failed, kept from the test as Ray keeps it from ray.get
            pass

def test_never_reached():
    pass
'''


@pytest.mark.slow
def test_a_test_that_swallows_its_timeout_ends_the_run_with_the_stacks(tmp_path):
    conftest = (Path(__file__).resolve().parents[1] / "conftest.py").read_text()
    assert "\nBACKSTOP_S = 120\n" in conftest
    (tmp_path / "conftest.py").write_text(conftest.replace("\nBACKSTOP_S = 120\n", "\nBACKSTOP_S = 2\n"))
    (tmp_path / "test_hung.py").write_text(HUNG)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_hung.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "Timeout (0:00:03)!" in out.stderr and "in test_swallows_its_timeout" in out.stderr
    assert "passed" not in out.stdout  # the run ended there: the next test never ran
