"""Reasoning PPO with a critic (issue 15, `algorithm.name=ppo`): a critic component values every response token,
the actor learns from token-level GAE advantages, the critic from the returns (clipped value loss). It is placed
like any component (beside the actor unless the placement names it), checkpointed with the actor, and resumed."""

import json

import pytest
import yaml

from m2flow import config as C
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.flow import train

PPO = ["algorithm.name=ppo", "algorithm.advantage=gae", "critic.lr=1e-4", "reward.fn=reward_fixtures:digit_fraction"]


def run(cluster, tmp_path, name, *overrides):
    base = [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.trace=false", "run.steps=2",
            "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=6", "actor.lr=1e-3",
            "data.train_size=400", "data.eval_size=20", "cluster.placement=rollout,reward,inference,actor: 0-1:0",
            *PPO]
    train(C.load(ReasoningConfig, None, base + list(overrides)), cluster)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def test_ppo_with_a_critic_learns_the_task_and_the_critic_learns_the_returns(cluster, tmp_path):
    """The reward (the share of digits in a response) rises over 16 steps (GRPO on the same work at its default
    lr: 0.04 -> 0.09 over the first and last 4 steps; PPO here 0.05 -> 0.13), and the critic's values come to explain
    the returns: its explained variance rises from far below 0 (worse than a constant) towards 0 and above."""
    rows = run(cluster, tmp_path, "ppo", "run.steps=16", "actor.lr=3e-3", "critic.lr=1e-4")
    first, last = rows[:4], rows[-4:]
    assert mean(last, "reward/mean") > mean(first, "reward/mean") + 0.05, [r["reward/mean"] for r in rows]
    assert mean(last, "critic/explained_var") > mean(first, "critic/explained_var") + 0.3
    assert all(r["critic/samples"] == 32 and r["actor/samples"] == 32 for r in rows)
    assert all(abs(r["critic/advantage_std"]) > 0 for r in rows)
    plan = yaml.safe_load((tmp_path / "ppo" / "plan.yaml").read_text())
    assert plan["placement"]["critic"] == plan["placement"]["actor"]  # placed beside the actor
    assert (tmp_path / "ppo" / "checkpoints" / "step_16" / "critic_dcp" / ".metadata").exists()


def test_ppo_resumes_the_critic_with_the_actor(cluster, tmp_path):
    """A run stopped after its step-2 checkpoint and resumed trains on as one that never stopped: the critic's weights
    and optimizer come back with the actor's, so its values, the advantages and both updates match."""
    full = run(cluster, tmp_path, "full", "run.steps=4", "run.save_every=2")
    run(cluster, tmp_path, "parted", "run.steps=2", "run.save_every=2")
    parted = run(cluster, tmp_path, "parted", "run.steps=4", "run.save_every=2", "run.resume=true")
    for a, b in zip(full[2:], parted[2:], strict=True):
        for k in ("reward/mean", "critic/value_mean", "critic/vf_loss", "actor/pg_loss", "actor/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k, a[k], b[k])


def test_a_critic_sharded_over_two_ranks_trains_as_one_process_and_resumes_on_one(cluster, tmp_path):
    """Critic and actor on 2 ranks each (FSDP2; two sharded groups on the same devices take them as groups), every
    rank valuing and training on its share of the step, the advantages whitened over both shares' tokens: the same
    values, advantages and updates as one process each (to float rounding). The critic's checkpoint holds a shard per
    rank; the run resumes with a 1-rank critic."""
    one = run(cluster, tmp_path, "one", "cluster.placement=rollout,reward,inference: 0; actor,critic: 1")
    two = run(cluster, tmp_path, "two", "actor.backend=fsdp2", "run.save_every=2",
              "cluster.placement=rollout,reward,inference: 0; actor,critic: 0-1")
    for a, b in zip(one, two, strict=True):
        assert b["critic/samples"] == a["critic/samples"] == 32
        assert a["reward/mean"] == b["reward/mean"]  # the same samples
        for k in ("critic/value_mean", "critic/return_mean", "critic/vf_loss", "critic/advantage_std",
                  "critic/explained_var", "critic/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k, a[k], b[k])
        # the actor's: step 1 to rounding; step 2 within 1% (Adam's first step moves each weight by about lr x the
        # sign of its gradient, so float rounding in near-zero gradients shows); actor/pg_loss is a per-rank mean
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-5 if a["step"] == 1 else 1e-2)
    shards = tmp_path / "two" / "checkpoints" / "step_2" / "critic_dcp"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    resumed = run(cluster, tmp_path, "two", "run.steps=3", "run.resume=true",
                  "cluster.placement=rollout,reward,inference: 0; actor,critic: 1")
    assert [r["step"] for r in resumed] == [1, 2, 3] and resumed[-1]["critic/samples"] == 32


def test_critic_warmup_keeps_the_actor_still(cluster, tmp_path):
    """`critic.warmup_steps=2`: the first two steps train the critic only (the actor's samples are 0 and its
    weights stay, so the rollout samples from the start model); step 3 trains both. The pipelined plan: the critic
    beside the actor on device 1, streaming from the rollout on device 0."""
    rows = run(cluster, tmp_path, "warm", "run.steps=3", "critic.warmup_steps=2",
               "cluster.placement=rollout: 0; reward,inference,actor: 1")
    assert [r["actor/samples"] for r in rows] == [0, 0, 32]
    assert all(r["critic/samples"] == 32 and r["critic/grad_norm"] > 0 for r in rows)


def test_ppo_options_are_checked():
    with pytest.raises(C.ConfigError, match="set algorithm.advantage=gae"):
        C.load(ReasoningConfig, None, ["algorithm.name=ppo"])
    with pytest.raises(C.ConfigError, match=r"gae with name=ppo"):
        C.load(ReasoningConfig, None, ["algorithm.advantage=gae"])
    cfg = C.load(ReasoningConfig, None, [*PPO, "cluster.placement=rollout: 0; reward,inference,actor: 1"])
    assert cfg.placement() == "rollout: 0; reward,inference,actor,critic: 1"
    assert cfg.cluster.placement == "rollout: 0; reward,inference,actor: 1"  # validation changes nothing
    named = C.load(ReasoningConfig, None, [*PPO, "cluster.placement=rollout,critic: 0; reward,inference,actor: 1"])
    assert named.placement() == named.cluster.placement == "rollout,critic: 0; reward,inference,actor: 1"


@pytest.mark.timeout(900)
def test_auto_mode_profiles_the_critic_and_places_it(cluster, tmp_path):
    """`cluster.placement=auto` with PPO: the profile times the critic (a stage that waits for the whole batch), the
    search places five components, and the chosen plan trains with the critic in it."""
    from m2flow.api import train as api_train
    from m2flow.planner.profile import Profile

    cfg = C.load(ReasoningConfig, None, [
        f"run.dir={tmp_path}", "run.name=auto", "run.progress=false", "run.trace=false", "run.steps=2",
        "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=6", "data.train_size=200",
        "data.eval_size=20", "cluster.placement=auto", *PPO])
    api_train(cfg, cluster=cluster)
    run_dir = tmp_path / "auto"
    profile = Profile.load(run_dir / "profile.json")
    assert list(profile.stages) == ["rollout", "reward", "inference", "critic", "actor"]
    assert not profile.components["critic"].streams and profile.components["critic"].state_bytes > 0
    assert {m.devices for m in profile.measurements if m.component == "critic"} == {1, 2}
    plan = yaml.safe_load((run_dir / "plan.yaml").read_text())
    assert plan["chosen_by"] == "auto" and "critic" in plan["placement"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["critic/samples"] for r in rows] == [32, 32]
    assert json.loads((run_dir / "plan_report.json").read_text())["steps"] == 2
