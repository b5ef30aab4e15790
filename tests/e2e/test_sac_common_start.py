"""`benchmarks/sac_vs_sb3.py --common-start`: SB3's SAC started where m2flow's run of a seed starts collects the
same warm-up transitions as m2flow's flow, to the bit, from the same initial weights; without it, only the actor's
initial weights are common (both libraries seed torch with the seed, then build the actor first)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from m2flow import config as C
from m2flow.flows.embodied import train

SEED, STEPS = 3, 2  # m2flow iterations: 4 envs x 16 steps each


def _benchmark():
    path = Path(__file__).parents[2] / "benchmarks" / "sac_vs_sb3.py"
    spec = importlib.util.spec_from_file_location("sac_vs_sb3", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SETTINGS.extend(["policy.hidden=[32,32]", "sac.buffer_size=1000"])
    return module


@pytest.fixture(scope="module")
def m2flow_start(cluster, tmp_path_factory):
    """The replay buffer and the initial weights of m2flow's run of SEED: the sac_halfcheetah preset before its first
    update (learning_starts is 10,000 env steps), saved after STEPS iterations."""
    bench = _benchmark()
    cfg = C.load(C.EmbodiedConfig, bench.PRESET, [*bench.SETTINGS, f"run.dir={tmp_path_factory.mktemp('m2')}",
                                                  "run.name=start", f"run.seed={SEED}", f"run.steps={STEPS}",
                                                  "run.progress=false", "run.trace=false", "eval.episodes=0",
                                                  "cluster.placement=env,rollout,actor: 0", "sac.max_policy_lag=0"])
    result = train(cfg, cluster)
    ckpt = Path(result["checkpoint"])
    replay = {k[len("data."):]: v.numpy() for k, v in load_file(str(ckpt / "replay.safetensors")).items()
              if k.startswith("data.")}
    return bench, replay, load_file(str(ckpt / "policy.safetensors")), load_file(str(ckpt / "sac_critic.safetensors"))


def _sb3_start(bench, common: bool):
    model, cfg = bench.sb3_model(SEED, common)
    n = cfg.env.num_envs * cfg.sac.train_freq * STEPS
    model.learn(total_timesteps=n)
    rb = model.replay_buffer
    assert rb.pos * rb.n_envs == n
    rows = {k: getattr(rb, name)[:rb.pos] for k, name in [("obs", "observations"), ("actions", "actions"),
                                                            ("rewards", "rewards"), ("next_obs", "next_observations")]}
    # SB3's rows are [step, env]; m2flow's buffer takes an iteration's steps in the same order (time, then env)
    return model, {k: v.reshape(n, *v.shape[2:]).astype(np.float32) for k, v in rows.items()}


def test_common_start_gives_sb3_m2flows_warm_up_transitions_and_initial_weights(m2flow_start):
    bench, replay, policy, critic = m2flow_start
    model, sb3 = _sb3_start(bench, common=True)
    for key in ("obs", "rewards", "next_obs"):
        np.testing.assert_array_equal(sb3[key], replay[key], err_msg=key)  # the same actions in the same envs
    np.testing.assert_allclose(sb3["actions"], replay["actions"], rtol=0, atol=1e-7)  # SB3 rescales into [-1, 1]
    assert torch.equal(model.actor.latent_pi[0].weight.detach(), policy["trunk.0.weight"])
    assert torch.equal(model.actor.log_std.bias.detach(), policy["log_std_head.bias"])
    assert torch.equal(model.critic.qf1[2].weight.detach(), critic["critic.qs.1.0.2.weight"])
    assert torch.equal(model.critic.qf1[4].weight.detach(), critic["critic.qs.1.1.weight"])
    assert torch.equal(model.critic_target.qf0[0].bias.detach(), critic["target.qs.0.0.0.bias"])


def test_without_common_start_sb3_draws_its_own_warm_up_and_critics(m2flow_start):
    bench, replay, policy, critic = m2flow_start
    model, sb3 = _sb3_start(bench, common=False)
    np.testing.assert_array_equal(sb3["obs"][:4], replay["obs"][:4])  # the envs' first reset: seed + i in both
    assert np.abs(sb3["actions"] - replay["actions"]).max() > 0.5
    assert torch.equal(model.actor.latent_pi[0].weight.detach(), policy["trunk.0.weight"])
    assert not torch.equal(model.critic.qf0[0].weight.detach(), critic["critic.qs.0.0.0.weight"])
