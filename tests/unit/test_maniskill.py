"""ManiSkill3 tasks through m2flow's env layer (issue 24): PickCube-v1, PushCube-v1 and StackCube-v1 with state
observations; per-episode success from the simulator; seeded resets; the scripted experts and their datasets; clear
errors for a wrong task name and for a machine without a Vulkan device."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from m2flow.embodied.envs import EnvGroup, check_env_id, make_env_fns
from m2flow.embodied.envs import experts, maniskill

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "demos" / "PickCube-v1"


def group(task: str, n: int = 1, seed: int = 0) -> EnvGroup:
    return EnvGroup(make_env_fns(task, n, seed=seed), env_id=task, seed=seed)


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_the_env_group_reports_success_for_the_experts_demos_and_failure_for_random_actions():
    """The shipped demos (`m2flow demos PickCube-v1 -n 10`) replayed from their reset seeds: the same observations,
    and every episode ends in success at the recorded step. Random actions from the same seeds never succeed."""
    summary, demos = experts.load_demos(FIXTURE)
    assert summary["task"] == "PickCube-v1" and summary["success_rate"] == 1.0
    g = group("PickCube-v1")  # one env for the episodes in turn, as the expert ran them (a reset's first obs still
    for number, episode in enumerate(summary["episodes"][:3]):  # carries the last episode's is_grasped flag)
        rows = demos["episode"] == number
        obs = g.reset(seed=episode["seed"])
        replayed = []
        for action in demos["actions"][rows]:
            replayed.append(obs[0])
            obs = g.step(action[None]).obs
        # the physics rounds otherwise on another CPU: 5e-5 apart on an Intel Xeon (AVX-512), the fixture's from an EPYC
        np.testing.assert_allclose(np.array(replayed), demos["obs"][rows], atol=1e-3)
        [ep] = g.pop_episodes()
        assert ep["success"] and ep["success_once"] and ep["length"] == episode["length"] < 100
    g.close()
    g = group("PickCube-v1", n=2, seed=summary["episodes"][0]["seed"])
    g.reset(seed=summary["episodes"][0]["seed"])
    rng = np.random.default_rng(0)
    for _ in range(100):
        g.step(rng.uniform(-1, 1, (2, 4)).astype(np.float32))
    episodes = g.pop_episodes()
    assert len(episodes) == 2 and not any(e["success_once"] or e["success"] for e in episodes)
    assert all(e["length"] == maniskill.MAX_EPISODE_STEPS for e in episodes)  # truncated at the time limit
    g.close()


def test_with_ignore_terminations_an_episode_runs_on_past_success_to_the_step_limit():
    """`env.kwargs.ignore_terminations=true` (ManiSkill's option): the expert's episode does not end at its success;
    it runs to the step limit (here 40), and the episode still counts as successful once."""
    summary, demos = experts.load_demos(FIXTURE)
    episode = summary["episodes"][0]
    g = EnvGroup(make_env_fns("PickCube-v1", 1, max_episode_steps=40, ignore_terminations=True), env_id="PickCube-v1")
    g.reset(seed=episode["seed"])
    actions = demos["actions"][demos["episode"] == 0]
    for t in range(40):
        g.step(actions[min(t, len(actions) - 1)][None])  # past the demo: its last action again
        if t + 1 == episode["length"]:
            assert g.pop_episodes() == []  # succeeded here, did not end
    [ep] = g.pop_episodes()
    assert ep["length"] == 40 and ep["success_once"] and episode["length"] < 40
    g.close()


@pytest.mark.parametrize("task,obs_dim", [("PickCube-v1", 42), ("PushCube-v1", 35), ("StackCube-v1", 48)])
def test_every_task_resets_from_its_seed_and_its_expert_solves_it(task, obs_dim):
    g = group(task, n=2)
    first, again = g.reset(seed=7), g.reset(seed=7)
    assert first.shape == (2, obs_dim) and first.dtype == np.float32 and g.action_space.shape == (4,)
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first[0], first[1])  # env i resets from seed + i
    g.close()
    run = experts.run_expert(task, seed=3)
    assert run["success"] and run["length"] < maniskill.MAX_EPISODE_STEPS and run["obs"].shape == (run["length"],
                                                                                                   obs_dim)


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_m2flow_demos_writes_a_dataset_with_seeds_and_success(tmp_path):
    out = tmp_path / "push"
    result = subprocess.run([sys.executable, "-m", "m2flow.cli", "demos", "PushCube-v1", "-n", "3", "--seed", "5",
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "3 episodes of PushCube-v1: 100% successful" in result.stdout
    summary = json.loads((out / "demos.json").read_text())
    assert [e["seed"] for e in summary["episodes"]] == [5, 6, 7] and summary["instruction"] == maniskill.TASKS[
        "PushCube-v1"]
    _, arrays = experts.load_demos(out)
    lengths = [e["length"] for e in summary["episodes"]]
    assert len(arrays["obs"]) == len(arrays["actions"]) == sum(lengths)
    assert np.bincount(arrays["episode"]).tolist() == lengths
    assert np.abs(arrays["actions"]).max() <= 1.0


def test_a_wrong_task_name_lists_the_tasks():
    with pytest.raises(ValueError, match="PickCube-v1"):
        check_env_id("PickCub-v1")
    result = subprocess.run([sys.executable, "-m", "m2flow.cli", "demos", "PickCub-v1", "-n", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == ("m2flow: error: demos: no expert for task 'PickCub-v1'; tasks: PickCube-v1, "
                                     "PushCube-v1, StackCube-v1, or metaworld/TASK for a Meta-World task (e.g. "
                                     "metaworld/reach-v3)")


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_a_machine_without_a_vulkan_device_gets_a_one_line_error_naming_the_fix(tmp_path):
    env = dict(os.environ, VK_ICD_FILENAMES=str(tmp_path / "no_driver.json"))  # Vulkan's loader finds no driver
    result = subprocess.run([sys.executable, "-m", "m2flow.cli", "train", "ppo_pickcube", f"run.dir={tmp_path}"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"m2flow: error: env.id: PickCube-v1: {maniskill.VULKAN_ERROR}"
