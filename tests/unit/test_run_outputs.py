"""A run's metric outputs: every finite scalar of a step reaches metrics.jsonl and TensorBoard (written as one event
per step), and TensorBoard reads back the same values at the same steps."""

import json
import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from m2flow import config as C
from m2flow.embodied.config import EmbodiedConfig
from m2flow.run_dir import RunDir


def test_each_step_reaches_metrics_jsonl_and_tensorboard_with_the_same_values(tmp_path):
    run = RunDir(tmp_path / "r", C.load(EmbodiedConfig, "ppo_cartpole"))
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


def test_progress_prints_a_line_a_tenth_where_stderr_is_no_terminal(capsys):
    """In a log (stderr not a terminal) rich draws nothing until the end: a plain line at each tenth instead."""
    from m2flow.run_dir import progress

    with progress() as bar:
        task = bar.add_task("behaviour cloning", total=25, info="")
        for i in range(1, 26):
            bar.update(task, completed=i, info=f"nll {i:.3f}")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("behaviour cloning: 1/25 (") and lines[0].endswith("nll 1.000")
    assert len(lines) == 11 and lines[-1].startswith("behaviour cloning: 25/25") and lines[-1].endswith("nll 25.000")
    with progress(False) as bar:  # disabled: nothing at all
        bar.update(bar.add_task("quiet", total=4, info=""), completed=4)
    assert capsys.readouterr().err == ""
