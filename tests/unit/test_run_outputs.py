"""A run's metric outputs: every finite scalar of a step reaches metrics.jsonl and TensorBoard (written as one event
per step), and TensorBoard reads back the same values at the same steps; a Ctrl-C that a wait lost is raised again
at the next step."""

import json
import math
import os
import signal
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from m2flow import config as C
from m2flow.flows.outputs import RunDir
from m2flow.runtime import interrupts


def test_each_step_reaches_metrics_jsonl_and_tensorboard_with_the_same_values(tmp_path):
    run = RunDir(tmp_path / "r", C.load(C.EmbodiedConfig, "ppo_cartpole"))
    logged = {s: {"reward/mean": 0.25 * s, "time/iteration": 1.0 / s, "actor/updates": 20 + s,
                  "eval/return": float("nan"), "note": "text"} for s in (1, 2, 3)}
    for step, metrics in logged.items():
        run.log(step, metrics)
    run.close()
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["actor/updates"] == 22 and rows[0]["note"] == "text"
    assert math.isnan(rows[2]["eval/return"])

    events = EventAccumulator(str(tmp_path / "r" / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["actor/updates", "reward/mean", "time/iteration"]  # finite numbers
    for tag in ("reward/mean", "time/iteration", "actor/updates"):
        read = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in read] == [1, 2, 3], (tag, read)
        for (step, value), row in zip(read, rows):
            assert math.isclose(value, row[tag], rel_tol=1e-6), (tag, step, value, row[tag])


def test_a_ctrl_c_lost_inside_a_wait_is_raised_again_at_the_next_logged_step(tmp_path):
    """runtime.interrupts: Ray's waits can turn a KeyboardInterrupt into a status and drop it. With the CLI's handler
    installed, the interrupt is remembered and RunDir.log raises it at the flow's next step, once; without it (or
    after uninstall) nothing is remembered, and a handler someone else set is left alone."""
    run = RunDir(tmp_path / "r", C.load(C.EmbodiedConfig, "ppo_cartpole"))
    assert interrupts.install()
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here and raises
        except KeyboardInterrupt:
            pass  # what a wait that drops it does
        with pytest.raises(KeyboardInterrupt):
            run.log(1, {"x": 1.0})
        run.log(1, {"x": 1.0})  # taken once
    finally:
        interrupts.uninstall()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    run.log(2, {"x": 2.0})
    assert [r["step"] for r in run.metrics()] == [1, 2]

    def mine(signum, frame):
        pass
    previous = signal.signal(signal.SIGINT, mine)
    try:
        assert not interrupts.install() and signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)
    run.close()
