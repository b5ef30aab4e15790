"""Faults around the run directory (issue 20): a directory that holds a run is never reused silently, two runs never
write one directory at once, and the refusals come before anything starts (no Ray, no warm start)."""

import subprocess
import sys
import time

import pytest

from m2flow import config as C
from m2flow.cli import main
from m2flow.reasoning.config import ReasoningConfig
from m2flow.run_dir import claim_run_dir, holds_run, release_run_dir, run_dir_claimed


def old_run(path):
    """A directory holding a finished run: metrics, a checkpoint, a warm-start model."""
    (path / "checkpoints" / "step_2").mkdir(parents=True)
    (path / "checkpoints" / "step_2" / "COMPLETE").write_text("2")
    (path / "sft_model").mkdir()
    (path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    return path


def test_a_directory_holding_a_run_is_refused_naming_both_ways_on(tmp_path):
    run = old_run(tmp_path / "r")
    with pytest.raises(C.UserError) as err:
        claim_run_dir(run)
    text = str(err.value)
    assert str(run) in text and "metrics.jsonl, 1 checkpoint" in text
    assert "run.resume=true" in text and "run.name" in text and "run.overwrite=true" in text
    assert (run / "metrics.jsonl").read_text().count("step") == 2  # nothing touched
    with run_dir_claimed(run, resume=True):  # resume keeps the run
        assert holds_run(run) == "metrics.jsonl, 1 checkpoint"


def test_overwrite_removes_the_old_run_whole(tmp_path):
    run = old_run(tmp_path / "r")
    with run_dir_claimed(run, overwrite=True):
        assert sorted(p.name for p in run.iterdir()) == [".lock"]
        assert not claim_run_dir(run, overwrite=True)  # the same process again (API, then flow): nothing removed
    assert holds_run(run) == ""


def test_an_empty_or_cache_only_directory_is_not_a_run(tmp_path):
    run = tmp_path / "r"
    (run / "sft_model").mkdir(parents=True)  # a warm start that never got to train
    (run / "metrics.jsonl").write_text("")
    assert holds_run(run) == ""
    assert claim_run_dir(run)
    release_run_dir(run)


HOLDER = """
import sys, time
from m2flow.run_dir import claim_run_dir
claim_run_dir(sys.argv[1])
print("HELD", flush=True)
time.sleep(60)
"""


def test_a_second_run_in_the_same_directory_at_once_is_refused(tmp_path):
    run = tmp_path / "r"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        with pytest.raises(C.UserError, match=rf"run directory {run} is in use by another run \(pid {holder.pid}\)"):
            claim_run_dir(run, overwrite=True)
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 10  # the lock goes with the process: nothing to clean after a crash
    while True:
        try:
            assert claim_run_dir(run)
            break
        except C.UserError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    release_run_dir(run)


def test_the_cli_refuses_in_one_line_with_exit_code_2_before_ray_starts(tmp_path, capsys):
    import ray
    import torch

    run = old_run(tmp_path / "again")
    started, threads = ray.is_initialized(), torch.get_num_threads()
    try:
        code = main(["train", "grpo_arithmetic", f"run.dir={tmp_path}", "run.name=again", "run.progress=false"])
    finally:
        torch.set_num_threads(threads)  # main() sets the driver's to 1
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"m2flow: error: run directory {run} already holds a run (metrics.jsonl, 1 checkpoint)")
    assert ray.is_initialized() == started  # refused before the cluster
    assert not (run / "init_model").exists()  # and before the warm start


def test_resume_and_overwrite_together_is_a_config_error():
    with pytest.raises(C.ConfigError, match="run.resume and run.overwrite are both true"):
        C.load(ReasoningConfig, None, ["run.resume=true", "run.overwrite=true"])


def test_a_checkpoint_cut_off_mid_write_is_never_picked(tmp_path):
    """A write that fails removes its partial step_N.tmp (a full disk says so, naming the checkpoint kept; another
    error goes up as it is); a driver killed mid-write leaves one, and a folder without COMPLETE may be left by hand
    or by an older version: resume picks step 2, the last complete one."""
    from m2flow.run_dir import RunDir, latest_checkpoint

    run = RunDir(tmp_path / "r", C.load(ReasoningConfig))
    run.save_checkpoint(2, lambda d: (d / "weights").write_text("two"))
    ckpts = tmp_path / "r" / "checkpoints"

    def crash(error):
        def write(d):
            (d / "weights").write_text("four, half")
            raise error
        return write

    with pytest.raises(C.UserError, match=r"checkpoint step_4: no space left on the disk holding .* the newest "
                                          r"complete checkpoint, step_2, is kept"):
        run.save_checkpoint(4, crash(OSError(28, "No space left on device")))
    assert not (ckpts / "step_4.tmp").exists()
    with pytest.raises(RuntimeError, match="a worker failed"):
        run.save_checkpoint(4, crash(RuntimeError("a worker failed")))
    assert not (ckpts / "step_4.tmp").exists()
    (ckpts / "step_4.tmp").mkdir()  # what a driver killed in the middle of the write leaves
    (ckpts / "step_4.tmp" / "weights").write_text("four, half")
    (ckpts / "step_6").mkdir()  # no COMPLETE marker
    step, path = latest_checkpoint(tmp_path / "r")
    assert step == 2 and (path / "weights").read_text() == "two"
    assert not (tmp_path / "r" / "checkpoints" / "step_4").exists()
    run.close()
