"""The embodied flow on real Ray workers: CartPole PPO solves (>= 475), the same driver runs lockstep-collocated,
pipelined-hybrid and two env workers by config alone with the same data, the trace shows env/policy overlap,
resume continues from a checkpoint (normalizers included), and bad inputs fail with errors that name the worker."""

import json

import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml
from gymnasium import spaces

from m2flow import config as C
from m2flow.api import load_config
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.envs import Trajectory
from m2flow.embodied.flow import train
from m2flow.embodied.workers.env import EnvWorker
from m2flow.embodied.workers.policy import PolicyWorker
from m2flow.runtime import Channel, WorkerError, parse_placement, release_all, wait_all


class NaNObs(gym.Env):
    """Env 1 of a group (reset seed 1) puts NaN into its observation at episode step 5."""

    observation_space = spaces.Box(-np.inf, np.inf, (3,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, render_mode=None):
        self.render_mode = render_mode

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.bad = 0, seed == 1
        return np.zeros(3, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(3, np.nan if self.bad and self.t == 5 else 0.0, np.float32), 1.0, False, False, {}


if "NaNObs-v0" not in gym.registry:
    gym.register(id="NaNObs-v0", entry_point=NaNObs, max_episode_steps=50)


def cfg_for(tmp_path, name, **over):
    base = {"run": {"name": name, "dir": str(tmp_path), "steps": 2, "progress": False},
            "env": {"id": "CartPole-v1", "num_envs": 8}, "rollout": {"steps": 32},
            "actor": {"epochs": 2, "minibatch_size": 128}, "eval": {"episodes": 0}}
    return C.load(EmbodiedConfig, C.merge(base, over))


def rows(result):
    return [json.loads(line) for line in open(f"{result['run_dir']}/metrics.jsonl")]


def test_cartpole_ppo_preset_reaches_475(cluster, tmp_path):
    """The configs/ppo_cartpole.yaml preset as a user runs it (seeded): mean return >= 475, and a full run directory."""
    cfg = C.load(EmbodiedConfig, "ppo_cartpole", [f"run.dir={tmp_path}", "run.progress=false", "run.plots=true"])
    result = train(cfg, cluster)
    m = result["metrics"]
    assert m["rollout/return_window"] >= 475, m
    assert result["eval"]["return_mean"] >= 475 and result["eval"]["episodes"] == 10
    history = rows(result)
    assert history[0]["rollout/return"] < 50 and m["env_steps"] <= 100_000  # learned, within rl-zoo's budget
    run = tmp_path / "ppo_cartpole"
    for path in ("config.yaml", "plan.yaml", "trace.json", "eval.json", "plots/return.png", "plots/losses.png",
                 "plots/timeline.png"):
        assert (run / path).exists(), path
    assert list((run / "tb").iterdir())
    last = run / "checkpoints" / f"step_{len(history)}"
    assert (last / "policy.safetensors").exists() and (last / "COMPLETE").exists()


def test_run_plots_false_draws_no_png_and_keeps_the_rest(cluster, tmp_path):
    """`run.plots=false` (sweeps, tests): no PNG under plots/, neither the metric curves nor the timeline; the
    metrics, TensorBoard, trace.json and checkpoints are written as with plots (test_cartpole_ppo_preset_reaches_475
    checks the PNGs of a run with them)."""
    result = train(cfg_for(tmp_path, "noplots", run={"plots": False}), cluster)
    run = tmp_path / "noplots"
    assert len(rows(result)) == 2 and list((run / "tb").iterdir())
    assert (run / "trace.json").exists() and (run / "checkpoints" / "step_2" / "COMPLETE").exists()
    assert not list(run.rglob("*.png")) and not (run / "plots").exists()


def test_target_kl_stops_every_actor_rank_at_the_same_minibatch(cluster, tmp_path):
    """`algorithm.target_kl` decides on the ranks' mean KL (`mean_over_ranks`), the KL one rank over the same data
    decides on: a 2-rank actor stops where one rank stops. (Where each rank decided on its own share's KL, a rank that
    stopped alone left the other waiting in its next all-reduce: a PickCube run hung so.)"""
    common = dict(algorithm={"target_kl": 1e-4}, actor={"epochs": 4, "minibatch_size": 32, "lr": 3e-3},
                  run={"trace": False})
    one = rows(train(cfg_for(tmp_path, "one", cluster={"placement": "env,rollout,actor: 0"}, **common), cluster))
    two = rows(train(cfg_for(tmp_path, "two", cluster={"placement": "env,rollout,actor: 0-1"}, **common), cluster))
    for a, b in zip(one, two, strict=True):
        assert a["actor/early_stop"] == b["actor/early_stop"] == 1.0
        assert a["actor/updates"] == b["actor/updates"] < 4 * 256 // 32  # stopped before the last minibatch
        assert a["actor/approx_kl"] == pytest.approx(b["actor/approx_kl"], rel=1e-3)


def test_hybrid_pipelined_run_matches_lockstep_and_its_trace_shows_overlap(cluster, tmp_path):
    """The same driver, by config alone: collocated lockstep, hybrid (envs on device 0, policy on 1, 2 stages,
    a 2-rank data-parallel actor) and lockstep on both devices rank by rank (env r, policy r and actor rank r in one
    process each) give the same episodes; the trace shows the simulator stepping one stage while the policy infers
    for the other."""
    lockstep = train(cfg_for(tmp_path, "lockstep", cluster={"placement": "env,rollout,actor: 0"},
                             run={"trace": False, "steps": 3}), cluster)
    hybrid = train(cfg_for(tmp_path, "hybrid", cluster={"placement": "env: 0; rollout: 1; actor: 0-1"},
                           env={"pipeline_stages": 2}, run={"steps": 3, "plots": True}), cluster)
    per_rank = train(cfg_for(tmp_path, "per_rank", cluster={"placement": "env,rollout,actor: 0-1"},
                             run={"trace": False, "steps": 3}), cluster)
    assert hybrid["plan"]["mode"] == "hybrid" and hybrid["plan"]["placement"]["actor"] == [[0], [1]]
    plans = [yaml.safe_load(open(f"{r['run_dir']}/plan.yaml")) for r in (lockstep, hybrid, per_rank)]
    # lockstep on one device: the policy worker and the actor live in the env worker's process (on two: rank r's)
    assert [p["rollout_in_env_process"] for p in plans] == [True, False, True]
    assert [p["actor_in_env_process"] for p in plans] == [True, False, True]
    # rollout.check_weight_sync=first: the start's and iteration 1's syncs are verified (else train() raised); the
    # unverified sync after iteration 2 still delivers: iteration 3 agrees in all plans (in place, each actor rank
    # into its own process's policy / object store)
    runs = [rows(r) for r in (lockstep, hybrid, per_rank)]
    assert [[r["sync/checked"] for r in history] for history in runs] == [[1, 0, 0]] * 3
    assert len(runs[0]) == 3
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a["rollout/episodes"] == b["rollout/episodes"] and a["rollout/return"] == b["rollout/return"]
            assert a["actor/vf_loss"] == pytest.approx(b["actor/vf_loss"], rel=1e-4)

    trace = json.load(open(f"{hybrid['run_dir']}/trace.json"))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    env = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "env s0"]
    policy = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "policy s1"]
    assert env and policy
    overlapping = sum(any(s < pe and ps < e for ps, pe in policy) for s, e in env)
    assert overlapping >= len(env) // 4, f"{overlapping} of {len(env)} env s0 spans overlap policy s1 spans"
    assert (tmp_path / "hybrid" / "plots" / "timeline_rollout.png").exists()


def test_real_workers_lockstep_pipelined_and_two_env_workers_give_identical_trajectories(cluster, tmp_path):
    """Deterministic policy, truncations (a time limit of 9) and terminations: lockstep on one device (policy in
    its own process, then co-hosted in the env worker's), 2 stages over two devices, two env workers."""
    runs = [("env,rollout: 0", 1, False), ("env,rollout: 0", 1, True), ("env: 0; rollout: 1", 2, False),
            ("env: 0-1; rollout: 0", 2, False)]
    trajectories = []
    for spec, stages, cohost in runs:
        cfg = cfg_for(tmp_path, "t", env={"pipeline_stages": stages, "max_episode_steps": 9},
                      rollout={"deterministic": True})
        plan = parse_placement(spec, cluster.num_devices)
        env = EnvWorker.launch(cluster, plan["env"], cfg)
        policy = PolicyWorker.launch(cluster, plan["rollout"], cfg, *env.on(0).spaces().wait()[0],
                                     host_with=env if cohost else None)
        assert (policy.info().wait()[0]["pid"] == env.info().wait()[0]["pid"]) == cohost
        out = Channel.create(f"embodied-test-{spec}")
        try:
            per_step = []
            for step in range(2):
                wait_all([env.rollout(policy, out, cfg.rollout.steps, step, 1)])
                parts = sorted((out.get(key=0) for _ in range(env.world_size)), key=lambda x: x["env_rank"])
                per_step.append(Trajectory.cat_envs([x["traj"] for x in parts]))
            trajectories.append(per_step)
        finally:
            release_all([env, policy])
            out.destroy()
    for other in trajectories[1:]:
        for a, b in zip(trajectories[0], other):
            for name in ("obs", "actions", "rewards", "terminated", "truncated", "next_obs"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            for name in ("logprobs", "values", "final_values", "next_values"):
                torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)
    both = trajectories[0]
    assert any(t.truncated.any() for t in both) and any(t.terminated.any() for t in both)


def test_resume_with_two_env_workers_restores_weights_and_normalizers(cluster, tmp_path):
    from safetensors.torch import load_file

    two = {"placement": "env: 0-1; rollout,actor: 0"}
    first = train(cfg_for(tmp_path, "resume", cluster=two, env={"norm_obs": True},
                          run={"save_every": 1, "eval_every": 2}, eval={"episodes": 2}), cluster)
    assert "eval/return_mean" in rows(first)[1] and "eval/return_mean" not in rows(first)[0]
    ckpt = tmp_path / "resume" / "checkpoints"
    counts2 = [float(load_file(str(ckpt / "step_2" / f"env_{r}.safetensors"))["obs.count"]) for r in (0, 1)]
    # resumed from the run's own config.yaml, as `m2flow train runs/NAME/config.yaml run.resume=true` does
    second = train(load_config(str(tmp_path / "resume" / "config.yaml"), ["run.steps=3", "run.resume=true"]), cluster)
    history = rows(second)
    assert [r["step"] for r in history] == [1, 2, 3] and second["iterations"] == 1
    assert history[-1]["env_steps"] == 3 * 8 * 32 and rows(first)[1] == history[1]
    counts3 = [float(load_file(str(ckpt / "step_3" / f"env_{r}.safetensors"))["obs.count"]) for r in (0, 1)]
    for c2, c3 in zip(counts2, counts3):
        assert c3 > c2 + 4 * 32 - 1  # each env worker's normalizer went on from the checkpoint, not from scratch


def test_bad_inputs_fail_naming_the_worker(cluster, tmp_path):
    with pytest.raises(WorkerError, match=r"env rank 0.*unknown gymnasium env id 'CartPol-v1'.*CartPole-v1"):
        train(cfg_for(tmp_path, "bad_id", env={"id": "CartPol-v1"}), cluster)
    nan = cfg_for(tmp_path, "nan", env={"id": "test_embodied_flow:NaNObs-v0", "num_envs": 2}, run={"seed": 0})
    with pytest.raises(WorkerError, match=r"env rank 0: rollout\(\) raised ValueError: test_embodied_flow:NaNObs-v0: "
                                          r"non-finite observation from env 1 at step \(env step 5"):
        train(nan, cluster)
