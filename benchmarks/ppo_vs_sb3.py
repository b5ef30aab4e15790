"""m2flow PPO vs Stable-Baselines3 PPO with identical hyperparameters, on this machine, in one run: env steps/s
during training, the ratio, wall time (and env steps) to a return threshold, and the return at the end. The raw
simulator limit (a plain SyncVectorEnv with random actions) is printed beside them. Asserts nothing.

Hyperparameters are the m2flow presets, given to SB3 one for one: configs/ppo_cartpole.yaml (rl-zoo's CartPole-v1
PPO; `--cartpole sb3` uses SB3's PPO defaults on 8 envs instead) and configs/ppo_halfcheetah.yaml (rl-zoo's
HalfCheetah PPO on 8 envs, VecNormalize). Both run on one core each: m2flow's env, policy and actor share device 0
(`--placement` for another plan), SB3 in this process with torch.set_num_threads(1). The return threshold is the
mean raw return of the last 20 training episodes (CartPole 475: both stop there; HalfCheetah 1400: both go on to
the full budget, 1M env steps by default, up to an hour each on 2 cores: run it in the background).

Before the full runs, two load-robust comparisons (other processes' load drifts over an hour-long run): one PPO
epoch of each library's update on the same data (interleaved, best of 5), and env steps/s during training over
`--iters` iterations, m2flow and SB3 alternating for `--rounds` rounds, best round each.

    python benchmarks/ppo_vs_sb3.py --env-ids CartPole-v1
    python benchmarks/ppo_vs_sb3.py --env-ids HalfCheetah-v5 --update-only     # the two quick comparisons
    nohup python benchmarks/ppo_vs_sb3.py --env-ids HalfCheetah-v5 > runs/bench/ppo_vs_sb3_halfcheetah.log 2>&1 &
    # several seeds, runners side by side (each full run saves runs/bench/full_*.json), then the table:
    python benchmarks/ppo_vs_sb3.py --env-ids HalfCheetah-v5 --rounds 0 --seed 1 --runners sb3
    python benchmarks/ppo_vs_sb3.py --summarize
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from m2flow import config as C  # noqa: E402
from m2flow.embodied.config import EmbodiedConfig  # noqa: E402

PRESETS = {"CartPole-v1": ("ppo_cartpole", 475.0), "HalfCheetah-v5": ("ppo_halfcheetah", 1400.0)}
WINDOW = 20

SB3_DEFAULTS = ["rollout.steps=256", "actor.minibatch_size=64", "actor.epochs=10", "actor.lr=3e-4",
                "actor.anneal_lr=false", "algorithm.gamma=0.99", "algorithm.lam=0.95", "algorithm.anneal_clip=false"]


def sb3_kwargs(cfg) -> dict:
    """The SB3 PPO arguments equal to an m2flow EmbodiedConfig (linear schedules where it anneals)."""
    from torch import nn

    a, alg, p = cfg.actor, cfg.algorithm, cfg.policy
    lr = (lambda f: a.lr * f) if a.anneal_lr else a.lr
    clip = (lambda f: alg.clip * f) if alg.anneal_clip else alg.clip
    act = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU, "elu": nn.ELU}[p.activation]
    return dict(n_steps=cfg.rollout.steps, batch_size=a.minibatch_size, n_epochs=a.epochs, learning_rate=lr,
                gamma=alg.gamma, gae_lambda=alg.lam, clip_range=clip, clip_range_vf=alg.clip_vf, ent_coef=alg.ent_coef,
                vf_coef=alg.vf_coef, max_grad_norm=a.grad_clip, normalize_advantage=alg.norm_adv,
                target_kl=alg.target_kl,
                policy_kwargs=dict(net_arch=dict(pi=list(p.hidden), vf=list(p.hidden)), activation_fn=act,
                                   log_std_init=p.log_std_init, ortho_init=p.ortho_init,
                                   optimizer_kwargs=dict(eps=a.adam_eps)))


def run_sb3(cfg, threshold: float, stop: bool, threads: int) -> dict:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    torch.set_num_threads(threads)
    e = cfg.env
    env_kwargs = dict(e.kwargs, **({"max_episode_steps": e.max_episode_steps} if e.max_episode_steps else {}))
    venv = make_vec_env(e.id, n_envs=e.num_envs, seed=cfg.run.seed, env_kwargs=env_kwargs)  # Monitor: raw returns
    if e.norm_obs or e.norm_reward:
        venv = VecNormalize(venv, norm_obs=e.norm_obs, norm_reward=e.norm_reward, clip_obs=e.clip_obs,
                            clip_reward=e.clip_reward, gamma=cfg.algorithm.gamma)

    class Threshold(BaseCallback):
        def __init__(self):
            super().__init__()
            self.recent, self.hit, self.start = deque(maxlen=WINDOW), None, time.perf_counter()
            self.rollouts, self.warm = 0, None  # (time, env steps) when the second rollout starts

        def _on_rollout_start(self) -> None:
            self.rollouts += 1
            if self.rollouts == 2:
                self.warm = (time.perf_counter(), self.num_timesteps)

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    self.recent.append(info["episode"]["r"])
            if self.hit is None and len(self.recent) == WINDOW and np.mean(self.recent) >= threshold:
                self.hit = (time.perf_counter() - self.start, self.num_timesteps)
                return not stop
            return True

    total = cfg.run.steps * cfg.rollout.steps * e.num_envs
    model = PPO("MlpPolicy", venv, seed=cfg.run.seed, device="cpu", verbose=0, **sb3_kwargs(cfg))
    cb = Threshold()
    start = time.perf_counter()
    model.learn(total_timesteps=total, callback=cb)
    wall = time.perf_counter() - start
    end = time.perf_counter()
    warm = (model.num_timesteps - cb.warm[1]) / (end - cb.warm[0]) if cb.warm else float("nan")
    return {"steps": model.num_timesteps, "seconds": wall, "hit": cb.hit, "warm_steps_per_s": warm,
            "final_return": float(np.mean(cb.recent)) if cb.recent else float("nan")}


def run_m2flow(cfg, cluster, threshold: float) -> dict:
    from m2flow.embodied.flow import train

    start = time.perf_counter()
    result = train(cfg, cluster)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in open(Path(result["run_dir"]) / "metrics.jsonl")]
    elapsed, hit = 0.0, None
    for r in rows:
        elapsed += r["time/iteration"]
        if hit is None and r.get("rollout/return_window", float("-inf")) >= threshold:
            hit = (elapsed, r["env_steps"])
    warm = (rows[-1]["env_steps"] - rows[0]["env_steps"]) / sum(r["time/iteration"] for r in rows[1:]) \
        if len(rows) > 1 else float("nan")
    return {"steps": rows[-1]["env_steps"], "seconds": elapsed, "wall_with_startup": wall, "hit": hit,
            "warm_steps_per_s": warm, "final_return": rows[-1]["rollout/return_window"]}


HYBRID = ["cluster.placement=env: 0; rollout: 1; actor: 0-1:0", "env.pipeline_stages=2"]  # ppo_halfcheetah_hybrid


def throughput(cfg, cluster, iters: int, rounds: int) -> dict[str, float]:
    """Env steps/s during training over `iters` iterations: m2flow as configured, m2flow hybrid (envs on device 0,
    policy on 1, 2 stages, the actor one process over both devices' cores) and SB3 on one and on two threads,
    alternating for `rounds` rounds, best round each: robust to load from other processes drifting over a long run.
    Worker start-up is not counted, nor the first iteration of either (a warm-up: m2flow's compiles its loss
    there)."""
    best = {"m2flow": 0.0, "m2flow hybrid": 0.0, "SB3 1 thread": 0.0, "SB3 2 threads": 0.0}
    for r in range(rounds):
        base = [f"run.steps={iters}", "run.stop_return=null", "run.trace=false", "eval.episodes=0", "run.overwrite=true"]
        for name, extra in (("m2flow", []), ("m2flow hybrid", HYBRID)):
            tag = "_hybrid" if extra else ""
            c = C.load(EmbodiedConfig, C.to_dict(cfg), base + extra + [f"run.name={cfg.run.name}{tag}_tp{r}"])
            out = run_m2flow(c, cluster, float("inf"))
            best[name] = max(best[name], out["warm_steps_per_s"])
        for threads in (1, 2):
            out = run_sb3(C.load(EmbodiedConfig, C.to_dict(cfg), base), float("inf"), False, threads)
            key = f"SB3 {threads} thread{'s' if threads > 1 else ''}"
            best[key] = max(best[key], out["warm_steps_per_s"])
    return best


def update_cost(cfg, repeats: int = 5) -> tuple[float, float]:
    """Seconds per PPO epoch over one rollout's worth of random data (rollout.steps x num_envs samples, the preset's
    minibatches), m2flow's update vs SB3's train(), same process, one thread, interleaved, best of `repeats`: the
    update alone, free of rollout and worker overheads."""
    from gymnasium import spaces
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.logger import configure

    from m2flow.embodied.envs import Trajectory
    from m2flow.embodied.workers.actor import EmbodiedActorWorker, advantages, ppo_update

    torch.set_num_threads(1)
    T, N = cfg.rollout.steps, cfg.env.num_envs
    venv = make_vec_env(cfg.env.id, n_envs=N, seed=0)
    obs_space, act_space = venv.observation_space, venv.action_space
    cfg1 = C.load(EmbodiedConfig, C.to_dict(cfg), ["actor.epochs=1"])
    actor = EmbodiedActorWorker(cfg1, obs_space, act_space)
    box = isinstance(act_space, spaces.Box)
    act_shape = act_space.shape if box else ()
    actions = torch.randn(T, N, *act_shape) if box else torch.randint(0, int(act_space.n), (T, N))
    traj = Trajectory(obs=torch.randn(T, N, *obs_space.shape), actions=actions, logprobs=torch.randn(T, N) - 3,
                      values=torch.randn(T, N), rewards=torch.randn(T, N),
                      terminated=torch.zeros(T, N, dtype=torch.bool), truncated=torch.zeros(T, N, dtype=torch.bool),
                      final_values=torch.zeros(T, N), next_obs=torch.randn(N, *obs_space.shape),
                      next_values=torch.zeros(N))
    adv, ret, mask = advantages(traj, cfg1)
    model = PPO("MlpPolicy", venv, device="cpu", verbose=0, **dict(sb3_kwargs(cfg1), n_epochs=1))
    model.set_logger(configure(None, [""]))
    model._setup_learn(T * N)
    buf = model.rollout_buffer
    buf.reset()
    for t in range(T):
        buf.add(traj.obs[t].numpy(), traj.actions[t].numpy(), traj.rewards[t].numpy(), np.zeros(N, bool),
                traj.values[t], traj.logprobs[t])
    buf.compute_returns_and_advantage(torch.zeros(N), np.zeros(N))
    ours, theirs = [], []
    ppo_update(actor.policy, actor.optimizer, traj, adv, ret, mask, cfg1, 1.0, actor.gen, loss_fn=actor.loss_fn)
    for _ in range(repeats):  # after a warm-up epoch (it compiles the loss where actor.compile)
        start = time.perf_counter()
        ppo_update(actor.policy, actor.optimizer, traj, adv, ret, mask, cfg1, 1.0, actor.gen, loss_fn=actor.loss_fn)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        model.train()
        theirs.append(time.perf_counter() - start)
    return min(ours), min(theirs)


def sim_limit(env_id: str, num_envs: int) -> float:
    from sim_limit import measure

    rows = measure(env_id, num_envs, seconds=0.5, repeats=3)
    return next(rate for name, _, rate in rows if name.startswith("SyncVectorEnv"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env-ids", nargs="+", default=["CartPole-v1", "HalfCheetah-v5"])
    p.add_argument("--cartpole", choices=["zoo", "sb3"], default="zoo", help="CartPole hyperparameters: the preset "
                   "(rl-zoo) or SB3's PPO defaults on 8 envs")
    p.add_argument("--total-steps", type=int, default=None, help="env step budget (default: the preset's)")
    p.add_argument("--placement", default=None, help="m2flow placement (default: the preset's)")
    p.add_argument("--stages", type=int, default=None, help="m2flow env.pipeline_stages (default: the preset's)")
    p.add_argument("--sb3-threads", type=int, default=1)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--update-only", action="store_true", help="skip the full runs (update cost and throughput only)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved throughput rounds (0: none)")
    p.add_argument("--iters", type=int, default=6, help="iterations per throughput round")
    p.add_argument("--seed", type=int, default=None, help="run.seed for both runners (default: the preset's)")
    p.add_argument("--runners", nargs="+", choices=["m2flow", "sb3"], default=["m2flow", "sb3"],
                   help="full runs to do (one per process lets seeds and runners go side by side)")
    p.add_argument("--summarize", action="store_true", help="only print the table of the full runs saved in --out")
    args = p.parse_args()
    if args.summarize:
        return summarize(Path(args.out))

    from m2flow.runtime import Cluster

    cluster = Cluster(cpu_devices=2)
    for env_id in args.env_ids:
        preset, threshold = PRESETS[env_id]
        tag = "" if args.seed is None else f"_seed{args.seed}"
        over = [f"run.dir={args.out}", f"run.name=vs_sb3_{env_id}{tag}", "run.overwrite=true", "run.progress=false",
                "eval.episodes=0",
                "run.save_every=0", "run.stop_return=null"] + ([] if args.seed is None else [f"run.seed={args.seed}"])
        if env_id == "CartPole-v1" and args.cartpole == "sb3":
            over += SB3_DEFAULTS + ["run.steps=49"]  # 49 x 8 x 256 = 100k env steps
        cfg = C.load(EmbodiedConfig, preset, over)
        if args.total_steps:
            cfg.run.steps = -(-args.total_steps // (cfg.rollout.steps * cfg.env.num_envs))
        if args.placement:
            cfg.cluster.placement = args.placement
        if args.stages:
            cfg.env.pipeline_stages = args.stages
        stop = env_id == "CartPole-v1"
        if stop:
            cfg.run.stop_return, cfg.run.stop_window = threshold, WINDOW
        budget = cfg.run.steps * cfg.rollout.steps * cfg.env.num_envs
        print(f"== {env_id}: {budget:,} env steps budget, {cfg.env.num_envs} envs x {cfg.rollout.steps} steps, "
              f"threshold {threshold} (mean of last {WINDOW} episodes){', stop there' if stop else ''}; "
              f"m2flow placement '{cfg.cluster.placement}', {cfg.env.pipeline_stages} stage(s); "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        limit = sim_limit(env_id, cfg.env.num_envs)
        upd_ours, upd_sb3 = update_cost(cfg)
        print(f"   one PPO epoch ({cfg.rollout.steps * cfg.env.num_envs} samples, minibatches of "
              f"{cfg.actor.minibatch_size}), best of 5, one thread: m2flow {upd_ours:.3f} s, SB3 {upd_sb3:.3f} s "
              f"({upd_sb3 / upd_ours:.2f}x)", flush=True)
        if args.rounds:
            tp = throughput(cfg, cluster, args.iters, args.rounds)
            sb3 = max(tp["SB3 1 thread"], tp["SB3 2 threads"])
            print(f"   env steps/s during training, {args.iters} iterations, best of {args.rounds} interleaved rounds: "
                  + ", ".join(f"{k} {v:,.0f} ({v / sb3:.2f}x)" for k, v in tp.items())
                  + " (ratios against SB3's faster setting)", flush=True)
        if args.update_only:
            continue
        for runner in args.runners:
            out = run_m2flow(cfg, cluster, threshold) if runner == "m2flow" else \
                run_sb3(cfg, threshold, stop, args.sb3_threads)
            out.update(env_id=env_id, runner=runner, seed=cfg.run.seed, limit=limit,
                       load=os.getloadavg()[0])
            print(f"   {runner} done: {out}", flush=True)
            Path(args.out, f"full_{env_id}_{runner}_seed{cfg.run.seed}.json").write_text(json.dumps(out))
    cluster.shutdown()
    if not args.update_only:
        summarize(Path(args.out))


def summarize(out: Path) -> None:
    """The table of every full run saved under `out` (one row per env, runner and seed; a mean row per runner)."""
    runs = sorted((json.loads(p.read_text()) for p in out.glob("full_*.json")),
                  key=lambda r: (r["env_id"], r["runner"] != "m2flow", r["seed"]))
    print("\n| env | runner | seed | env steps | train s | env steps/s | time to threshold | steps to threshold | "
          "final return |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for env_id in sorted({r["env_id"] for r in runs}):
        for runner in ("m2flow", "sb3"):
            mine = [r for r in runs if r["env_id"] == env_id and r["runner"] == runner]
            for r in mine:
                hit_s = f"{r['hit'][0]:.0f} s" if r["hit"] else "not reached"
                hit_n = f"{r['hit'][1]:,}" if r["hit"] else "-"
                print(f"| {env_id} | {runner} | {r['seed']} | {r['steps']:,} | {r['seconds']:.0f} | "
                      f"{r['steps'] / r['seconds']:,.0f} | {hit_s} | {hit_n} | {r['final_return']:.1f} |")
            if len(mine) > 1:
                returns = [r["final_return"] for r in mine]
                print(f"| {env_id} | {runner} | mean of {len(mine)} | | | | | | {np.mean(returns):.1f} "
                      f"(min {min(returns):.1f}) |")
        limit = next(r["limit"] for r in runs if r["env_id"] == env_id)
        print(f"| {env_id} | simulator limit (SyncVectorEnv, random actions) | | | | {limit:,.0f} | | | |")
    print(f"\nthreshold: CartPole 475, HalfCheetah 1400 (mean raw return of the last {WINDOW} training episodes); "
          "train s excludes m2flow's worker start-up and SB3's model construction; runs side by side share the "
          f"cores, so their env steps/s is not the throughput comparison (that is the interleaved one). "
          f"{os.cpu_count()} cores.")


if __name__ == "__main__":
    main()
