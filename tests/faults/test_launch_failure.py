"""A failure while the embodied flow launches its workers ends every process it had already asked for: the policy's
and the learner's processes start early (`Group.start`, while the env worker is built), and none of them may be left
behind holding a device slot when the env worker, or the second of them, cannot be had."""

import pytest
import ray

from m2flow import config as C
from m2flow.embodied import flow as embodied
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.workers.env import EnvWorker
from m2flow.runtime import Group


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fails", ["env", "second_start"])
def test_a_failure_during_launch_ends_the_processes_started_early(cluster, tmp_path, monkeypatch, fails):
    real_start, started = Group.start.__func__, []

    def start(cls, *args, **kwargs):
        if fails == "second_start" and started:
            raise RuntimeError("no process for the learner")
        started.append(real_start(cls, *args, **kwargs))
        return started[-1]

    def env_launch(cls, *args, **kwargs):
        raise RuntimeError("the env worker could not be built")

    monkeypatch.setattr(Group, "start", classmethod(start))
    if fails == "env":
        monkeypatch.setattr(EnvWorker, "launch", classmethod(env_launch))
    cfg = C.load(EmbodiedConfig, None, [
        f"run.dir={tmp_path}", "run.name=launch", "run.progress=false", "run.trace=false", "run.steps=1",
        "env.num_envs=2", "rollout.steps=16", "eval.episodes=0", "cluster.placement=env: 0; rollout,actor: 1"])
    message = "the env worker could not be built" if fails == "env" else "no process for the learner"
    with pytest.raises(RuntimeError, match=message):
        embodied.train(cfg, cluster)
    assert [g.component for g in started] == (["rollout", "actor"] if fails == "env" else ["rollout"])
    for group in started:
        for actor in group._actors:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.alive.remote(), timeout=30)
