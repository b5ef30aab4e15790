"""ManiSkill3 PickCube through the embodied flow (issue 24): PPO in the lockstep plan and in the pipelined hybrid plan
(envs on device 0 in two stages, the policy on device 1) collect the same episodes, with the simulator's success in
the metrics; embodied GRPO runs on groups of envs that share a reset seed, scored by success."""

import json

import pytest

from m2flow import config as C
from m2flow.flows.embodied import train


def run(cluster, tmp_path, name, *overrides):
    base = [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.steps=2", "eval.episodes=0",
            "env.num_envs=4", "env.max_episode_steps=20", "rollout.steps=20", "actor.minibatch_size=40",
            "actor.epochs=2"]
    result = train(C.load(C.EmbodiedConfig, "ppo_pickcube", base + list(overrides)), cluster)
    return result, [json.loads(line) for line in open(f"{result['run_dir']}/metrics.jsonl")]


def test_pickcube_runs_lockstep_and_pipelined_alike_with_success_in_the_metrics(cluster, tmp_path):
    _, lockstep = run(cluster, tmp_path, "lockstep", "run.trace=false", "cluster.placement=env,rollout,actor: 0")
    hybrid, pipelined = run(cluster, tmp_path, "hybrid", "env.pipeline_stages=2",
                            "cluster.placement=env: 0; rollout: 1; actor: 1")
    assert hybrid["plan"]["mode"] == "hybrid"
    for a, b in zip(lockstep, pipelined, strict=True):
        assert a["rollout/episodes"] == b["rollout/episodes"] == 4  # every env's 20-step episode ends each iteration
        assert "rollout/success" in a and "rollout/success_once" in b and b["env_steps"] == 80 * b["step"]
    # the first iteration's episodes agree across plans to the policy's rounding (its matmuls run on another thread
    # count in each plan, ~1e-7, and the contact-rich simulation carries that on); after an update they drift apart
    a, b = lockstep[0], pipelined[0]
    assert a["rollout/return"] == pytest.approx(b["rollout/return"], rel=1e-4)
    assert a["rollout/success_once"] == b["rollout/success_once"]
    assert a["actor/vf_loss"] == pytest.approx(b["actor/vf_loss"], rel=1e-3)

def test_embodied_grpo_scores_pickcube_groups_by_success(cluster, tmp_path):
    _, rows = run(cluster, tmp_path, "grpo", "algorithm.name=grpo", "env.seed_groups=2",
                  "cluster.placement=env,rollout,actor: 0")
    assert len(rows) == 2 and all(r["rollout/episodes"] == 4 for r in rows)
    assert all(0.0 <= r["rollout/success_once"] <= 1.0 for r in rows)
