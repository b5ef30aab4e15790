"""A Meta-World task through the embodied flow (issue 24's light family): the scripted expert's demonstrations,
behaviour cloning on them, then PPO from the cloned policy in the lockstep plan and in the pipelined hybrid plan (envs
on device 0 in two stages, the policy on device 1), with the simulator's success in the metrics."""

import json

from m2flow import config as C
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.envs import experts
from m2flow.embodied.cloning import behaviour_clone
from m2flow.embodied.flow import train


def run(cluster, tmp_path, name, *overrides):
    base = [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.steps=2", "eval.episodes=0",
            "env.id=metaworld/reach-v3", "env.num_envs=4", "env.max_episode_steps=60", "rollout.steps=60",
            "actor.minibatch_size=80", "actor.epochs=2"]
    result = train(C.load(EmbodiedConfig, "ppo_metaworld", base + list(overrides)), cluster)
    return result, [json.loads(line) for line in open(f"{result['run_dir']}/metrics.jsonl")]


def test_demos_behaviour_cloning_then_ppo_from_it_lockstep_and_pipelined(cluster, tmp_path):
    summary = experts.write_demos("metaworld/reach-v3", 6, tmp_path / "demos")
    assert summary["success_rate"] == 1.0
    cfg = C.load(EmbodiedConfig, "ppo_metaworld", ["env.id=metaworld/reach-v3", "eval.episodes=10"])
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


def test_sac_with_demonstrations_in_its_minibatches_and_a_bc_term(cluster, tmp_path):
    """RLPD's sampling plus sac.bc_coef through the flow: half of every minibatch from the expert's episodes, and the
    actor's squared error to their actions (logged as sac/bc_loss) falls as it trains."""
    experts.write_demos("metaworld/reach-v3", 4, tmp_path / "demos")
    base = [f"run.dir={tmp_path}", "run.name=rlpd", "run.progress=false", "run.trace=false", "run.steps=6",
            "eval.episodes=0", "env.id=metaworld/reach-v3", "env.num_envs=4", "env.max_episode_steps=60",
            "algorithm.name=sac", "policy.hidden=[64,64]", "policy.activation=relu", "actor.lr=1e-3",
            "sac.train_freq=8", "sac.gradient_steps=-1", "sac.learning_starts=0", "sac.batch_size=64",
            "sac.buffer_size=10000", f"sac.demos={tmp_path / 'demos'}", "sac.bc_coef=10",
            "cluster.placement=env,rollout,actor: 0"]
    result = train(C.load(EmbodiedConfig, "ppo_metaworld", base), cluster)
    rows = [json.loads(line) for line in open(f"{result['run_dir']}/metrics.jsonl")]
    assert [r["sac/updates"] for r in rows] == [32] * 6 and rows[-1]["env_steps"] == 192
    bc = [r["sac/bc_loss"] for r in rows]
    assert bc[-1] < 0.5 * bc[0], bc
