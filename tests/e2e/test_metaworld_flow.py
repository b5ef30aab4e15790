"""A Meta-World task through the embodied flow (issue 24's light family): the scripted expert's demonstrations,
behaviour cloning on them, then PPO from the cloned policy in the lockstep plan and in the pipelined hybrid plan (envs
on device 0 in two stages, the policy on device 1), with the simulator's success in the metrics."""

import json

from m2flow import config as C
from m2flow.flows.embodied import behaviour_clone, train
from m2flow.workloads.embodied import experts


def run(cluster, tmp_path, name, *overrides):
    base = [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.steps=2", "eval.episodes=0",
            "env.id=metaworld/reach-v3", "env.num_envs=4", "env.max_episode_steps=60", "rollout.steps=60",
            "actor.minibatch_size=80", "actor.epochs=2"]
    result = train(C.load(C.EmbodiedConfig, "ppo_metaworld", base + list(overrides)), cluster)
    return result, [json.loads(line) for line in open(f"{result['run_dir']}/metrics.jsonl")]


def test_demos_behaviour_cloning_then_ppo_from_it_lockstep_and_pipelined(cluster, tmp_path):
    summary = experts.write_demos("metaworld/reach-v3", 6, tmp_path / "demos")
    assert summary["success_rate"] == 1.0
    cfg = C.load(C.EmbodiedConfig, "ppo_metaworld", ["env.id=metaworld/reach-v3", "eval.episodes=10"])
    bc = behaviour_clone(cfg, tmp_path / "demos", tmp_path / "bc", steps=300, show=False)
    print(f"\nbehaviour cloning: {bc['eval']}")
    assert bc["demo_episodes"] == 6 and bc["eval"]["success_rate"] >= 0.3  # held-out seeds; a random policy: 0%

    init = f"policy.init={tmp_path / 'bc'}"
    _, scratch = run(cluster, tmp_path, "scratch", "run.trace=false", "cluster.placement=env,rollout,actor: 0")
    _, lockstep = run(cluster, tmp_path, "lockstep", init, "run.trace=false", "cluster.placement=env,rollout,actor: 0")
    hybrid, pipelined = run(cluster, tmp_path, "hybrid", init, "env.pipeline_stages=2",
                            "cluster.placement=env: 0; rollout: 1; actor: 1")
    assert hybrid["plan"]["mode"] == "hybrid"
    for rows in (lockstep, pipelined):
        assert [r["env_steps"] for r in rows] == [240, 480] and all("rollout/success_once" in r for r in rows)
    # the cloned policy reaches the goal from the first iteration on, in both plans; a random one does not
    assert min(lockstep[0]["rollout/success_once"], pipelined[0]["rollout/success_once"]) > 0
    assert scratch[0]["rollout/success_once"] == 0
