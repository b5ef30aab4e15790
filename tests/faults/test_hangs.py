"""No hang (issue 20): an env whose step never returns stops the run within about env.step_timeout_s, naming the
env worker, and the hung process goes with the run's groups (it once hung `m2flow train` forever)."""

import time

import pytest

from m2flow import config as C
from m2flow.embodied import flow as embodied
from m2flow.embodied.config import EmbodiedConfig
from m2flow.runtime import WorkerError


@pytest.mark.timeout(240)
def test_an_env_step_that_never_returns_stops_the_run_naming_the_env_worker(cluster, tmp_path):
    cfg = C.load(EmbodiedConfig, None, [
        f"run.dir={tmp_path}", "run.name=hang", "run.progress=false", "run.trace=false", "run.steps=3",
        "env.id=faulty_envs:Hang-v0", "env.num_envs=2", "rollout.steps=16", "eval.episodes=0",
        "env.step_timeout_s=3", "cluster.placement=env: 0; rollout,actor: 1"])
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"env rank 0: rollout\(\): an env step \(or reset\) of "
                                          r"env.id=faulty_envs:Hang-v0 has not returned for \d+ s "
                                          r"\(env.step_timeout_s=3\); the run stops"):
        embodied.train(cfg, cluster)
    assert time.monotonic() - start < 120


@pytest.mark.timeout(240)
@pytest.mark.parametrize("env_id,message", [
    ("Raises-v0", r"env rank 0: rollout\(\) raised RuntimeError: simulator crashed at step 6"),
    ("NaNObs-v0", r"env rank 0: rollout\(\) raised ValueError: faulty_envs:NaNObs-v0: non-finite observation from env "
                  r"0 at step \(env step 6, episode step 6\): \[0\.1 0\.1 nan 0\.1\]"),
])
def test_an_env_step_that_raises_or_returns_nan_stops_the_run_naming_the_env_and_step(cluster, tmp_path, env_id,
                                                                                       message):
    """The env worker's error reaches the driver with the env, where it happened and the bad value; the run stops at
    once (no garbage observation reaches the policy)."""
    cfg = C.load(EmbodiedConfig, None, [
        f"run.dir={tmp_path}", "run.name=broken", "run.progress=false", "run.trace=false", "run.steps=3",
        f"env.id=faulty_envs:{env_id}", "env.num_envs=2", "rollout.steps=16", "eval.episodes=0",
        "cluster.placement=env: 0; rollout,actor: 1"])
    start = time.monotonic()
    with pytest.raises(WorkerError, match=message):
        embodied.train(cfg, cluster)
    assert time.monotonic() - start < 60
    assert not (tmp_path / "broken" / "metrics.jsonl").exists()  # no iteration finished
