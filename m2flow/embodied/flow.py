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
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
import yaml

from m2flow import config as C
from m2flow.embodied.config import EmbodiedClusterConfig
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.envs import maniskill
from m2flow.embodied.sac.learner import REPLAY_FILE, SACLearnerWorker
from m2flow.embodied.workers.actor import EmbodiedActorWorker, load_policy
from m2flow.embodied.workers.env import EnvWorker, make_env_group, video_recorder, wait_rollout
from m2flow.embodied.workers.policy import PolicyWorker, make_policy
from m2flow.planner.plan import ExecutionPlan, make_plan
from m2flow.run_dir import RunDir, latest_checkpoint, progress, run_dir_claimed
from m2flow.runtime import Channel, Cluster, Group, foreground, launch_all, running, wait_all
from m2flow.runtime.files import load_plain
from m2flow.runtime.sync import finish_sync, load_published, start_sync, sync_weights
from m2flow.runtime.tracer import plot_timeline, write_chrome_trace

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
    stages = cfg.env.pipeline_stages
    plan = plan or make_plan(cfg.placement(), cluster.num_devices, COMPONENTS, cfg.env.num_envs,
                             -(-cfg.env.num_envs // stages))
    run = RunDir(cfg.run.path, cfg, resume=cfg.run.resume)
    # lockstep on shared devices: no overlap to gain from separate processes, only the hand-overs' Ray hops to save
    cohost = cfg.rollout.cohost and stages == 1 and plan["rollout"].rank_devices == plan["env"].rank_devices
    # and an actor on those devices too: the trajectories and the weights stay in one process (the stages take turns)
    actor_cohost = cohost and plan["actor"].rank_devices == plan["env"].rank_devices
    (run.path / "plan.yaml").write_text(yaml.safe_dump({**plan.to_dict(), "pipeline_stages": stages,
                                                        "rollout_in_env_process": cohost,
                                                        "actor_in_env_process": actor_cohost}, sort_keys=False))

    # created before the workers, so that its process starts while theirs do (else the first put waits ~0.5 s for it)
    trajectories = Channel.create(f"{run.path.resolve()}:{time.time_ns()}/trajectories")
    learner = SACLearnerWorker if cfg.algorithm.name == "sac" else EmbodiedActorWorker
    started: list[Group | None] = [None, None]
    try:
        # processes of their own start while the env worker is built (they are built from the env's spaces)
        started[0] = None if cohost else Group.start(PolicyWorker, cluster, plan["rollout"])
        started[1] = None if actor_cohost else Group.start(learner, cluster, plan["actor"])
        env = EnvWorker.launch(cluster, plan["env"], cfg, run_dir=str(run.path))
        obs_space, action_space = env.on(0).spaces().wait()[0]
        rollout, actor = launch_all(cluster, [(PolicyWorker, plan["rollout"], (cfg, obs_space, action_space)),
                                              (learner, plan["actor"], (cfg, obs_space, action_space))],
                                    run_dir=str(run.path), started=started,
                                    host_with=[env if cohost else None, env if actor_cohost else None])
    except BaseException:
        for group in started:
            if group is not None:
                group.kill()
        trajectories.destroy()
        raise
    groups = [env, rollout, actor]
    # env worker r asks policy worker r % R for its actions; every actor rank gets every trajectory
    policy_of = [rollout.on(r % rollout.world_size) for r in range(env.world_size)]
    # co-hosted rank by rank: policy rank r lives in actor rank r's process, and every actor rank holds the weights
    local_sync = actor_cohost and rollout.world_size == actor.world_size

    # sac.ahead (at max_policy_lag=1): the learner's next call is queued while it still runs this one, so that it
    # goes on to its next gradient steps at once; it hands its weights back with its result, and the policy workers
    # load them from here while it updates (a call to the learner would wait behind the queued one). Not with the
    # learner in the env workers' process: there the queued call would wait for a rollout queued behind it
    ahead = cfg.algorithm.name == "sac" and cfg.sac.max_policy_lag > 0 and cfg.sac.ahead and not actor_cohost
    start, env_steps, recent, queued_train = 0, 0, deque(maxlen=cfg.run.stop_window), None
    if cfg.run.resume and (found := run.latest_checkpoint()):
        start, ckpt = found
        wait_all([actor.load_checkpoint(str(ckpt)), env.load_state(str(ckpt))])
        state = load_plain(ckpt / "driver.pt")
        env_steps, recent = state["env_steps"], deque(state["recent"], maxlen=cfg.run.stop_window)
        run.drop_metrics_after(start)
    sync_weights(actor if local_sync else actor.on([0]), [rollout], cfg.rollout.checks_sync(0), local_sync,
                 per_rank=True)  # one rank's weights are all's

    last, step, saved = {}, start, None
    try:
        # released after a run that went well, killed if it raises; cluster.foreground's components get the CPU first
        with running(groups), foreground(cluster, groups, cfg.cluster.foreground_components()):
            with progress(cfg.run.progress) as bar:
                task = bar.add_task(f"{cfg.algorithm.name} {cfg.env.id}", total=cfg.run.steps, completed=start, info="")
                for step in range(start, cfg.run.steps):
                    t0 = time.perf_counter()
                    trace = cfg.run.trace and (step < 2 or (cfg.run.trace_every > 0 and step % cfg.run.trace_every == 0))
                    checked = cfg.rollout.checks_sync(step - start + 1)
                    rollout_call = env.call_per_rank("rollout", [(policy_of[r], trajectories, cfg.steps_per_rollout,
                                                                  step, actor.world_size, trace)
                                                                 for r in range(env.world_size)])
                    train_call = queued_train if queued_train is not None else actor.train(
                        trajectories, step, env.world_size, *([checked] if ahead else []))
                    # co-hosted: the sync is queued behind the update in their process (no round trip between)
                    queued = start_sync(actor, [rollout], checked, per_rank=True) if local_sync else None
                    # a hung env step stops the run
                    env_out = wait_rollout([rollout_call], env, cfg.env.step_timeout_s, cfg.env.id)[0]
                    recent.extend(e["return"] for out in env_out for e in out["episodes"])
                    env_steps += sum(out["env_steps"] for out in env_out)
                    rollout_metrics = iteration_metrics(env_out, recent)
                    stop = (cfg.run.stop_return is not None and len(recent) == recent.maxlen
                            and rollout_metrics["rollout/return_window"] >= cfg.run.stop_return)
                    every = cfg.run.save_every and (step + 1) % cfg.run.save_every == 0
                    evaluate = cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0 and cfg.eval.episodes
                    save = every or evaluate or step + 1 == cfg.run.steps or stop
                    # sac.ahead: not past a checkpoint's save call (queued behind it, it would save a later state)
                    queued_train = None if not ahead or save else actor.train(
                        trajectories, step + 1, env.world_size, cfg.rollout.checks_sync(step + 2 - start))
                    actor_out = wait_all([train_call])[0]
                    t1 = time.perf_counter()
                    if ahead:
                        load_published(actor_out[0].pop("weights"), [rollout], checked)  # SAC: one learner rank
                    elif queued is None:
                        sync_weights(actor.on([0]), [rollout], checked)
                    sync_seconds = finish_sync(queued, checked) if queued else time.perf_counter() - t1
                    t2 = time.perf_counter()
                    last = {**rollout_metrics, **mean_over_ranks(actor_out), "env_steps": env_steps,
                            "throughput/env_steps_per_s": sum(o["env_steps"] for o in env_out) / (t2 - t0),
                            "time/iteration": t2 - t0, "time/weight_sync": sync_seconds, "sync/checked": int(checked)}
                    if save:
                        saved = save_checkpoint(run, cfg, step + 1, actor, env, env_steps, recent)
                    if evaluate:  # in this process, from the checkpoint just written
                        scores = evaluate_checkpoint(saved, cfg.eval.episodes)
                        last.update({f"eval/{k}": v for k, v in scores.items() if isinstance(v, float)})
                    run.log(step + 1, last)
                    bar.update(task, advance=1, info=f"return {last['rollout/return_window']:.1f}  "
                                                     f"{last['throughput/env_steps_per_s']:.0f} env steps/s")
                    if stop:
                        break
            if cfg.run.trace:
                spans = [s for g in groups for s in g.spans()]
                write_chrome_trace(spans, run.path / "trace.json")
                plot_timeline(spans, run.path / "plots" / "timeline.png")
                one = min(start + 1, step)  # one rollout, zoomed in: env stages and policy inference side by side
                plot_timeline([s for s in spans if s["step"] == one and s["component"] in ("env", "rollout")],
                              run.path / "plots" / "timeline_rollout.png", title=f"rollout of iteration {one + 1}")
            run.plot(PLOTS)
    finally:
        run.close()
        trajectories.destroy()
    result = {"metrics": last, "run_dir": str(run.path), "plan": plan.to_dict(), "iterations": step + 1 - start,
              "checkpoint": str(saved) if saved else None}
    if cfg.eval.episodes and saved:
        result["eval"] = evaluate_checkpoint(saved, cfg.eval.episodes)
        (run.path / "eval.json").write_text(json.dumps(result["eval"], indent=1))
    return result


def iteration_metrics(env_out: list[dict], recent) -> dict:
    """Episodes finished this iteration (raw return, length, success_once and success) and where the rollout's time
    went."""
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
    reported = [e for e in episodes if "success_once" in e]
    if reported:  # success at any step of the episode, and at its last
        out["rollout/success_once"] = float(np.mean([e["success_once"] for e in reported]))
        out["rollout/success"] = float(np.mean([e["success"] for e in reported]))
    return out


def mean_over_ranks(per_rank: list[dict]) -> dict:
    return {k: float(np.mean([r[k] for r in per_rank])) for k in per_rank[0]}


def save_checkpoint(run: RunDir, cfg, step: int, actor, env, env_steps: int, recent) -> Path:
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


def evaluate_checkpoint(path: str | Path, episodes: int = 10, video_dir: str | None = None) -> dict:
    """Run a checkpoint's policy (or a run directory's newest one) deterministically, with the mode of its action
    distribution, for `episodes` episodes (each env's first episode per round) under the saved obs normalization,
    frozen. Returns mean/std return, mean length, the success rate where the env reports success, and the video
    folder if `video_dir` (env 0's first episode, recorded where the env renders rgb_array frames)."""
    path = Path(path)
    if not (path / "policy.safetensors").exists() and (found := latest_checkpoint(path)):  # a run directory: its newest
        path = found[1]
    if not (path / "policy.safetensors").exists():
        raise FileNotFoundError(f"{path}: no policy.safetensors (expected an embodied checkpoint or run directory)")
    cfg = C.load(EmbodiedConfig, C.read_yaml(path / "config.yaml"))
    n = max(1, min(episodes, cfg.eval.num_envs))
    render = "rgb_array" if video_dir and not cfg.env.pixels else None
    group = make_env_group(cfg, n, cfg.eval.seed, training=False, render_mode=render, seed_groups=1,
                           wrap=video_recorder(video_dir) if video_dir else None)
    if (path / "env_0.safetensors").exists():
        from safetensors.torch import load_file

        group.load_state_dict(load_file(str(path / "env_0.safetensors")))
    policy = make_policy(cfg, group.observation_space, group.action_space).eval()
    load_policy(policy, path)
    found: list[dict] = []
    with torch.no_grad():
        for rnd in range(-(-episodes // n)):
            obs, first = group.reset(seed=cfg.eval.seed + rnd * n), {}
            while len(first) < n:
                actions = policy.act(torch.as_tensor(obs), deterministic=True)[0]
                obs = (group.step_chunk(actions) if cfg.env.chunk > 1 else group.step(actions)).obs
                for e in group.pop_episodes():
                    first.setdefault(e["env_index"], e)
            found += [first[i] for i in sorted(first)]
    group.close()
    found = found[:episodes]
    returns = np.array([e["return"] for e in found])
    out = {"episodes": len(found), "return_mean": float(returns.mean()), "return_std": float(returns.std()),
           "length_mean": float(np.mean([e["length"] for e in found]))}
    flags = [e["success_once"] for e in found if "success_once" in e]
    if flags:
        out["success_rate"] = float(np.mean(flags))
    tasks = maniskill.task_ids(cfg.env.id)
    if len(tasks) > 1 and flags:  # a multi-task group: env i ran task i % n
        for t, task in enumerate(tasks):
            mine = [e["success_once"] for e in found if e["env_index"] % len(tasks) == t]
            if mine:
                out[f"success_rate/{task}"] = float(np.mean(mine))
    if video_dir:
        out["video_dir"] = str(video_dir)
    return out


def behaviour_clone(cfg: EmbodiedConfig, demos: str | Path, out: str | Path, steps: int = 2000,
                    episodes: int | None = None, batch_size: int = 256, lr: float = 1e-3, show: bool = True) -> dict:
    """Fit `cfg`'s policy to the demonstrations in `demos` (`m2flow demos`; several datasets comma-separated, one per
    task of a multi-task env.id; the first `episodes` of each, successful ones only: fewer leave RL room to improve)
    and write `out/`: policy.safetensors and config.yaml, which
    `policy.init=OUT` starts an RL run from and `evaluate_checkpoint` evaluates, plus bc.json (the fit's metrics, the
    demos used) and eval.json (`cfg.eval.episodes` deterministic episodes from held-out seeds). In this process."""
    from safetensors.torch import save_file

    from m2flow.embodied.bc import demo_data, fit

    if cfg.env.norm_obs:
        raise ValueError("behaviour cloning with env.norm_obs=true is not supported yet (the RL run would normalize "
                         "observations the cloned policy never saw normalized); set env.norm_obs=false")
    data = demo_data(str(demos), cfg.env.id, cfg.env.instruct, cfg.env.chunk, cfg.algorithm.gamma, episodes)
    group = make_env_group(cfg, 1, cfg.run.seed)
    policy = make_policy(cfg, group.observation_space, group.action_space)
    group.close()
    with progress(show) as bar:
        task = bar.add_task("behaviour cloning", total=steps, info="")
        metrics = fit(policy, data, steps, batch_size=batch_size, lr=lr, vf_coef=cfg.algorithm.vf_coef,
                      seed=cfg.run.seed,
                      on_step=lambda i, m: bar.update(task, completed=i, info=f"nll {m['bc/nll']:.3f}"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in policy.state_dict().items()}, str(out / "policy.safetensors"))
    C.save_yaml(cfg, out / "config.yaml")
    result = {**metrics, "demos": str(demos), "demo_episodes": int(data["episodes"]), "demo_steps": len(data["obs"]),
              "steps": steps}
    (out / "bc.json").write_text(json.dumps(result, indent=1) + "\n")
    if cfg.eval.episodes:
        result["eval"] = evaluate_checkpoint(out, cfg.eval.episodes)
        (out / "eval.json").write_text(json.dumps(result["eval"], indent=1) + "\n")
    return result
