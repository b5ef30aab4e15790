"""What the embodied driver calls to launch its components and run an iteration's mechanics; the driver (`flow.py`)
keeps the algorithm's order, this module the rest: which groups share a process (from the plan), the learner's
update calls (queued one ahead with `sac.ahead`), the iteration's metrics, the checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from m2flow import config as C
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.sac.learner import REPLAY_FILE, SACLearnerWorker
from m2flow.embodied.workers.actor import EmbodiedActorWorker
from m2flow.embodied.workers.env import EnvWorker
from m2flow.embodied.workers.policy import PolicyWorker
from m2flow.planner.plan import ExecutionPlan
from m2flow.runtime import Channel, Group, launch_all, wait_all


@dataclass
class Launched:
    """The running groups; the trajectories' channel; whether the policy (`cohost`) and the learner
    (`actor_cohost`) live in the env workers' processes; which policy rank each env worker asks for its actions."""
    env: Group
    rollout: Group
    actor: Group
    trajectories: Channel
    cohost: bool
    actor_cohost: bool

    @property
    def groups(self) -> list:
        return [self.env, self.rollout, self.actor]

    def policy_of(self) -> list:
        """Env worker r asks policy worker r % R for its actions."""
        return [self.rollout.on(r % self.rollout.world_size) for r in range(self.env.world_size)]


def launch(cfg: EmbodiedConfig, cluster, plan: ExecutionPlan, run_path: Path) -> Launched:
    """Start the env, policy and learner groups. Lockstep on shared devices (one stage, the policy on the env's
    devices), the policy lives in the env workers' processes: no overlap to gain from separate ones, only the
    hand-overs' Ray hops to save; a learner on those devices too keeps the trajectories and the weights in one
    process (the stages take turns)."""
    cohost = cfg.rollout.cohost and cfg.env.pipeline_stages == 1 and \
        plan["rollout"].rank_devices == plan["env"].rank_devices
    actor_cohost = cohost and plan["actor"].rank_devices == plan["env"].rank_devices
    # created before the workers, so that its process starts while theirs do (else the first put waits ~0.5 s for it)
    trajectories = Channel.create(f"{run_path.resolve()}:{time.time_ns()}/trajectories", 0,
                                  len(plan["env"].rank_devices), len(plan["actor"].rank_devices),
                                  compress=cfg.cluster.compress_frames and spans_nodes(cluster, plan["env"],
                                                                                       plan["actor"]))
    learner = SACLearnerWorker if cfg.algorithm.name == "sac" else EmbodiedActorWorker
    started: list[Group | None] = [None, None]
    try:
        # processes of their own start while the env worker is built (they are built from the env's spaces)
        started[0] = None if cohost else Group.start(PolicyWorker, cluster, plan["rollout"])
        started[1] = None if actor_cohost else Group.start(learner, cluster, plan["actor"])
        env = EnvWorker.launch(cluster, plan["env"], cfg, run_dir=str(run_path))
        obs_space, action_space = env.on(0).spaces().wait()[0]
        rollout, actor = launch_all(cluster, [(PolicyWorker, plan["rollout"], (cfg, obs_space, action_space)),
                                              (learner, plan["actor"], (cfg, obs_space, action_space))],
                                    run_dir=str(run_path), started=started,
                                    host_with=[env if cohost else None, env if actor_cohost else None])
    except BaseException:
        for group in started:
            if group is not None:
                group.kill()
        trajectories.destroy()
        raise
    return Launched(env, rollout, actor, trajectories, cohost, actor_cohost)


def spans_nodes(cluster, *placements) -> bool:
    """Whether the ranks of `placements` sit on more than one node (what goes between them may cross nodes)."""
    return len({cluster.device(d).node_id for p in placements for devs in p.rank_devices for d in devs}) > 1


class Updates:
    """The learner's update calls, one per iteration, on the trajectories the env workers put. With `ahead`
    (sac.ahead at max_policy_lag >= 1, the learner in a process of its own): the next iteration's call is queued
    while this one still runs, so that the learner goes on to its next gradient steps at once; it then hands its
    weights back with its result (`WeightSync(returned=True)`: a call to the learner would wait behind the queued
    one). Never queued past a checkpoint's save call (behind it, it would save a later state)."""

    def __init__(self, cfg: EmbodiedConfig, c: Launched, checks, start: int):
        self.c, self.checks, self.start = c, checks, start
        self.ahead = (cfg.algorithm.name == "sac" and cfg.sac.max_policy_lag > 0 and cfg.sac.ahead
                      and not c.actor_cohost)
        self._call = self._queued = None

    def _submit(self, step: int):
        publish = {"publish": self.checks(step - self.start + 1)} if self.ahead else {}
        return self.c.actor.train(self.c.trajectories, step, **publish)

    def begin(self, step: int) -> None:
        """Step `step`'s update: the call queued last iteration, else one made now."""
        self._call, self._queued = self._queued or self._submit(step), None

    def result(self, step: int, save: bool) -> list:
        """Queue the next iteration's call where `ahead` allows (not before a save), then wait for this one's."""
        if self.ahead and not save:
            self._queued = self._submit(step + 1)
        return wait_all([self._call])[0]


def iteration_metrics(env_out: list[dict], recent) -> dict:
    """Episodes finished this iteration (raw return, length, success_once and success; per task of a multi-task env.id,
    success_once) and where the rollout's time went."""
    episodes = [e for out in env_out for e in out["episodes"]]
    steps, rollout_s = sum(o["env_steps"] for o in env_out), max(o["seconds"] for o in env_out)
    out = {"rollout/episodes": len(episodes),
           "rollout/return_window": float(np.mean(recent)) if recent else float("nan"),
           "throughput/rollout_env_steps_per_s": steps / rollout_s, "time/rollout": rollout_s,
           "env/fps": steps / max(sum(o["env_time"] for o in env_out), 1e-9),
           "policy/fps": steps / max(sum(o["policy_time"] for o in env_out), 1e-9),
           **{f"time/{k}": float(np.mean([o[k] for o in env_out])) for k in ("env_time", "policy_time", "wait_time")}}
    if episodes:
        out["rollout/return"] = float(np.mean([e["return"] for e in episodes]))
        out["rollout/length"] = float(np.mean([e["length"] for e in episodes]))
    wired = [o for o in env_out if o.get("obs_bytes_sent")]
    if wired:  # cluster.compress_frames: the frames sent to policy workers on other nodes, raw bytes / bytes sent
        out["env/obs_compression"] = sum(o["obs_bytes"] for o in wired) / sum(o["obs_bytes_sent"] for o in wired)
    reported = [e for e in episodes if "success_once" in e]
    if reported:  # success at any step of the episode, and at its last
        out["rollout/success_once"] = float(np.mean([e["success_once"] for e in reported]))
        out["rollout/success"] = float(np.mean([e["success"] for e in reported]))
        for task in sorted({e["task"] for e in reported if "task" in e}):  # a multi-task env.id: each task's
            out[f"rollout/success_once/{task}"] = float(np.mean([e["success_once"] for e in reported
                                                                  if e.get("task") == task]))
    return out


def mean_over_ranks(per_rank: list[dict]) -> dict:
    return {k: float(np.mean([r[k] for r in per_rank])) for k in per_rank[0]}


def save_checkpoint(run, cfg, step: int, actor, env, env_steps: int, recent) -> Path:
    """checkpoints/step_N/: policy + optimizer (actor), normalizer state per env worker, driver state, config; SAC's
    replay buffer (in the newest checkpoint only, by default: sac.save_buffer)."""
    def write(tmp: Path) -> None:
        wait_all([actor.on([0]).save_checkpoint(str(tmp)), env.save_state(str(tmp))], drain=run.WRITERS_DRAIN_S)
        torch.save({"step": step, "env_steps": env_steps, "recent": list(recent)}, tmp / "driver.pt")
        C.save_yaml(cfg, tmp / "config.yaml")

    saved = run.save_checkpoint(step, write)
    if cfg.algorithm.name == "sac" and cfg.sac.save_buffer == "latest":  # the newest complete checkpoint holds it now
        run.remove_from_older_checkpoints(REPLAY_FILE, step)
    return saved
