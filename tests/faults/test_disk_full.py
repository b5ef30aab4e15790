"""Fault campaign, the run's disk (issue 20): it fills up in the middle of a run. The run stops with one error
naming the disk, the bytes left and the newest complete checkpoint, which stays valid; no partial checkpoint is left
behind; once space is freed, `run.resume=true` continues. A read-only run directory is refused before anything
starts. Needs a small tmpfs (root with CAP_SYS_ADMIN, as on the development and CI machines); skipped where it
cannot be mounted."""

import json
import subprocess
import threading
import time

import pytest
from safetensors.torch import load_file

from m2flow import config as C
from m2flow.embodied import flow as embodied
from m2flow.embodied.config import EmbodiedConfig
from m2flow.reasoning import flow as reasoning
from m2flow.reasoning.config import ReasoningConfig

STEPS = 40


def mount_tmpfs(path, options: str):
    """Mount a tmpfs with `options` on the new folder `path`; skip the test where that is not allowed."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {done.stderr.strip()}")
    return path


@pytest.fixture
def small_disk(tmp_path):
    disk = mount_tmpfs(tmp_path / "disk", "size=64m")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def fill_after_checkpoint(run_dir, disk, step: int = 2, timeout: float = 180.0) -> dict:
    """A thread that fills `disk` to the last byte once the run's checkpoint of `step` is complete."""
    done: dict = {}

    def fill():
        deadline = time.monotonic() + timeout
        while not (run_dir / "checkpoints" / f"step_{step}" / "COMPLETE").exists():
            if time.monotonic() > deadline:
                done["error"] = f"no checkpoint of step {step} within {timeout:.0f} s"
                return
            time.sleep(0.01)
        with open(disk / "filler", "wb", buffering=0) as f:  # unbuffered: nothing left over to fail at close
            for size in (1 << 20, 4096, 1):  # big writes, then what is left of the last pages
                try:
                    while True:
                        f.write(b"\0" * size)
                except OSError:
                    pass
        done["filled"] = True

    done["thread"] = threading.Thread(target=fill, daemon=True)
    done["thread"].start()
    return done


def stopped_by_a_full_disk(train, cfg, cluster, disk) -> int:
    """Run `cfg` in `disk` while it fills up after the checkpoint of step 2; the run stops with the error a person
    can act on. Returns the newest complete checkpoint, which is whole."""
    run = disk / cfg.run.name
    filler = fill_after_checkpoint(run, disk)
    with pytest.raises(C.UserError) as err:
        train(cfg, cluster)
    filler["thread"].join(timeout=30)
    assert filler.get("filled"), filler.get("error")
    text = str(err.value)
    assert f"no space left on the disk holding {run}" in text, text
    newest = max(int(p.parent.name.removeprefix("step_")) for p in run.glob("checkpoints/step_*/COMPLETE"))
    assert f"the newest complete checkpoint, step_{newest}, is kept: free some space, then run the same command " \
           "with run.resume=true" in text, text
    assert not list(run.glob("checkpoints/*.tmp")), "a partial checkpoint was left behind"
    return newest


@pytest.mark.timeout(300)
def test_a_full_disk_stops_an_embodied_run_keeping_its_checkpoint_and_resume_continues(cluster, small_disk):
    common = [f"run.dir={small_disk}", "run.name=r", "run.progress=false", "run.trace=false", "run.save_every=2",
              "run.stop_return=null", "eval.episodes=0", "env.num_envs=4", "rollout.steps=32",
              "cluster.placement=env,rollout,actor: 0"]
    cfg = C.load(EmbodiedConfig, "ppo_cartpole", common + [f"run.steps={STEPS}"])
    newest = stopped_by_a_full_disk(embodied.train, cfg, cluster, small_disk)
    ckpt = small_disk / "r" / "checkpoints" / f"step_{newest}"
    assert load_file(str(ckpt / "policy.safetensors"))  # whole
    (small_disk / "filler").unlink()
    embodied.train(C.load(EmbodiedConfig, "ppo_cartpole", common + ["run.resume=true", f"run.steps={newest + 2}"]),
                   cluster)
    rows = [json.loads(line) for line in (small_disk / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, newest + 3))


@pytest.mark.timeout(300)
def test_a_full_disk_stops_a_reasoning_run_keeping_its_checkpoint(cluster, small_disk):
    cfg = C.load(ReasoningConfig, None, [
        f"run.dir={small_disk}", "run.name=r", "run.progress=false", "run.trace=false", f"run.steps={STEPS}",
        "run.save_every=2", "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=4",
        "model.tiny_hidden=32", "model.tiny_layers=1", "data.train_size=200", "data.eval_size=10",
        "reward.fn=faulty_rewards:share_of_digits", "cluster.placement=rollout,reward,inference,actor: 0-1:0"])
    newest = stopped_by_a_full_disk(reasoning.train, cfg, cluster, small_disk)
    assert load_file(str(small_disk / "r" / "checkpoints" / f"step_{newest}" / "model" / "model.safetensors"))


def test_a_read_only_run_directory_is_refused_in_one_line_before_ray_starts(tmp_path, capsys):
    """A run directory on a read-only file system (root ignores permission bits, so a read-only mount): exit code
    2, one line naming the directory and why, before the cluster or the warm start."""
    import ray
    import torch

    from m2flow.cli import main

    disk = mount_tmpfs(tmp_path / "ro", "ro,size=1m")
    started, threads = ray.is_initialized(), torch.get_num_threads()
    try:
        code = main(["train", "ppo_cartpole", f"run.dir={disk}", "run.name=r", "run.progress=false"])
    finally:
        torch.set_num_threads(threads)  # main() sets the driver's to 1
        subprocess.run(["umount", "-l", str(disk)], check=False)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (f"m2flow: error: run directory {disk / 'r'} cannot be written (Read-only file "
                                 "system); choose another run.dir or run.name"), err
    assert ray.is_initialized() == started
