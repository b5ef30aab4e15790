"""Raw simulator limit of this machine: env steps/s with random actions (pre-sampled, so sampling is not timed).

Rows per env id: one bare gymnasium env, a plain `SyncVectorEnv` of N envs (SAME_STEP autoreset: the simulator limit
an embodied flow is measured against), and m2flow's `EnvGroup` on the same N envs, without and with obs/reward
normalization (the cost of its bookkeeping). No policy, no learning.

    python benchmarks/sim_limit.py             # CartPole-v1 and HalfCheetah-v5, 8 envs, best of 6 x 0.5 s per row
    python benchmarks/sim_limit.py --env-ids Hopper-v5 --num-envs 16 --seconds 1
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from m2flow.embodied.envs import EnvGroup, make_env_fns, make_vector_env


def rate(step, actions: list, seconds: float) -> float:
    """Calls of step(actions[i % len]) per second over a window of about `seconds`."""
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(20):
            step(actions[calls % len(actions)])
            calls += 1
    return calls / elapsed


def measure(env_id: str, num_envs: int, seconds: float, repeats: int, seed: int = 0) -> list[tuple[str, int, float]]:
    """-> [(runner, envs, env steps/s)]: the best of `repeats` windows per runner, the runners' windows interleaved
    (load from other processes then hits every runner alike, and only ever slows a window down)."""
    space = make_env_fns(env_id, 1, seed)[0]().action_space
    space.seed(seed)
    single = make_env_fns(env_id, 1, seed)[0]()
    single.reset(seed=seed)

    def single_step(a):
        _, _, term, trunc, _ = single.step(a)
        if term or trunc:
            single.reset()

    vec = make_vector_env(env_id, num_envs, seed)
    vec.reset(seed=seed)
    group = EnvGroup.make(env_id, num_envs, seed)
    group.reset()
    normed = EnvGroup.make(env_id, num_envs, seed, norm_obs=True, norm_reward=True)
    normed.reset()
    one = [space.sample() for _ in range(256)]
    batches = [np.stack([space.sample() for _ in range(num_envs)]) for _ in range(256)]
    runners = [("gymnasium.Env", 1, single_step, one),
               ("SyncVectorEnv (SAME_STEP)", num_envs, vec.step, batches),
               ("EnvGroup", num_envs, group.step, batches),
               ("EnvGroup + obs/reward norm", num_envs, normed.step, batches)]
    best = [0.0] * len(runners)
    for _, _, step, actions in runners:  # warm-up
        rate(step, actions, 0.05)
    for _ in range(repeats):
        for k, (_, n, step, actions) in enumerate(runners):
            best[k] = max(best[k], n * rate(step, actions, seconds))
    for env in (single, vec, group, normed):
        env.close()
    return [(name, n, b) for (name, n, _, _), b in zip(runners, best)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-ids", default="CartPole-v1,HalfCheetah-v5", help="comma-separated gymnasium ids")
    parser.add_argument("--num-envs", type=int, default=8, help="envs per vector")
    parser.add_argument("--seconds", type=float, default=0.5, help="seconds per timed window")
    parser.add_argument("--repeats", type=int, default=6, help="timed windows per row (interleaved); the best counts")
    args = parser.parse_args()

    print(f"# sim limit: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"random actions, best of {args.repeats} x {args.seconds:g} s per row")
    print(f"| {'env':<16} | {'runner':<27} | {'envs':>4} | {'env steps/s':>11} | {'us/env step':>11} |")
    print(f"|{'-' * 18}|{'-' * 29}|{'-' * 6}|{'-' * 13}|{'-' * 13}|")
    for env_id in args.env_ids.split(","):
        for runner, n, rate in measure(env_id, args.num_envs, args.seconds, args.repeats):
            print(f"| {env_id:<16} | {runner:<27} | {n:>4} | {rate:>11,.0f} | {1e6 / rate:>11.1f} |", flush=True)


if __name__ == "__main__":
    main()
