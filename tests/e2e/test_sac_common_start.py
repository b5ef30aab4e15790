"""`benchmarks/sac_vs_sb3.py --common-start`: SB3's SAC started where m2flow's run of a seed starts collects the
same warm-up transitions as m2flow's flow, to the bit, from the same initial weights; without it, only the actor's
initial weights are common (both libraries seed torch with the seed, then build the actor first). Given m2flow's
remaining random draws too, SB3's run is m2flow's lockstep run, to float rounding."""

import importlib.util
import json
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from m2flow import config as C
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.flow import train
from m2flow.embodied.sac.learner import SACLearnerWorker

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
    cfg = C.load(EmbodiedConfig, bench.PRESET, [*bench.SETTINGS, f"run.dir={tmp_path_factory.mktemp('m2')}",
                                                  "run.name=start", f"run.seed={SEED}", f"run.steps={STEPS}",
                                                  "run.progress=false", "run.trace=false", "eval.episodes=0",
                                                  *bench.PLANS["lockstep"]])
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


TWIN_STARTS, TWIN_STEPS = 128, 5  # updates from the third iteration on (192 env steps > 128): 3 x 64 gradient steps


@pytest.fixture(scope="module")
def m2flow_twin(cluster, tmp_path_factory):
    """m2flow's lockstep run of SEED for TWIN_STEPS iterations, learning from TWIN_STARTS env steps on: its
    checkpoint's buffer, networks and temperature, and its iterations' gradient steps."""
    bench = _benchmark()
    bench.SETTINGS.extend([f"sac.learning_starts={TWIN_STARTS}", "sac.logp_eps=1e-6"])  # SB3's log-density
    run = tmp_path_factory.mktemp("twin")
    cfg = C.load(EmbodiedConfig, bench.PRESET, [*bench.SETTINGS, f"run.dir={run}", "run.name=twin",
                                                  f"run.seed={SEED}", f"run.steps={TWIN_STEPS}", "run.progress=false",
                                                  "run.trace=false", "eval.episodes=0", *bench.PLANS["lockstep"]])
    result = train(cfg, cluster)
    ckpt = Path(result["checkpoint"])
    updates = [json.loads(line)["sac/updates"] for line in open(run / "twin" / "metrics.jsonl")]
    state = {**load_file(str(ckpt / "policy.safetensors")), **load_file(str(ckpt / "sac_critic.safetensors"))}
    replay = {k[len("data."):]: v.numpy() for k, v in load_file(str(ckpt / "replay.safetensors")).items()
              if k.startswith("data.")}
    return bench, cfg, replay, state, updates


def _twin_of_m2flow(bench, model, cfg, monkeypatch):
    """Give SB3's run m2flow's remaining random draws: after the warm-up, the exploration noise of m2flow's policy
    worker (`sample_actions` with `noise_seed(seed, t)`, on SB3's actor's weights); every minibatch's rows, drawn as
    m2flow's buffer draws them (its flat row r is SB3's step r // n_envs of env r % n_envs); the reparameterization
    noise of each gradient step, drawn as m2flow's learner draws it (the actor's actions, then the next
    observations')."""
    from stable_baselines3.common.type_aliases import ReplayBufferSamples

    from m2flow.embodied.workers.policy import make_policy, noise_seed, sample_actions

    seed, warm_up, n_envs = cfg.run.seed, model._sample_action, model.n_envs
    policy = make_policy(cfg, model.observation_space, model.action_space).eval()

    def sample_action(learning_starts, action_noise=None, n_envs=1):
        if model.num_timesteps < learning_starts:
            return warm_up(learning_starts, action_noise, n_envs)
        with torch.no_grad():
            for dst, src in bench.actor_pairs(policy, model):
                for a, b in zip(src.parameters(), dst.parameters(), strict=True):
                    b.copy_(a)
            obs = torch.as_tensor(model._last_obs, dtype=torch.float32)
            t = model.num_timesteps // n_envs  # m2flow's policy time step
            actions = sample_actions(policy, obs, noise_seed(seed, t), 0, n_envs)[0].numpy()
        return actions, model.policy.scale_action(actions)

    rb, rows = model.replay_buffer, torch.Generator().manual_seed(seed + 4242)

    def sample(batch_size, env=None):
        r = torch.randint(0, rb.pos * n_envs, (batch_size,), generator=rows).numpy()
        t, e = r // n_envs, r % n_envs  # (SB3's _get_samples, with these env indices instead of its own draw)
        return ReplayBufferSamples(*map(rb.to_torch, (rb.observations[t, e], rb.actions[t, e],
                                                      rb.next_observations[t, e],
                                                      (rb.dones[t, e] * (1 - rb.timeouts[t, e]))[:, None],
                                                      rb.rewards[t, e][:, None])))

    gen, noise = torch.Generator().manual_seed(seed + 777), []

    def rsample(self, sample_shape=torch.Size()):
        if not noise:
            noise.extend(torch.randn((2, *self.loc.shape), generator=gen))
        return self.loc + self.scale * noise.pop(0)

    model._sample_action = sample_action
    monkeypatch.setattr(rb, "sample", sample)
    monkeypatch.setattr(torch.distributions.Normal, "rsample", rsample)
    return noise


def _weight_gaps(bench, model, state: dict) -> dict[str, float]:
    """The largest difference between SB3's weights and m2flow's checkpoint's `state`, per network and temperature."""
    learner = SACLearnerWorker(C.load(EmbodiedConfig, bench.PRESET, [*bench.SETTINGS, "sac.buffer_size=1"]),
                               model.observation_space, model.action_space)
    learner.policy.load_state_dict({k: v for k, v in state.items() if not k.startswith(("critic.", "target.", "log_"))
                                    or k.startswith("log_std_head.")})
    learner.critic.load_state_dict({k[7:]: v for k, v in state.items() if k.startswith("critic.")})
    learner.target.load_state_dict({k[7:]: v for k, v in state.items() if k.startswith("target.")})
    pairs = {"actor": bench.actor_pairs(learner.policy, model), "critics": [(learner.critic, model.critic)],
             "targets": [(learner.target, model.critic_target)]}
    gaps = {name: max(float((a.detach() - b.detach()).abs().max()) for ours, theirs in modules
                      for a, b in zip(ours.parameters(), theirs.parameters(), strict=True))
            for name, modules in pairs.items()}
    return {**gaps, "log_alpha": abs(float(state["log_alpha"]) - model.log_ent_coef.item())}


def test_with_every_draw_common_sb3s_run_is_m2flows_lockstep_run(m2flow_twin, monkeypatch):
    """SB3 from the common start, given m2flow's exploration noise, minibatch rows and reparameterization noise too
    (m2flow on SB3's log-density, sac.logp_eps=1e-6), runs m2flow's lockstep run: the same iterations update (once
    more than learning_starts env steps are in), the same transitions reach the buffer, and after the first 64
    updates the actors act alike to 1e-6 (measured: 6e-8): the loops (when each acts at random, when and how often
    it updates, on which rows, in which order) are the same. From there the runs part only as HalfCheetah's dynamics
    amplify float rounding (measured after 128 more env steps: observations 0.013 apart, weights 9e-5)."""
    bench, cfg, replay, state, updates = m2flow_twin
    model, _ = bench.sb3_model(SEED, common=True)
    noise = _twin_of_m2flow(bench, model, cfg, monkeypatch)
    per = cfg.env.num_envs * cfg.sac.train_freq  # env steps an iteration
    n, first = per * TWIN_STEPS, per * (TWIN_STARTS // per + 1)  # first: the first step after the first updates
    model.learn(total_timesteps=n)
    assert not noise  # every gradient step took its two draws
    assert updates == [0, 0, 64, 64, 64] and model._n_updates == sum(updates)
    rb = model.replay_buffer
    sb3 = {k: getattr(rb, name)[:rb.pos].reshape(n, -1).astype(np.float32) for k, name in [
        ("obs", "observations"), ("actions", "actions"), ("rewards", "rewards"), ("next_obs", "next_observations")]}
    ours = {k: replay[k].reshape(n, -1) for k in sb3}
    for key in ("obs", "rewards", "next_obs"):  # the warm-up and the first policy steps, before any update
        np.testing.assert_array_equal(sb3[key][:first], ours[key][:first], err_msg=key)
    np.testing.assert_allclose(sb3["actions"][:first], ours["actions"][:first], rtol=0, atol=1e-7)
    np.testing.assert_allclose(sb3["actions"][first:first + cfg.env.num_envs],  # the updated actors' first actions
                               ours["actions"][first:first + cfg.env.num_envs], rtol=0, atol=1e-6)
    gaps = _weight_gaps(bench, model, state)
    assert np.abs(sb3["obs"] - ours["obs"]).max() < 0.1 and max(gaps.values()) < 1e-3, gaps


def test_the_summary_sets_wall_times_side_by_side_only_for_runs_that_had_the_machine_alike():
    """An SB3 run pinned to one core with one thread (as the common-start seeds were run, two at once) gets no wall
    ratio beside an m2flow run on the whole machine, and says how it ran; runs alike (or JSON from before the
    setting was recorded) keep theirs. Returns are compared either way."""
    bench = _benchmark()
    whole = {"cpus": bench.os.cpu_count(), "omp_threads": None}
    runs = [{"runner": "sb3", "seed": 0, "env_steps": 100, "wall_s": 3000.0, "train_s": 2900.0,
             "env_steps_per_s": 34.0, "return_mean": 4324.0, "cpus": 1, "omp_threads": "1"},
            {"runner": "sb3", "seed": 1, "env_steps": 100, "wall_s": 2000.0, "train_s": 1900.0,
             "env_steps_per_s": 52.0, "return_mean": 5383.0, **whole},
            {"runner": "m2flow overlapped", "seed": 0, "env_steps": 100, "wall_s": 1200.0, "train_s": 1100.0,
             "env_steps_per_s": 90.0, "return_mean": 6247.0},
            {"runner": "m2flow overlapped", "seed": 1, "env_steps": 100, "wall_s": 1100.0, "train_s": 1000.0,
             "env_steps_per_s": 100.0, "return_mean": 4997.0, **whole}]
    rows = {line.split(" |")[0]: line for line in bench.by_seed(runs).splitlines()}
    assert rows["| 0"] == "| 0 | 4324 | 3000 (1 core(s), OMP_NUM_THREADS=1) | 6247 | 1200 |"
    assert rows["| 1"] == "| 1 | 5383 | 2000 | 4997 | 1100 (0.55x) |"
    assert "return at least SB3's on 1 of the 2 seeds" in bench.by_seed(runs)
    m2flow_row = next(line for line in bench.table(runs).splitlines() if line.startswith("| m2flow"))
    assert m2flow_row.split(" | ")[4] == "0.55"  # wall / SB3's: seed 1's alone


def test_the_summary_gives_the_return_gaps_with_bootstrap_intervals_that_hold_zero_only_when_the_seeds_overlap():
    """The gap in median and mean return between a plan and SB3 over 3+ seeds, each side's seeds resampled on their
    own: seeds that overlap give an interval around 0; seeds that lie apart give one that excludes it."""
    bench = _benchmark()
    mixed, sb3 = [5161.0, 5423.0, 5245.0, 5149.0], [5812.0, 4904.0, 5527.0, 4989.0]
    point, low, high = bench.gap(mixed, sb3, statistics.mean)
    assert point == statistics.mean(mixed) - statistics.mean(sb3) and low < 0 < high
    assert bench.gap(sb3, sb3, statistics.median)[0] == 0
    point, low, high = bench.gap([6000.0, 6100.0, 6200.0], [5000.0, 5100.0, 5200.0], statistics.median)
    assert (point, low, high) == (1000.0, 800.0, 1200.0)  # every resample's medians lie 800 to 1200 apart
    runs = [{"runner": who, "seed": seed, "env_steps": 100, "wall_s": 1000.0, "env_steps_per_s": 1.0,
             "return_mean": value} for who, values in [("sb3", sb3), ("m2flow overlapped", mixed)]
            for seed, value in enumerate(values)]
    line = bench.by_seed(runs).splitlines()[-1]
    assert line.startswith("m2flow overlapped - SB3, 90% bootstrap intervals over the seeds: the median -55 [")
    assert "; the mean -64 [" in line
