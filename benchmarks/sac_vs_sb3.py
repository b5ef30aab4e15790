"""m2flow SAC vs Stable-Baselines3 SAC with the same hyperparameters (configs/sac_halfcheetah.yaml given to SB3 one
for one), interleaved: for each seed SB3, then m2flow in each plan, each run in its own process. Per run: the wall
time (the runner's process from its start to the evaluated result: imports, set-up, training and the final
evaluation, alike for both), the training time alone (SB3's `learn`; m2flow's iterations), env steps/s in training,
and the mean return of 10 deterministic episodes at the end, from the same start states for both (episode k reset
with the preset's `eval.seed` + k; SB3's trained model is saved beside its JSON). Asserts nothing.

    pip install stable-baselines3                                                  # or `make bench`
    python benchmarks/sac_vs_sb3.py --steps 100000 --seeds 0,1,2                   # hours on 2 cores: background it
    python benchmarks/sac_vs_sb3.py --steps 10000 --seeds 0 --set sac.learning_starts=1000   # a short look
    python benchmarks/sac_vs_sb3.py --update-only                                  # per gradient step, 1 and 2 threads
    python benchmarks/sac_vs_sb3.py --update-only --critics twin,layernorm,rlpd    # the critics' variants, too
    python benchmarks/sac_vs_sb3.py --steps 100000 --seeds 1,2 --plans lockstep --no-sb3   # more seeds of one plan
    python benchmarks/sac_vs_sb3.py --summarize    # medians, then per seed, and the return gaps' 90% intervals
    python benchmarks/sac_vs_sb3.py --seeds 0,1,2 --plans overlapped --common-start --out runs/bench/common

Plans: `lockstep` (env, policy and learner in one process on device 0, `sac.max_policy_lag=0`: SB3's order, one
core), `wide` (the learner one process over both devices' cores, 2 threads; env and policy on device 0; lag 0),
`pipelined` (env and policy on device 0, the learner on device 1, `sac.max_policy_lag=1`, collection
overlapping the updates), `parallel` (wide, with `sac.parallel_update=true`: the critics' and the actor's gradient
steps at once, one core each), `overlapped` (parallel, with `sac.max_policy_lag=1`: the env and policy collect the
next steps on device 0 while the learner updates, the actor's side of its step in a process of its own,
`sac.actor_process=true`; until 2026-11-30 in a thread; the preset's plan since then). The plans but `parallel` and
`overlapped` take SB3's order within a gradient step (`sac.parallel_update=false`). Every plan keeps the preset's
`cluster.foreground=actor` (the run's other processes at nice 19). SB3 runs in its own process with torch's default
threads (2 here), as a user runs it. `--set` overrides the preset for both libraries (e.g.
`sac.learning_starts=1000` for a short run); `--no-sb3` runs the m2flow plans only (SB3's runs of those seeds
already on disk). The 1-minute load average is sampled during each run. `--common-start` starts SB3 where m2flow's
run of the seed starts (m2flow's initial weights and warm-up actions; the envs' start states are common anyway), so
that a seed's luck in its start is shared by both libraries and the per-seed returns compare what comes after.
`--set sac.logp_eps=1e-6` gives m2flow SB3's log-density (the preset's is the exact one): the one number in which
m2flow's SAC computes something other than SB3's (tests/e2e/test_sac_common_start.py runs the two as twins).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

START = time.perf_counter()  # a runner's wall time counts from here: its imports come after (inside the functions)
PRESET = "sac_halfcheetah"
SETTINGS: list[str] = []  # --set: overrides of the preset, for both libraries
SB3_ORDER = ["sac.parallel_update=false", "sac.actor_process=false"]  # the critics step before the actor reads them
THREADS = ["sac.parallel_update=true", "sac.actor_process=false"]  # the two sides of a step at once, in two threads
PROCESS = ["sac.parallel_update=true", "sac.actor_process=true"]  # the same, the actor's side in a process of its own
PLANS = {"lockstep": ["cluster.placement=env,rollout,actor: 0", "sac.max_policy_lag=0", *SB3_ORDER],
         "wide": ["cluster.placement=env,rollout: 0; actor: 0-1:0", "sac.max_policy_lag=0", *SB3_ORDER],
         "pipelined": ["cluster.placement=env,rollout: 0; actor: 1", "sac.max_policy_lag=1", *SB3_ORDER],
         "parallel": ["cluster.placement=env,rollout: 0; actor: 0-1:0", "sac.max_policy_lag=0", *THREADS],
         "overlapped": ["cluster.placement=env,rollout: 0; actor: 0-1:0", "sac.max_policy_lag=1", *PROCESS]}


def sb3_model(seed: int, common: bool = False):
    """SB3's SAC on the preset's hyperparameters (and --set's), its envs seeded with `seed` -> (model, m2flow's
    config). `common`: from m2flow's start (`common_start`)."""
    from stable_baselines3 import SAC
    from stable_baselines3.common.env_util import make_vec_env
    from torch import nn

    from m2flow import config as C
    from m2flow.embodied.config import EmbodiedConfig

    cfg = C.load(EmbodiedConfig, PRESET, SETTINGS)
    s, p = cfg.sac, cfg.policy
    env = make_vec_env(cfg.env.id, n_envs=cfg.env.num_envs, seed=seed)
    model = SAC("MlpPolicy", env, learning_rate=cfg.actor.lr, buffer_size=s.buffer_size,
                learning_starts=s.learning_starts, batch_size=s.batch_size, tau=s.tau, gamma=cfg.algorithm.gamma,
                train_freq=s.train_freq, gradient_steps=s.gradient_steps, ent_coef=s.ent_coef,
                target_entropy=s.target_entropy, target_update_interval=s.target_update_interval, seed=seed,
                policy_kwargs=dict(net_arch=list(p.hidden), activation_fn={"relu": nn.ReLU, "tanh": nn.Tanh}[
                    p.activation]), device="cpu")
    if common:
        common_start(model, seed)
    return model, cfg


def sb3_run(steps: int, seed: int, out: Path, common: bool = False) -> dict:
    """SB3's SAC (`sb3_model`) trained and evaluated; in this process (called through `--one sb3`)."""
    import gymnasium as gym
    import numpy as np

    model, cfg = sb3_model(seed, common)
    start = time.perf_counter()
    model.learn(total_timesteps=steps)
    training = time.perf_counter() - start
    model.save(out / f"sb3_{seed}")  # the trained SAC, for evaluating it again
    returns = sb3_evaluate(model, gym.make(cfg.env.id), cfg.eval.episodes, cfg.eval.seed)
    return {"runner": "sb3", "seed": seed, "env_steps": int(model.num_timesteps), "train_s": training,
            "env_steps_per_s": model.num_timesteps / training, "return_mean": float(np.mean(returns)),
            "return_std": float(np.std(returns)), "eval_seeded": True, "common_start": common}


def actor_pairs(policy, model) -> list:
    """m2flow's SAC actor's modules (trunk, mean head, log-std head) beside SB3's `model`'s, parameters in the same
    order."""
    return [(policy.trunk, model.actor.latent_pi), (policy.mu, model.actor.mu), (policy.log_std_head,
                                                                                model.actor.log_std)]


def common_start(model, seed: int) -> None:
    """Start SB3's `model` where m2flow's run of `seed` starts, so that a seed's luck in its start is common to both
    libraries and their per-seed returns differ by what comes after: m2flow's initial weights (its SAC learner's for
    run.seed=seed: actor, critics, targets) and m2flow's warm-up actions (the uniform actions its policy worker gives
    every env at policy time step t, until `learning_starts` env steps) instead of SB3's own draws. The envs' start
    states are common already: both libraries reset env i first with seed + i, then let it run on. After the
    warm-up each library draws its own exploration noise and minibatch rows."""
    import types

    import torch

    from m2flow import config as C
    from m2flow.embodied.config import EmbodiedConfig
    from m2flow.embodied.sac.learner import SACLearnerWorker
    from m2flow.embodied.workers.policy import noise_seed, uniform_actions

    # the learner's weights do not depend on its buffer's capacity (it is built after them): one row, not the preset's
    its = C.load(EmbodiedConfig, PRESET, [*SETTINGS, f"run.seed={seed}", "sac.buffer_size=1"])
    learner = SACLearnerWorker(its, model.observation_space, model.action_space)
    with torch.no_grad():
        for src, dst in [*actor_pairs(learner.policy, model), (learner.critic, model.critic),
                         (learner.target, model.critic_target)]:
            for a, b in zip(src.parameters(), dst.parameters(), strict=True):
                if a.shape != b.shape:
                    raise ValueError(f"common start: m2flow's {tuple(a.shape)} weight against SB3's {tuple(b.shape)}")
                b.copy_(a)
    own = model._sample_action

    def sample_action(self, learning_starts: int, action_noise=None, n_envs: int = 1):
        if self.num_timesteps >= learning_starts:
            return own(learning_starts, action_noise, n_envs)
        t = self.num_timesteps // n_envs  # m2flow's policy time step, as PolicyWorker.act's warm-up draws it
        actions = uniform_actions(self.action_space, noise_seed(seed + 1, t), 0, n_envs, n_envs)
        return actions, self.policy.scale_action(actions)  # (the env's, m2flow's to the bit; the buffer's in [-1, 1])

    model._sample_action = types.MethodType(sample_action, model)


def sb3_evaluate(model, env, episodes: int, seed: int) -> list[float]:
    """The returns of `episodes` deterministic episodes, episode k reset with seed + k: the start states m2flow's
    evaluation (`eval.seed`) gives its own policy."""
    returns = []
    for k in range(episodes):
        obs, _ = env.reset(seed=seed + k)
        total, done = 0.0, False
        while not done:
            action, _ = model.predict(obs, deterministic=True)
            obs, reward, terminated, truncated, _ = env.step(action)
            total, done = total + float(reward), terminated or truncated
        returns.append(total)
    return returns


def m2flow_run(steps: int, seed: int, plan: str, out: Path) -> dict:
    """The preset through the `m2flow` command in `plan`: run.steps from the env steps asked."""
    from m2flow import config as C
    from m2flow.embodied.config import EmbodiedConfig

    cfg = C.load(EmbodiedConfig, PRESET, SETTINGS)
    per_iteration = cfg.env.num_envs * cfg.sac.train_freq
    name = f"m2flow_{plan}_{seed}"
    cmd = [str(Path(sys.executable).with_name("m2flow")), "train", PRESET, f"run.steps={-(-steps // per_iteration)}",
           f"run.seed={seed}", f"run.dir={out}", f"run.name={name}", "run.overwrite=true", "run.save_every=0",
           "run.progress=false", "run.trace=false", *SETTINGS, *PLANS[plan]]
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
    evaluation = json.loads((out / name / "eval.json").read_text())
    training = sum(r["time/iteration"] for r in rows)
    return {"runner": f"m2flow {plan}", "seed": seed, "env_steps": rows[-1]["env_steps"], "train_s": training,
            "env_steps_per_s": rows[-1]["env_steps"] / training,
            "return_mean": evaluation["return_mean"], "return_std": evaluation["return_std"]}


CRITICS = {"twin": [], "layernorm": ["sac.critic_layernorm=true"],  # --update-only --critics: m2flow's variants
           "rlpd": ["sac.critic_layernorm=true", "sac.n_critics=10", "sac.min_qs=2", "sac.actor_q=mean"]}


def update_only(threads: int, rounds: int = 5, n: int = 64, critics: tuple[str, ...] = ("twin",)) -> str:
    """Per gradient step on the same kind of data (20k random transitions in each library's buffer): m2flow's
    `SACLearnerWorker.update` (each of `critics`' variants, with sac.grad=auto and =autograd; twin also with
    sac.parallel_update, its actor's side in a thread and in a process) against SB3's `SAC.train`, interleaved,
    `rounds` rounds of `n` steps, medians."""
    import gymnasium as gym
    import numpy as np
    import torch
    from stable_baselines3 import SAC
    from stable_baselines3.common.logger import configure
    from torch import nn

    from m2flow import config as C
    from m2flow.embodied.config import EmbodiedConfig
    from m2flow.embodied.sac.learner import SACLearnerWorker

    torch.set_num_threads(threads)
    cfg = C.load(EmbodiedConfig, PRESET, ["sac.buffer_size=100000", *SETTINGS])
    env = gym.make(cfg.env.id)
    obs, act, size = env.observation_space.shape, env.action_space.shape, 20_000
    data = {"obs": torch.randn(size, *obs), "actions": torch.rand(size, *act) * 2 - 1, "rewards": torch.randn(size),
            "next_obs": torch.randn(size, *obs), "terminated": torch.zeros(size, dtype=torch.bool)}
    learners = {}
    variants = []
    for c in critics:  # sac.grad=auto is manual for these networks; autograd beside each
        name = f"m2flow {c}" if c != "twin" else "m2flow"
        variants += [(name, [*SB3_ORDER, *CRITICS[c]]),
                     (f"{name} autograd", [*SB3_ORDER, *CRITICS[c], "sac.grad=autograd"])]
    if "twin" in critics:
        variants += [("m2flow parallel", THREADS),
                     ("m2flow parallel process", PROCESS),
                     ("m2flow parallel autograd", [*THREADS, "sac.grad=autograd"])]
    for name, extra in variants:
        if "parallel" in name and threads < 2:
            continue  # two threads of one core each: nothing to run them on
        its = C.load(EmbodiedConfig, PRESET, ["sac.buffer_size=100000", *SETTINGS, *extra])
        learners[name] = SACLearnerWorker(its, env.observation_space, env.action_space)
        learners[name].buffer.add(data)
        learners[name].env_steps = size  # past learning_starts
    sb3 = SAC("MlpPolicy", env, buffer_size=100_000, learning_starts=0, batch_size=cfg.sac.batch_size,
              learning_rate=cfg.actor.lr, policy_kwargs=dict(net_arch=list(cfg.policy.hidden), activation_fn=nn.ReLU),
              device="cpu")
    sb3.set_logger(configure(None, [""]))
    for _ in range(size):
        sb3.replay_buffer.add(np.random.randn(1, *obs), np.random.randn(1, *obs), np.random.rand(1, *act) * 2 - 1,
                              np.random.randn(1), np.zeros(1), [{}])
    runs = {name: (lambda learner=learner: learner._updates(0, n)) for name, learner in learners.items()}
    runs["sb3"] = lambda: sb3.train(gradient_steps=n, batch_size=cfg.sac.batch_size)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds + 1):  # the first round warms up
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            if r:
                times[name].append((time.perf_counter() - start) / n * 1000)
    ms = {name: statistics.median(t) for name, t in times.items()}
    return (f"{threads} thread(s), load {os.getloadavg()[0]:.2f}, ms per gradient step: "
            + ", ".join(f"{name} {t:.2f} (SB3 / it {ms['sb3'] / t:.2f})" for name, t in ms.items() if name != "sb3")
            + f", SB3 {ms['sb3']:.2f}")


def one(args) -> None:
    """Run one runner in this process and write its JSON (the parent times nothing of it but the load). Its wall
    time is this process's, from the script's start to the evaluated result: the imports, the set-up (m2flow: Ray
    and the workers), the training and the 10-episode evaluation, alike for both libraries."""
    out = Path(args.out)
    result = (sb3_run(args.steps, args.seed, out, args.common_start) if args.one == "sb3"
              else m2flow_run(args.steps, args.seed, args.one, out))
    result["wall_s"] = time.perf_counter() - START
    result["cpus"] = len(os.sched_getaffinity(0))  # fewer than the machine's: pinned (taskset); see `alike`
    result["omp_threads"] = os.environ.get("OMP_NUM_THREADS")
    (out / f"{args.one}_{args.seed}.json").write_text(json.dumps(result, indent=1) + "\n")


def alike(a: dict, b: dict) -> bool:
    """Whether runs `a` and `b` had the machine alike (the same cores, the same OMP_NUM_THREADS), so that their wall
    times stand beside each other: not so for an SB3 run pinned to one core with one thread beside an m2flow run on
    the whole machine. JSON written before this was recorded had the whole machine."""
    def setting(r):
        return r.get("cpus", os.cpu_count()), r.get("omp_threads")
    return setting(a) == setting(b)


def whole_machine(r: dict) -> bool:
    """Whether run `r` had every core and OMP_NUM_THREADS unset (torch's default threads)."""
    return alike(r, {})


def table(results: list[dict]) -> str:
    """The runners' medians over their seeds. A time's ratio to SB3's is the median of the per-seed ratios (the
    issue's target reads the wall time's: at most 0.67), over the seeds SB3 also ran."""
    sb3 = {r["seed"]: r for r in results if r["runner"] == "sb3"}

    def median(values, digits=0):  # "-" where no run has the figure (JSON written before train_s was)
        values = list(values)
        return f"{statistics.median(values):.{digits}f}" if values else "-"

    def ratio(rs, key):
        return median((r[key] / sb3[r["seed"]][key] for r in rs
                       if key in r and key in sb3.get(r["seed"], {}) and alike(r, sb3[r["seed"]])), 2)

    lines = ["| runner | seeds | env steps | wall s (median) | wall / SB3's (median) | train s (median) "
             "| train / SB3's (median) | env steps/s in training (median) | return (median of seeds) | load |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for runner in dict.fromkeys(r["runner"] for r in results):
        rs = [r for r in results if r["runner"] == runner]
        lines.append(f"| {runner} | {', '.join(str(r['seed']) for r in rs)} | {rs[0]['env_steps']:,} | "
                     f"{median(r['wall_s'] for r in rs)} | {ratio(rs, 'wall_s')} | "
                     f"{median(r['train_s'] for r in rs if 'train_s' in r)} | {ratio(rs, 'train_s')} | "
                     f"{median(r['env_steps_per_s'] for r in rs)} | {median(r['return_mean'] for r in rs)} | "
                     f"{', '.join(r.get('load', '?') for r in rs)} |")
    return "\n".join(lines)


def by_seed(results: list[dict]) -> str:
    """Per seed: each runner's return and wall time (an m2flow plan's also as a ratio to SB3's on that seed), then
    on how many of the seeds both ran each plan's return is at least SB3's, and both returns' median and mean over
    those seeds."""
    runners = sorted(dict.fromkeys(r["runner"] for r in results), key=lambda n: n != "sb3")  # SB3 first
    runs = {(r["runner"], r["seed"]): r for r in results}
    seeds = sorted({r["seed"] for r in results})

    def cell(runner, seed):
        r, sb3 = runs.get((runner, seed)), runs.get(("sb3", seed))
        if r is None:
            return "- | -"
        ratio = (f" ({r['wall_s'] / sb3['wall_s']:.2f}x)" if sb3 and runner != "sb3" and "wall_s" in sb3
                 and alike(r, sb3) else "")
        pinned = "" if whole_machine(r) else f" ({r['cpus']} core(s), OMP_NUM_THREADS={r['omp_threads']})"
        return f"{r['return_mean']:.0f} | {r['wall_s']:.0f}{ratio}{pinned}"

    lines = ["| seed | " + " | ".join(f"{n} return | {n} wall s" for n in runners) + " |",
             "| --- |" + " --- | --- |" * len(runners)]
    lines += [f"| {seed} | " + " | ".join(cell(n, seed) for n in runners) + " |" for seed in seeds]
    lines.append("")
    common = [s for s in seeds if runs.get(("sb3", s), {}).get("common_start")]
    if common:
        lines.append(f"SB3 started from m2flow's initial weights and warm-up actions (--common-start) on seeds "
                     f"{', '.join(map(str, common))}")
    for n in runners[1:] if "sb3" in runners else []:
        paired = [s for s in seeds if (n, s) in runs and ("sb3", s) in runs]
        if not paired:
            continue
        mine, sb3 = ([runs[(who, s)]["return_mean"] for s in paired] for who in (n, "sb3"))
        ahead = sum(a >= b for a, b in zip(mine, sb3))
        lines.append(f"{n}: return at least SB3's on {ahead} of the {len(paired)} seeds both ran; over them, median "
                     f"{statistics.median(mine):.0f} against {statistics.median(sb3):.0f}, mean "
                     f"{statistics.mean(mine):.0f} against {statistics.mean(sb3):.0f}")
        if len(paired) > 2:
            lines.append(f"{n} - SB3, 90% bootstrap intervals over the seeds: "
                         + "; ".join("the {} {:+.0f} [{:+.0f}, {:+.0f}]".format(name, *gap(mine, sb3, stat))
                                     for name, stat in [("median", statistics.median), ("mean", statistics.mean)]))
    return "\n".join(lines)


def gap(mine: list[float], theirs: list[float], stat, draws: int = 10_000, level: float = 0.9) -> tuple:
    """stat(mine) - stat(theirs), and its `level` percentile-bootstrap interval: each side's seeds resampled on their
    own, with replacement (a seed's runs in the two libraries start from different draws, so the seeds do not pair)
    -> (gap, low, high)."""
    import random

    rng = random.Random(0)
    gaps = sorted(stat(rng.choices(mine, k=len(mine))) - stat(rng.choices(theirs, k=len(theirs)))
                  for _ in range(draws))
    tail = int(draws * (1 - level) / 2)
    return stat(mine) - stat(theirs), gaps[tail], gaps[draws - 1 - tail]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100_000, help="env steps per run")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--plans", default="lockstep,overlapped", help=f"m2flow plans: {', '.join(PLANS)}")
    p.add_argument("--no-sb3", action="store_true", help="run the m2flow plans only, not SB3 before them")
    p.add_argument("--out", default="runs/bench/sac_vs_sb3")
    p.add_argument("--set", default="", help="overrides of the preset for both libraries, space-separated")
    p.add_argument("--summarize", action="store_true", help="print the medians and the per-seed table under --out")
    p.add_argument("--update-only", action="store_true", help="per gradient step, m2flow against SB3, interleaved")
    p.add_argument("--critics", default="twin", help=f"with --update-only: m2flow's critics, of {', '.join(CRITICS)}")
    p.add_argument("--common-start", action="store_true",
                   help="SB3 starts from m2flow's initial weights and warm-up actions of each seed (use its own --out)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    SETTINGS.extend(shlex.split(args.set))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        return one(args)
    if args.update_only:
        if set(args.critics.split(",")) - set(CRITICS):
            p.error(f"--critics takes a comma-separated list of {', '.join(CRITICS)}, got '{args.critics}'")
        for threads in (1, 2):
            print(update_only(threads, critics=tuple(args.critics.split(","))), flush=True)
        return
    if not args.summarize:
        for seed in (int(s) for s in args.seeds.split(",")):
            for runner in [*([] if args.no_sb3 else ["sb3"]), *args.plans.split(",")]:
                loads, start = [], time.time()
                proc = subprocess.Popen([sys.executable, __file__, "--one", runner, "--seed", str(seed),
                                         "--steps", str(args.steps), "--out", str(out), "--set", args.set,
                                         *(["--common-start"] if args.common_start else [])])
                while proc.poll() is None:
                    loads.append(os.getloadavg()[0])
                    time.sleep(min(10.0, 1.0 + (time.time() - start) / 10))
                if proc.returncode:
                    sys.exit(f"{runner} seed {seed} exited {proc.returncode}")
                path = out / f"{runner}_{seed}.json"
                result = json.loads(path.read_text())
                result["load"] = f"{min(loads or [0]):.1f}-{max(loads or [0]):.1f}"
                path.write_text(json.dumps(result, indent=1) + "\n")
                print(json.dumps(result), flush=True)
    results = [json.loads(f.read_text()) for f in sorted(out.glob("*_*.json"))]
    print(table(results))
    print(by_seed(results))


if __name__ == "__main__":
    main()
