"""Run a test script in its own Python process (and so its own Ray instance, apart from the session `cluster`)."""

import os
import signal
import subprocess
import sys

# Source for scripts that simulate several nodes (pasted in, since a script runs with its own sys.path).
START_NODES = '''
def start_nodes(head, *others):
    """A simulated multi-node Ray cluster (ray.cluster_utils) with the head's and each other node's add_node args.
    Ray waits a hard-coded 30 s for a node to register with its GCS, and says an overloaded machine can miss that
    ("timed out during startup"); m2flow's Cluster starts over once then, and so does this."""
    import ray
    from ray.cluster_utils import Cluster as RayCluster

    for attempt in (1, 2):
        nodes = None
        try:
            nodes = RayCluster(initialize_head=True, head_node_args=head)
            for args in others:
                nodes.add_node(**args)
            nodes.wait_for_nodes()
            return nodes
        except Exception as e:
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            print(f"simulated cluster did not start ({e}); starting over", flush=True)
            if nodes is not None:
                nodes.shutdown()
            ray.shutdown()
'''


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
