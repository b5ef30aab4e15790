"""Profiler for the embodied flow (`m2flow profile CONFIG` with `flow: embodied`): times the real env and policy
workers in lockstep at a few env counts, on one device and on two, and the real actor update on a whole iteration's
trajectories, and writes the profile table the planner reads (docs/planner.md). It measures; it does not plan.

In lockstep the env worker waits while the policy infers, so each is timed alone: the env row is the rollout's time
less its waits for actions (stepping, bookkeeping, the trajectory put), the rollout row is the policy's own compute
for those requests. The rest of each wait is the hand-overs' round trip, `loop_latency`: measured with env and policy
on one device (`shared`) and, in one more lockstep rollout, on two (`split`); a pipeline hides the second, not the
first. One more rollout with the policy in the env's process, as the flow runs one stage on shared devices, gives
`cohosted_scale`: its time as a share of the env and rollout rows; and one with two env workers on one device,
half of the envs each, `two_ranks_scale`: the factor on the env row that explains its time (below 1 where a worker
waits on something other than its core, a renderer's latency, say: the planner then considers two env workers per
device).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from m2flow.embodied.config import EmbodiedClusterConfig
from m2flow.runtime import Channel, Cluster, parse_placement, running
from m2flow.runtime.probe import Probe
from m2flow.planner.profile import (
    ComponentInfo,
    LoopLatency,
    Machine,
    Profile,
    Transfer,
    Weights,
    median_rows,
)
from m2flow.embodied.sac.learner import SACLearnerWorker
from m2flow.embodied.workers.actor import EmbodiedActorWorker
from m2flow.embodied.workers.env import EnvWorker
from m2flow.embodied.workers.policy import PolicyWorker
from m2flow.runtime.sync import sync_weights
from m2flow.run_dir import progress

COMPONENTS = EmbodiedClusterConfig.COMPONENTS  # env, rollout, actor
STAGES = (1, 2, 4)  # env pipeline stages the planner considers: rows at num_envs / S envs


class EnvProbe(Probe, EnvWorker):
    def resize(self, num_envs: int) -> None:
        """Rebuild with `num_envs` envs in total (this rank's share: num_envs / ranks), in lockstep; left as it is
        where it already has them (a ManiSkill3 env with cameras takes a good part of a second to build)."""
        base = self.__dict__.setdefault("base_cfg", self.cfg)
        groups = base.env.seed_groups if num_envs == base.env.num_envs else 1
        env = dataclasses.replace(base.env, num_envs=num_envs, pipeline_stages=1, seed_groups=groups)
        if env == self.cfg.env:
            return
        self.group.close()
        EnvWorker.__init__(self, dataclasses.replace(base, env=env))


class _PolicyProbe(Probe):
    def model_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.policy.state_dict().values())


class PolicyProbe(_PolicyProbe, PolicyWorker):
    pass


class EmbodiedActorProbe(_PolicyProbe, EmbodiedActorWorker):
    pass


class SACLearnerProbe(_PolicyProbe, SACLearnerWorker):
    def state_bytes(self) -> int:
        """The networks, their optimizers' state and the replay buffers (preallocated: full size from the start)."""
        tensors = [*self.policy.parameters(), *self.critic.parameters(), *self.target.parameters()]
        tensors += [v for opt in (self.actor_opt, self.critic_opt) for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
        buffers = self.buffer.nbytes + (self.demos.nbytes if self.demos is not None else 0)
        return sum(t.numel() * t.element_size() for t in tensors) + buffers


def default_batches(num_envs: int) -> list[int]:
    """Envs per profiled rollout: num_envs / S for the env pipeline stages S the planner considers."""
    return sorted({num_envs // s for s in STAGES if num_envs % s == 0})


def profile_embodied(cfg, cluster: Cluster, batches: list[int] | None = None, out_path: str | Path | None = None,
                     repeats: int = 3, devices: tuple[int, ...] | None = None,
                     run_dir: str | Path | None = None, steps: int | None = None) -> Profile:
    """Profile the embodied flow of `cfg` on `cluster`; write the table to `out_path` (default
    `run_dir/profile.json`) and the raw timings to `profile_details.json` beside it.

    `batches`: envs per rollout (default `default_batches`); `devices`: device counts (default 1 and 2 where the
    cluster has 2): d = `env,rollout,actor: 0-(d-1)`, one worker of each per device (env worker r in lockstep with
    policy worker r; the actor ranks data-parallel). Each row is the median of `repeats` rollouts (or updates) after
    a warm-up rollout. `steps`: env steps per rollout (default `cluster.profile_steps`; at most the horizon), the
    rows scaled by horizon / steps."""
    run_dir = Path(run_dir or cfg.run.path)
    out_path = Path(out_path or run_dir / "profile.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    work_dir = run_dir / "profile_work"
    sac = cfg.algorithm.name == "sac"
    if sac:  # the learner updates from the first iteration on, so that every timed call takes its gradient steps
        cfg = dataclasses.replace(cfg, sac=dataclasses.replace(cfg.sac, learning_starts=0))
    num_envs, horizon = cfg.env.num_envs, cfg.steps_per_rollout
    steps = min(horizon, steps or cfg.cluster.profile_steps)
    scale = horizon / steps  # each rollout's (and update's) seconds, scaled from `steps` env steps to the horizon
    batches = sorted(set(batches or default_batches(num_envs)) | {num_envs})
    if any(b < 1 or b > num_envs for b in batches):
        raise ValueError(f"profile: env counts {batches} must lie in 1..env.num_envs={num_envs}")
    devices = devices or tuple(d for d in (1, 2) if d <= cluster.num_devices)
    rows: dict[tuple[str, int, int], list[dict]] = {}
    details: dict = {"batches": batches, "devices": list(devices), "repeats": repeats, "horizon": horizon,
                     "steps": steps, "calls": []}
    info: dict = {"sync": [], "rpc": []}
    loops = _extra_loops(cfg, cluster, devices)
    total = (repeats + 1) * (sum(b % d == 0 for d in devices for b in batches) + len(loops))
    trajectories = Channel.create(f"{out_path.resolve()}:{time.time_ns()}/trajectories")
    step = 0
    bar = progress(cfg.run.progress)
    task = bar.add_task("profile", total=total, info=f"rollouts of {num_envs} envs x {steps} steps")
    try:
        bar.start()
        for d in devices:
            last = "0" if d == 1 else f"0-{d - 1}"
            # SAC's learner is one rank: one process over the d devices, as its plans place it
            ranks = 1 if sac else d  # actor ranks
            spec = f"env,rollout: {last}; actor: {last}:0" if sac and d > 1 else f"env,rollout,actor: {last}"
            placement = parse_placement(spec, cluster.num_devices, COMPONENTS)
            env = EnvProbe.launch(cluster, placement["env"], cfg, run_dir=str(work_dir))
            groups = [env]
            with running(groups):  # released after it, killed on a raise
                spaces = env.on(0).spaces().wait()[0]
                policy = PolicyProbe.launch(cluster, placement["rollout"], cfg, *spaces, run_dir=str(work_dir))
                groups.append(policy)
                learner = SACLearnerProbe if sac else EmbodiedActorProbe
                actor = learner.launch(cluster, placement["actor"], cfg, *spaces, run_dir=str(work_dir))
                groups.append(actor)
                sync_weights(actor.on([0]), [policy], check=True)
                policy_of = [policy.on(r) for r in range(d)]
                for b in sorted((b for b in batches if b % d == 0), reverse=True):  # the launched envs first
                    env.resize(b).wait()
                    for i in range(repeats + 1):  # the first rollout of each size warms up
                        outs = env.per_rank.rollout([(policy_of[r], trajectories, steps, step, ranks)
                                                     for r in range(d)]).wait()
                        step += 1
                        bar.update(task, advance=1, info=f"{b} envs on {d} device(s)")
                        if b == num_envs:  # the update on this whole iteration's trajectories
                            t = time.perf_counter()
                            r = max(actor.timed("train", trajectories, 0, d).wait(), key=lambda x: x["seconds"])
                            info["rpc"].append(time.perf_counter() - t - r["seconds"])
                        else:  # one copy per actor rank from each env worker
                            for a in range(d * ranks):
                                trajectories.get(key=a // d)
                        if not i:
                            continue
                        cells = {"env": scale * max(o["seconds"] - o["wait_time"] for o in outs),
                                 "rollout": scale * max(o["policy_time"] for o in outs)}
                        if d == 1 and b == num_envs:
                            waits = outs[0]["wait_time"] - outs[0]["policy_time"]
                            info.setdefault("shared", []).append(scale * waits)
                            info.setdefault("lockstep", []).append(scale * outs[0]["seconds"])
                        if b == num_envs:
                            cells["actor"] = scale * r["seconds"]
                        env_steps = sum(o["env_steps"] for o in outs)
                        for name, seconds in cells.items():
                            peak = r["peak_bytes"] if name == "actor" else 0
                            rows.setdefault((name, b, d), []).append({"seconds": seconds, "peak_bytes": peak})
                            details["calls"].append({"component": name, "batch": b, "devices": d,
                                                     "seconds": seconds, "env_steps": env_steps})
                for _ in range(repeats):
                    t = time.perf_counter()
                    sync_weights(actor.on([0]), [policy], check=cfg.rollout.checks_sync(2))  # as in a run's steady state
                    info["sync"].append(time.perf_counter() - t)
                if d == min(devices):
                    info["state"] = {"rollout": policy.model_bytes().wait()[0], "actor": actor.state_bytes().wait()[0]}
                    info["weights"] = actor.model_bytes().wait()[0]
                    info["machine"] = env.machine(len(cluster.nodes[0]["devices"])).wait()[0]
        for name, (spec, cohost, summary) in loops.items():
            outs, step = _lockstep_rollouts(cfg, cluster, trajectories, work_dir, repeats, step, steps, spec, cohost,
                                            lambda: bar.update(task, advance=1, info=name))
            info[name] = scale * summary(outs)
    finally:
        bar.stop()
        trajectories.destroy()
        shutil.rmtree(work_dir, ignore_errors=True)

    profile = _table(cluster, rows, info, num_envs)
    details.update(sync_seconds=info["sync"], call_overhead_seconds=info["rpc"])
    profile.save(out_path)
    profile.source = str(out_path)
    (out_path.parent / "profile_details.json").write_text(json.dumps(details, indent=1) + "\n")
    return profile


def _extra_loops(cfg, cluster: Cluster, devices) -> dict:
    """The lockstep rollouts at the full env count beyond the rows, where they apply: name -> (placement, the
    policy in the env worker's process, the summary of their outcomes that `_table` reads).
    - `split`: the policy on a device of its own (`env: 0; rollout: 1`): the median of the env's waits for actions
      beyond the policy's compute (the hand-overs' round trips between devices);
    - `cohosted`: the policy in the env worker's process (`rollout.cohost`, as the flow runs one stage on shared
      devices): the median of its seconds; its requests are calls in that process, so the policy's compute falls
      inside the env's own time (`_table` divides it by the env and rollout rows);
    - `two_ranks`: two env workers on one device, half of the envs each, asking one policy worker beside them
      (`env: 0:0-1; rollout: 0`): the median of the slower worker's seconds (`_table` sets it against the
      one-worker rollout on one device)."""
    if 1 not in devices:
        return {}
    loops = {}
    if cluster.num_devices >= 2:
        loops["split"] = ("env: 0; rollout: 1", False,
                          lambda outs: statistics.median(o["wait_time"] - o["policy_time"] for (o,) in outs))
    if cfg.rollout.cohost:
        loops["cohosted"] = ("env,rollout: 0", True, lambda outs: statistics.median(o["seconds"] for (o,) in outs))
    num_envs = cfg.env.num_envs
    if num_envs % 2 == 0 and (num_envs // 2) % cfg.env.seed_groups == 0:
        loops["two_ranks"] = ("env: 0:0-1; rollout: 0", False,
                              lambda outs: statistics.median(max(o["seconds"] for o in out) for out in outs))
    return loops


def _lockstep_rollouts(cfg, cluster: Cluster, trajectories, work_dir: Path, repeats: int, step: int, steps: int,
                       spec: str, cohost: bool, tick) -> tuple[list[list[dict]], int]:
    """`repeats` lockstep rollouts of `steps` env steps at the full env count (after a warm-up one) with env and
    policy placed by `spec`, the policy in the env worker's process when `cohost`; `tick()` after each. Returns each
    rollout's outcomes (one per env worker) and the next step."""
    placement = parse_placement(spec, cluster.num_devices, COMPONENTS[:2])
    env = EnvProbe.launch(cluster, placement["env"], cfg, run_dir=str(work_dir))
    groups, outs = [env], []
    with running(groups):  # released after it, killed on a raise
        env.resize(cfg.env.num_envs).wait()
        policy = PolicyProbe.launch(cluster, placement["rollout"], cfg, *env.on(0).spaces().wait()[0],
                                    run_dir=str(work_dir), host_with=env if cohost else None)
        groups.append(policy)
        for i in range(repeats + 1):  # the first warms up
            out = env.rollout(policy, trajectories, steps, step, 1).wait()
            for _ in out:
                trajectories.get(key=0)
            step += 1
            tick()
            if i:
                outs.append(out)
    return outs, step


def _table(cluster: Cluster, rows: dict, info: dict, num_envs: int) -> Profile:
    kind, memory = info["machine"]
    measurements = median_rows(rows, COMPONENTS)
    # once per iteration in every plan: the weight sync (the policy workers are other processes, even collocated
    # ones) and one round trip of a worker call
    fixed = statistics.median(info["sync"]) + statistics.median(info["rpc"])
    components = {"env": ComponentInfo(),
                  "rollout": ComponentInfo(state_bytes=info["state"]["rollout"]),
                  "actor": ComponentInfo(state_bytes=info["state"]["actor"], streams=False,
                                         fixed_seconds=fixed)}
    # channel and call costs are inside the rows: the flow moves obs, actions and trajectories the same way in
    # every plan, so the transfer terms are zero
    # a wait is timed in the env worker, the compute inside the policy worker: at ~0 the difference can dip below 0
    shared = max(statistics.median(info["shared"]), 0.0) if info.get("shared") else 0.0
    scale = None
    if "cohosted" in info:  # the co-hosted rollout against the env and rollout rows at that env count
        rows_sum = sum(statistics.median(x["seconds"] for x in rows[(c, num_envs, 1)]) for c in COMPONENTS[:2])
        scale = info["cohosted"] / rows_sum if rows_sum > 0 else 1.0
    two = None
    if "two_ranks" in info:
        # the factor s on the env row (a) that the loop on one device takes with two env workers: one worker's
        # rollout there took W1 = a + the rest (the policy, the round trips), two workers' W2 = s a + the rest
        a = statistics.median(x["seconds"] for x in rows[("env", num_envs, 1)])
        rest = statistics.median(info["lockstep"]) - a
        two = max(info["two_ranks"] - rest, 0.01 * a) / a
    latency = LoopLatency(shared=shared, split=max(info.get("split", shared), 0.0), cohosted_scale=scale,
                          two_ranks_scale=two)
    return Profile(flow="embodied", stages=COMPONENTS, loop=COMPONENTS[:2], loop_latency=latency, batch=num_envs,
                   machine=Machine(kind, cluster.num_devices, int(memory)), components=components,
                   measurements=measurements, transfer=Transfer(),
                   weights=Weights(info["weights"], "actor", ("rollout",)))
