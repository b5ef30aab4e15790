"""Reasoning RL (GRPO / PPO on a causal LM): the macro flow, one driver for every plan.

rollout -> reward -> inference (old/ref logprobs) -> actor, connected by channels. Whether the stages
take turns on shared devices or stream micro-batches between devices lives in the plan, not here. With
`algorithm.max_staleness: N` the rollout of the next N steps runs while the actor trains (docs/algorithms.md).
"""

from __future__ import annotations

import random
import time
from collections import deque
from pathlib import Path

import torch
import yaml

from m2flow import config as C
from m2flow.engines.hf import load_tokenizer
from m2flow.reasoning.config import reasoning_components, refill_reward_ranks
from m2flow.reasoning.config import ReasoningConfig
from m2flow.run_dir import RunDir, idle_metrics, offload_metrics, progress, run_dir_claimed
from m2flow.runtime import (Channel, Cluster, foreground, gather_spans, launch_all, launch_cohosted, running,
                            wait_all)
from m2flow.planner.plan import ExecutionPlan, make_plan
from m2flow.reasoning.tasks.datasets import build_datasets
from m2flow.reasoning.warm_start import prepare_model
from m2flow.reasoning.workers.actor import ActorWorker
from m2flow.reasoning.workers.critic import CriticWorker
from m2flow.reasoning.workers.inference import InferenceWorker
from m2flow.reasoning.workers.reward import RewardWorker
from m2flow.reasoning.workers.rollout import RolloutWorker
from m2flow.reasoning.workers.tool import ToolWorker
from m2flow.runtime.files import load_plain
from m2flow.runtime.sync import sync_weights
from m2flow.runtime.tracer import plot_timeline, write_chrome_trace

COMPONENTS = ["rollout", "reward", "inference", "actor"]  # + "critic" (algorithm.name=ppo), "tool" (agent.tools)
PLOTS = {
    "reward": ["reward/mean", "reward/accuracy"],
    "response_length": ["response/length_mean"],
    "loss": ["actor/pg_loss", "actor/kl", "actor/entropy"],
    "step_seconds": ["time/step", "time/rollout", "time/weight_sync"],
    "idle": ["time/idle_fraction"],
    "heldout_accuracy": ["eval/pass@1"],
    "tool_calls": ["agent/calls", "agent/ok"],  # agent.tools: calls per response, and those the tool answered
}


def train(cfg: ReasoningConfig, cluster: Cluster | None = None, plan: ExecutionPlan | None = None) -> dict:
    """Run `cfg.run.steps` RL steps under `plan` (default: the one `cluster.placement` names); returns the last
    step's metrics, the run directory, the plan and the final model directory. `cluster.placement: auto` is resolved
    before a flow runs (`m2flow.train`, the `m2flow` command), which pass the chosen plan."""
    with run_dir_claimed(cfg.run.path, cfg.run.resume, cfg.run.overwrite):  # one run at a time; an old run is kept
        return _train(cfg, cluster, plan)


def _train(cfg: ReasoningConfig, cluster: Cluster | None, plan: ExecutionPlan | None) -> dict:
    """The flow, in its claimed run directory."""
    cluster = cluster or Cluster(cfg.cluster.address, cfg.cluster.cpu_devices, reuse_processes=cfg.cluster.reuse_processes)
    names = components(cfg)
    plan = plan or make_plan(cfg.placement(), cluster.num_devices, names,
                             cfg.rollout.prompts_per_step * cfg.rollout.n, cfg.actor.micro_batch)
    refill_reward_ranks(cfg, len(plan["reward"].rank_devices))  # an auto plan's too
    run = RunDir(cfg.run.path, cfg, resume=cfg.run.resume)
    model_path = prepare_model(cfg, run.path)
    train_set, test_set = build_datasets(cfg.data, load_tokenizer(model_path), cfg.run.seed)
    # collocated: one process per rank hosts every component (stages take turns in it; no process switches)
    cohost = cfg.rollout.cohost and plan.channel_maxsize == 0 and all(
        plan[c].rank_devices == plan["rollout"].rank_devices for c in names)

    specs = [(RolloutWorker, plan["rollout"], (cfg, model_path)), (RewardWorker, plan["reward"], (cfg,)),
             (InferenceWorker, plan["inference"], (cfg, model_path)),
             *([(CriticWorker, plan["critic"], (cfg, model_path))] if "critic" in names else []),
             (ActorWorker, plan["actor"], (cfg, model_path)),
             *([(ToolWorker, plan["tool"], (cfg,))] if "tool" in names else [])]
    groups = (launch_cohosted if cohost else launch_all)(cluster, specs, run_dir=str(run.path))
    by_name = dict(zip(names, groups))
    rollout, reward, inference, actor = (by_name[c] for c in COMPONENTS)
    critic = by_name.get("critic")  # PPO: values the tokens between inference and actor
    tool = by_name.get("tool")  # agent.tools: answers the rollout's tool calls
    switched, state_bytes = context_switched(cfg, plan, groups)
    for g in switched:  # each takes its state onto the device for its turns only; off it from the start
        g.set_context_switch(True).wait()
        g.offload().wait()
    (run.path / "plan.yaml").write_text(yaml.safe_dump({**plan.to_dict(), "offload": bool(switched),
                                                        "cohosted": cohost}, sort_keys=False))
    tag = f"{run.path.resolve()}:{time.time_ns()}"
    lag = cfg.algorithm.max_staleness
    # one set of channels per step in flight (max_staleness + 1), so that no stage reads another step's items
    hops = ("samples", "scored", "ready", *(["valued"] if critic else []))
    slots = [tuple(Channel.create(f"{tag}/{n}{i}", maxsize=plan.channel_maxsize) for n in hops)
             for i in range(lag + 1)]

    try:
        # released after a run that went well, killed if a step raises; cluster.foreground's components get the CPU first
        with running(groups), foreground(cluster, groups, cfg.cluster.foreground_components()):
            start = 0
            if cfg.run.resume and (found := run.latest_checkpoint()):
                start, ckpt = found
                actor.load_checkpoint(str(ckpt)).wait()
                if critic:
                    critic.load_checkpoint(str(ckpt)).wait()
                restore_driver_state(ckpt, train_set)
                run.drop_metrics_after(start)
            # who holds the current policy
            receivers = [rollout, inference] if cfg.recompute_old_logprobs() else [rollout]
            local_sync = cohost and all(g.world_size == 1 for g in receivers)  # every receiver in the actor's process
            sync_weights(actor, receivers, check=cfg.rollout.checks_sync(0), local=local_sync)

            def produce(k: int) -> tuple:
                """Start step k's rollout -> reward -> inference on the weights the rollout holds now; returns (the
                data loader's state before step k's prompts, the stages' handles, the channel step k's training
                batches arrive on, the metrics of refill rounds already done)."""
                samples, scored, ready, *valued = slots[k % (lag + 1)]
                data_state = train_set.state_dict()

                def generate(draw: int = 0):
                    prompts = train_set.next_batch(cfg.rollout.prompts_per_step)
                    shards = [prompts[r :: rollout.world_size] for r in range(rollout.world_size)]
                    return rollout.call_per_rank("generate", [(s, samples, k, reward.world_size, plan.micro_batch,
                                                               draw, tool) for s in shards])

                def after_scoring() -> list:
                    """Inference (old and reference logprobs), then with PPO the critic (values, GAE)."""
                    if not critic:
                        return [inference.logprobs(scored, ready, k, plan.micro_batch, reward.world_size,
                                                   actor.world_size)]
                    return [inference.logprobs(scored, ready, k, plan.micro_batch, reward.world_size,
                                               critic.world_size),
                            critic.values(ready, valued[0], k, inference.world_size, actor.world_size)]

                if cfg.algorithm.refill_rounds:  # on-policy (checked): the rounds run before the step trains
                    drawn = refill(k, generate, samples, scored)
                    return data_state, after_scoring(), (valued or [ready])[0], drawn
                return data_state, [
                    generate(),
                    reward.score(samples, scored, k, rollout.world_size, inference.world_size),
                    *after_scoring(),
                ], (valued or [ready])[0], {}

            def refill(k: int, generate, samples, scored) -> dict:
                """DAPO's dynamic sampling with refill: rounds of rollout.prompts_per_step fresh prompts (as veRL
                draws them) until the reward stage holds that many groups whose rewards differ, or
                `algorithm.refill_rounds` more rounds have run. Each round waits for its scores; the step trains on
                what was sent (the first prompts_per_step groups kept). Returns the rounds' rollout and reward
                metrics."""
                target, rounds = cfg.rollout.prompts_per_step, cfg.algorithm.refill_rounds
                tokens = seconds = 0.0
                for draw in range(rounds + 1):
                    gen = generate(draw)
                    score = reward.score(samples, scored, k, rollout.world_size, inference.world_size, target, draw,
                                         draw == rounds)
                    made, scores = wait_all([gen, score])
                    made = merge_metrics([made])  # over the rollout ranks, as a step's other metrics
                    tokens, seconds = tokens + made["rollout/tokens"], seconds + made["rollout/seconds"]
                    if scores[0]["reward/groups_kept"] >= target:
                        break
                return {**scores[0], "rollout/rounds": draw + 1, "rollout/tokens": tokens, "rollout/seconds": seconds,
                        "rollout/tokens_per_s": tokens / max(seconds, 1e-9), "reward/groups_drawn": (draw + 1) * target}

            held_out = [test_set[i] for i in range(len(test_set))] if cfg.run.eval_every else []

            def evaluate(step: int) -> list:
                """Greedy pass@1 of the rollout's current weights on the held-out split, shared by its ranks."""
                shards = [held_out[r :: rollout.world_size] for r in range(rollout.world_size)]
                return [rollout.call_per_rank("evaluate", [(s, 1, step) for s in shards])]

            def log(step: int, metrics: dict, evaluation: list | None = None) -> None:
                """Write step's row, with the held-out evaluation's figures once they are in."""
                if evaluation:
                    parts = wait_all(evaluation)[0]
                    problems = sum(p["problems"] for p in parts)
                    accuracy = sum(p["pass@1"] * p["problems"] for p in parts) / max(problems, 1)
                    metrics = {**metrics, "eval/pass@1": accuracy, "eval/problems": problems}
                run.log(step, metrics)

            if cfg.run.eval_every and start == 0:  # the curve's first point: the start model
                log(0, {}, evaluate(0))
            devices = sorted({d for g in groups for devs in g.placement.rank_devices for d in devs})
            last, trace, counters, in_flight, produced = {}, [], [], deque(), start
            held = None  # (step, metrics, evaluation): a row written once the next step's work is under way
            with progress(cfg.run.progress) as bar:
                task = bar.add_task(cfg.algorithm.name, total=cfg.run.steps, completed=start, info="")
                for step in range(start, cfg.run.steps):
                    t0, w0 = time.perf_counter(), time.time()
                    # keep `lag` steps of rollout ahead of training
                    while produced < cfg.run.steps and produced <= step + lag:
                        in_flight.append(produce(produced))
                        produced += 1
                    _, handles, ready, drawn = in_flight.popleft()
                    handles = [*handles, actor.train(ready, step, (critic or inference).world_size)]
                    if held:  # the last step's held-out evaluation ran while this step's work was being handed out
                        log(*held)
                        held = None
                    results = wait_all(handles)
                    t1 = time.perf_counter()
                    checked = cfg.rollout.checks_sync(step - start + 1)
                    synced = sync_weights(actor, receivers, check=checked, local=local_sync)
                    t2, w2 = time.perf_counter(), time.time()
                    spans = gather_spans(groups, clear=True)
                    trace += spans if cfg.run.trace else []
                    last = merge_metrics(results) | drawn | idle_metrics(spans, w0, w2, devices)
                    if switched:  # what context switching moved, and how much stays on the devices between steps
                        resident = sum(max(h) for h in wait_all([g.state_bytes() for g in switched]))
                        last.update(offload_metrics(spans), **{"offload/state_bytes": state_bytes,
                                                               "offload/resident_bytes": resident})
                    counters += [{"device": d, "time": w0, "name": "idle_fraction",
                                  "value": last[f"time/idle/device{d}"] / (w2 - w0)} for d in devices]
                    last.update({"time/step": t2 - t0, "time/rollout": last.get("rollout/seconds", 0.0),
                                 "time/weight_sync": t2 - t1,
                                 "sync/checked": int(checked), "sync/bytes": synced,
                                 "throughput/tokens_per_s": last.get("rollout/tokens", 0) / (t2 - t0)})
                    every = cfg.run.eval_every and ((step + 1) % cfg.run.eval_every == 0 or step + 1 == cfg.run.steps)
                    evaluation = evaluate(step + 1) if every else None  # queued on the rollout before it generates
                    if cfg.run.save_every and (step + 1) % cfg.run.save_every == 0 or step + 1 == cfg.run.steps:
                        log(step + 1, last, evaluation)  # the metrics never run behind a checkpoint
                        # a resume regenerates the steps in flight: it restarts the data where step + 1's prompts began
                        data_state = in_flight[0][0] if in_flight else train_set.state_dict()
                        save_checkpoint(run, cfg, step + 1, [actor, *([critic] if critic else [])], data_state)
                    elif evaluation:
                        held = (step + 1, last, evaluation)
                    else:
                        log(step + 1, last)
                    info = f"reward {last['reward/mean']:.3f}  acc {last['reward/accuracy']:.2f}"
                    bar.update(task, advance=1, info=info)

            if held:
                log(*held)
            if cfg.run.trace:
                write_chrome_trace(trace, run.path / "trace.json", counters=counters)
                plot_timeline(trace, run.path / "plots" / "timeline.png")
            run.plot(PLOTS)
    finally:
        run.close()
        for ch in (c for slot in slots for c in slot):
            ch.destroy()
    return {"metrics": last, "run_dir": str(run.path), "plan": plan.to_dict(),
            "final_model": str(run.path / "checkpoints" / f"step_{cfg.run.steps}" / "model")}


def components(cfg: ReasoningConfig) -> list[str]:
    """The flow's components: rollout, reward, inference, actor; the critic with `algorithm.name=ppo`; the tool
    component with `agent.tools`."""
    return reasoning_components(cfg)


def context_switched(cfg: ReasoningConfig, plan: ExecutionPlan, groups: list) -> tuple[list, int]:
    """-> (the groups that offload their state between turns (`cluster.offload`), the bytes of their state). Those
    are the groups holding state (weights, optimizer) on a device that another such group shares. true: all of
    them; auto: all of them where the state on some device exceeds `cluster.device_memory_gb`, or where the plan
    offloads (an auto plan that needed it). Called at the start, while all state is on the devices."""
    mode = cfg.cluster.offload
    if mode is False:
        return [], 0
    size = {g.component: max(g.state_bytes().wait()) for g in groups}
    held = [g for g in groups if size[g.component]]
    shared = [g for g in held if any(set(g.placement.devices) & set(o.placement.devices) for o in held if o is not g)]
    if mode == "auto":
        limit = cfg.cluster.device_memory_gb * 1e9
        devices = {d for g in held for d in g.placement.devices}
        over = limit and any(sum(size[g.component] for g in held if d in g.placement.devices) > limit for d in devices)
        if not (over or plan.offload):
            return [], 0
    return shared, sum(size[g.component] for g in shared)


def merge_metrics(results: list[list[dict]]) -> dict:
    """Per-rank metric dicts of every stage -> one dict (numbers averaged over ranks)."""
    out: dict = {}
    for per_rank in results:
        for key in per_rank[0] if per_rank and isinstance(per_rank[0], dict) else []:
            values = [r[key] for r in per_rank]
            out[key] = sum(values) / len(values)
    return out


def save_checkpoint(run: RunDir, cfg: ReasoningConfig, step: int, trainers: list, data_state: dict) -> None:
    """checkpoints/step_N/: the actor's shards and HF model/ (and with PPO the critic's `critic_dcp/`), the driver's
    data order and RNG, the run's config (what `m2flow eval` evaluates the checkpoint under)."""
    def write(tmp: Path) -> None:
        # every rank writes its shards
        wait_all([g.save_checkpoint(str(tmp)) for g in trainers], drain=run.WRITERS_DRAIN_S)
        torch.save({"data": data_state, "python_rng": random.getstate(), "torch_rng": torch.get_rng_state(),
                    "step": step}, tmp / "driver.pt")
        C.save_yaml(cfg, tmp / "config.yaml")

    run.save_checkpoint(step, write)


def restore_driver_state(ckpt: Path, train_set) -> None:
    state = load_plain(ckpt / "driver.pt")
    train_set.load_state_dict(state["data"])
    random.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
