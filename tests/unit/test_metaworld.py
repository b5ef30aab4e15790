"""Meta-World tasks (`metaworld/TASK`, issue 24's light second family) through m2flow's env layer: success from the
simulator for the scripted expert and not for random actions, starts fixed by the reset seed, termination at
success unless ignore_terminations, the expert's dataset, and a clear error for a wrong task name."""

import json
import subprocess
import sys

import numpy as np
import pytest

from m2flow.embodied.envs import EnvGroup, check_env_id, experts, make_env_fns, metaworld


def group(task: str, n: int = 1, seed: int = 0, **kwargs) -> EnvGroup:
    return EnvGroup(make_env_fns(task, n, seed=seed, **kwargs), env_id=task, seed=seed)


@pytest.mark.parametrize("task", ["metaworld/reach-v3", "metaworld/pick-place-v3"])
def test_the_env_group_reports_success_for_the_expert_and_failure_for_random_actions(task):
    run = experts.run_expert(task, seed=11)
    assert run["success"] and run["length"] < 150 and run["obs"].shape == (run["length"], 39)
    g = group(task)
    obs = g.reset(seed=11)
    np.testing.assert_allclose(obs[0], run["obs"][0], atol=1e-6)  # the seed fixes the start
    for action in run["actions"]:  # the expert's actions replayed through the env worker's group
        g.step(action[None])
    [ep] = g.pop_episodes()
    assert ep["success"] and ep["success_once"] and ep["length"] == run["length"]  # it ended at success
    g.close()
    g = group(task, n=2, max_episode_steps=60)
    g.reset(seed=11)
    rng = np.random.default_rng(0)
    for _ in range(60):
        g.step(rng.uniform(-1, 1, (2, 4)).astype(np.float32))
    episodes = g.pop_episodes()
    assert len(episodes) == 2 and not any(e["success_once"] for e in episodes)
    assert all(e["length"] == 60 for e in episodes)  # truncated at the time limit
    g.close()


def test_seeded_starts_and_ignore_terminations():
    g = group("metaworld/push-v3", n=2)
    first, again, other = g.reset(seed=7), g.reset(seed=7), g.reset(seed=8)
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first[0], first[1]) and not np.allclose(first, other)
    assert first.shape == (2, 39) and g.action_space.shape == (4,)
    g.close()
    run = experts.run_expert("metaworld/reach-v3", seed=3)
    g = group("metaworld/reach-v3", max_episode_steps=run["length"] + 20, ignore_terminations=True)
    g.reset(seed=3)
    for t in range(run["length"] + 20):
        g.step(run["actions"][min(t, run["length"] - 1)][None])
        if t + 1 == run["length"]:
            assert g.pop_episodes() == []  # succeeded here, did not end
    [ep] = g.pop_episodes()
    assert ep["length"] == run["length"] + 20 and ep["success_once"]
    g.close()


def test_m2flow_demos_writes_a_meta_world_dataset(tmp_path):
    out = tmp_path / "reach"
    result = subprocess.run([sys.executable, "-m", "m2flow.cli", "demos", "metaworld/reach-v3", "-n", "3", "--seed",
                             "5", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "3 episodes of metaworld/reach-v3: 100% successful" in result.stdout
    summary = json.loads((out / "demos.json").read_text())
    assert summary["task"] == "metaworld/reach-v3" and [e["seed"] for e in summary["episodes"]] == [5, 6, 7]
    _, arrays = experts.load_demos(out)
    assert len(arrays["obs"]) == sum(e["length"] for e in summary["episodes"]) and arrays["obs"].shape[1] == 39
    assert np.abs(arrays["actions"]).max() <= 1.0


def test_a_wrong_meta_world_task_names_the_close_ones():
    with pytest.raises(ValueError, match="close matches: metaworld/reach-v3, metaworld/reach-wall-v3"):
        check_env_id("metaworld/reach-v9")
    with pytest.raises(ValueError, match="not a Meta-World task; tasks: assembly-v3, basketball-v3"):
        check_env_id("metaworld/nothing")
    assert len(metaworld.tasks()) == 50
    result = subprocess.run([sys.executable, "-m", "m2flow.cli", "demos", "metaworld/push-v2", "-n", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == ("m2flow: error: demos: 'metaworld/push-v2' is not a Meta-World "
                                                      "task; close matches: metaworld/push-v3, metaworld/push-wall-v3, "
                                                      "metaworld/push-back-v3, metaworld/stick-push-v3")
