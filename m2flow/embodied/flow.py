"""Embodied RL (PPO / GRPO / SAC in gymnasium simulators): the macro flow, one driver for every plan.

env workers <-> policy workers (each env stage's obs out, its actions back) -> trajectories through a channel ->
actor -> weights back to the policy workers. On-policy (PPO, GRPO) the actor updates from the rollout it receives;
off-policy (SAC) the actor is a learner that takes the rollout into its replay buffer and updates from samples of
it, on the same calls. Lockstep or pipelined stages, collocated or hybrid placement, one env
worker or several: all of it lives in the config and the plan, not here. `evaluate_checkpoint` runs a saved policy
deterministically.
"""

from __future__ import annotations

import json
from collections import deque

from m2flow.embodied.config import EmbodiedClusterConfig, EmbodiedConfig
from m2flow.embodied.evaluation import evaluate_checkpoint
from m2flow.embodied.steps import Updates, iteration_metrics, launch, mean_over_ranks, save_checkpoint
from m2flow.embodied.workers.env import wait_rollout
from m2flow.planner.plan import ExecutionPlan, make_plan
from m2flow.run import Run
from m2flow.run_dir import run_dir_claimed
from m2flow.runtime import Cluster, foreground, running, wait_all
from m2flow.runtime.files import load_plain
from m2flow.runtime.sync import WeightSync

COMPONENTS = list(EmbodiedClusterConfig.COMPONENTS)  # env, rollout, actor
PLOTS = {
    "return": ["rollout/return", "rollout/return_window", "eval/return_mean"],
    "success": ["rollout/success_once"],
    "losses": ["actor/pg_loss", "actor/vf_loss", "actor/entropy"],
    "sac": ["sac/critic_loss", "sac/actor_loss", "sac/alpha", "sac/entropy"],
    "kl_clip": ["actor/approx_kl", "actor/clipfrac", "actor/explained_var"],
    "throughput": ["throughput/env_steps_per_s", "throughput/rollout_env_steps_per_s"],
    "seconds": ["time/iteration", "time/rollout", "time/update", "time/gradient_steps", "time/weight_sync"],
}


def train(cfg: EmbodiedConfig, cluster: Cluster | None = None, plan: ExecutionPlan | None = None) -> dict:
    """Run up to `cfg.run.steps` iterations (rollout, update, weight sync) under `plan` (default: the one
    `cluster.placement` names, with `env.pipeline_stages`); returns the last metrics and the run directory.
    `cluster.placement: auto` is resolved before a flow runs (`m2flow.train`, the `m2flow` command)."""
    with run_dir_claimed(cfg.run.path, cfg.run.resume, cfg.run.overwrite):  # one run at a time; an old run is kept
        return _train(cfg, cluster, plan)


def _train(cfg: EmbodiedConfig, cluster: Cluster | None, plan: ExecutionPlan | None) -> dict:
    """The flow, in its claimed run directory."""
    cluster = cluster or Cluster(cfg.cluster.address, cfg.cluster.cpu_devices, reuse_processes=cfg.cluster.reuse_processes)
    plan = plan or make_plan(cfg.placement(), cluster.num_devices, COMPONENTS, cfg.env.num_envs,
                             -(-cfg.env.num_envs // cfg.env.pipeline_stages))
    run = Run(cfg, plan, PLOTS, f"{cfg.algorithm.name} {cfg.env.id}", clock="time/iteration")
    c = launch(cfg, cluster, plan, run.path)
    env, rollout, actor = c.groups
    run.write_plan(pipeline_stages=cfg.env.pipeline_stages, rollout_in_env_process=c.cohost,
                   actor_in_env_process=c.actor_cohost)
    run.watch(c.groups, each_step=False, zoom=("env", "rollout"))
    start, ckpt = run.resume_point()
    policy_of, updates = c.policy_of(), Updates(cfg, c, cfg.rollout.checks_sync, start)
    # co-hosted rank by rank: policy rank r lives in actor rank r's process, and every actor rank holds the weights;
    # with sac.ahead the learner hands its weights back with its result
    sync = WeightSync(actor, [rollout], cfg.rollout.checks_sync, per_rank=True, returned=updates.ahead,
                      local=c.actor_cohost and rollout.world_size == actor.world_size)
    env_steps, recent, last, saved, step = 0, deque(maxlen=cfg.run.stop_window), {}, None, start
    try:
        # released after a run that went well, killed if it raises; cluster.foreground's components get the CPU first
        with running(c.groups), foreground(cluster, c.groups, cfg.cluster.foreground_components()):
            if ckpt:
                wait_all([actor.load_checkpoint(str(ckpt)), env.load_state(str(ckpt))])
                state = load_plain(ckpt / "driver.pt")
                env_steps, recent = state["env_steps"], deque(state["recent"], maxlen=cfg.run.stop_window)
            sync.first()  # one rank's weights are all's
            for step in run.steps(start):
                trace = cfg.run.trace and (step < 2 or (cfg.run.trace_every > 0 and step % cfg.run.trace_every == 0))
                rollout_call = env.per_rank.rollout([(policy_of[r], c.trajectories, cfg.steps_per_rollout, step)
                                                     for r in range(env.world_size)], trace=trace)
                updates.begin(step)
                sync.start(step - start + 1)  # co-hosted: queued behind the update in its process
                env_out = wait_rollout([rollout_call], env, cfg.env.step_timeout_s, cfg.env.id)[0]  # a hung step stops
                recent.extend(e["return"] for out in env_out for e in out["episodes"])
                env_steps += sum(out["env_steps"] for out in env_out)
                last = {**iteration_metrics(env_out, recent), "env_steps": env_steps}
                stop = (cfg.run.stop_return is not None and len(recent) == recent.maxlen
                        and last["rollout/return_window"] >= cfg.run.stop_return)
                evaluate = cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0 and cfg.eval.episodes
                save = run.checkpoint_due(step, evaluate, stop)
                actor_out = updates.result(step, save)
                last |= sync.finish(step - start + 1, actor_out)  # (sac.ahead: takes the weights the result holds)
                seconds = run.elapsed()
                last |= {**mean_over_ranks(actor_out), "throughput/env_steps_per_s": sum(
                    o["env_steps"] for o in env_out) / seconds}
                if save:
                    saved = save_checkpoint(run.dir, cfg, step + 1, actor, env, env_steps, recent)
                if evaluate:  # in this process, from the checkpoint just written
                    found = evaluate_checkpoint(saved, cfg.eval.episodes, show=False)  # under the run's bar
                    last |= {f"eval/{k}": v for k, v in found.items() if isinstance(v, float)}
                last = run.end_step(step, last, seconds=seconds, info=(
                    f"return {last['rollout/return_window']:.1f}  {last['throughput/env_steps_per_s']:.0f} env steps/s"))
                if stop:
                    break
            run.finish(step)
    finally:
        run.close()
        c.trajectories.destroy()
    result = {"metrics": last, "run_dir": str(run.path), "plan": plan.to_dict(), "iterations": step + 1 - start,
              "checkpoint": str(saved) if saved else None}
    if cfg.eval.episodes and saved:
        result["eval"] = evaluate_checkpoint(saved, cfg.eval.episodes, show=cfg.run.progress)
        (run.path / "eval.json").write_text(json.dumps(result["eval"], indent=1))
    return result
