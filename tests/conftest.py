"""Shared fixtures. `cluster`: one local Ray instance with two CPU devices for the whole test run."""

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def pytest_sessionstart(session):
    """The machine the suite runs on, first in its output (with -q too): a suite slowed by something else running
    beside it (on 2 cores another suite makes every test about 4x slower) says so at the top."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = _machine_line()
    if reporter is not None and line:
        reporter.write_line(line)


def _machine_line() -> str | None:
    import subprocess

    try:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   "?")
        ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, timeout=5).stdout.splitlines()
        mine = {str(os.getpid()), str(os.getppid())}  # this session and the shell (make's) that started it
        others = [line for line in ps[1:] if ("pytest" in line or "raylet" in line) and line.split()[0] not in mine]
        load = os.getloadavg()
    except (OSError, subprocess.SubprocessError, StopIteration):
        return None
    return (f"m2flow: {cpu}, {len(os.sched_getaffinity(0))} cores, load average {load[0]:.2f} {load[1]:.2f} "
            f"{load[2]:.2f}; other pytest or Ray processes running: {len(others)}")


# pytest-timeout fails a test past its limit from a SIGALRM handler, but an exception raised by a signal handler cannot
# leave a `ray.get` that waits for ever: Ray keeps it until the call returns. So a hung test would run into CI's
# 90-minute cut with nothing to show. BACKSTOP_S after its limit, every thread's stack goes to stderr and the run exits.
BACKSTOP_S = 120
_STDERR_FD: list[int] = []


def pytest_configure(config):
    _STDERR_FD.append(os.dup(sys.stderr.fileno()))  # the terminal's stderr (tests' own output is captured)
    _runs_draw_no_plots_unless_asked()


def _runs_draw_no_plots_unless_asked() -> None:
    """The suite's ~190 runs in this process draw their PNGs (about a second each) only where a test asks: a config
    loaded with `config.load` that does not set `run.plots` (in its file, mapping or overrides) gets
    `run.plots=false`. The tests that look at plots/ pass `run.plots=true`; runs started as CLI subprocesses draw as
    a user's do; test_run_plots_false_draws_no_png_and_keeps_the_rest checks what the setting leaves out."""
    from m2flow import config as C

    load = C.load

    def load_without_plots(cls, config=None, overrides=None):
        data = {} if config is None else config if isinstance(config, dict) else C.read_yaml(C.resolve_path(config))
        cfg = load(cls, data, overrides)  # the file read once, here
        asked = "plots" in (data.get("run") or {}) or any(o.startswith("run.plots=") for o in overrides or [])
        if hasattr(getattr(cfg, "run", None), "plots") and not asked:
            cfg.run.plots = False
        return cfg

    C.load = load_without_plots


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_protocol(item, nextitem):
    import faulthandler

    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0] if marker and marker.args else item.config.getini("timeout") or 0)
    if limit <= 0:
        return (yield)
    faulthandler.dump_traceback_later(limit + BACKSTOP_S, file=_STDERR_FD[0], exit=True)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a CUDA GPU: skipped where torch sees none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


def _worker_pythonpath() -> None:
    """Worker processes import the Worker classes that tests define by module name (`test_group`, ...): give them
    the test directories that pytest put on the driver's sys.path."""
    test_dirs = [p for p in sys.path if p and Path(p).resolve().is_relative_to(TESTS)]
    test_dirs.append(str(TESTS.parent / "examples"))  # the example flows (tests/e2e/test_custom_flow.py)
    parts = [*test_dirs, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in parts if p))


@pytest.fixture(scope="session")
def cluster():
    """A `Cluster(cpu_devices=2)` shared by every test that needs Ray; shut down at the end of the session. Its
    devices are CPU slots also on a machine with GPUs (the tests marked `cuda` use `gpu_cluster`)."""
    from m2flow.runtime import Cluster

    _worker_pythonpath()
    c = Cluster(cpu_devices=2, use_gpus=False)
    yield c
    c.shutdown()


@pytest.fixture(scope="session")
def demo_warm_start(tmp_path_factory):
    """The main job's warm start stopped at 40% of its held-back problems (the demo preset, seed 0), built once for
    the learning tests that start GRPO from it (test_demo, test_off_policy) with the flow's own `prepare_model`:
    their overrides `model.path=...` and `sft.steps=0` (the RL data does not depend on the warm start's settings)."""
    from m2flow import config as C
    from m2flow.reasoning.config import ReasoningConfig
    from m2flow.reasoning.warm_start import prepare_model

    where = tmp_path_factory.mktemp("demo_warm_start")
    cfg = C.load(ReasoningConfig, "demo", [f"run.dir={where}", "run.progress=false", "sft.target_accuracy=0.4"])
    return [f"model.path={prepare_model(cfg, where)}", "sft.steps=0"]


@pytest.fixture(scope="session")
def gpu_cluster():
    """A Cluster whose devices are this machine's GPUs (for the tests marked `cuda`)."""
    import torch

    from m2flow.runtime import Cluster

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _worker_pythonpath()
    c = Cluster()
    if c.devices[0].kind != "gpu":
        pytest.skip(f"Ray sees no GPU on this node (devices: {c.devices})")
    yield c
    c.shutdown()
