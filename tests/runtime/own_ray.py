"""Run a test script in its own Python process (and so its own Ray instance, apart from the session `cluster`)."""

import os
import signal
import subprocess
import sys


def run_script(text: str, tmp_path, *args: str, timeout: float) -> tuple[int, str]:
    """Write `text` to a file under `tmp_path`, run it with `args`; (exit code, stdout+stderr). The whole process
    group is killed at `timeout`, and the test fails with the output's tail."""
    script = tmp_path / "script.py"
    script.write_text(text)
    proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, cwd=str(tmp_path))
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{script} timed out after {timeout} s:\n{out[-4000:]}") from None
    return proc.returncode, out
