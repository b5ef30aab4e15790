"""What the reasoning driver calls to launch its components and hand out a step's stages; the driver
(`flow.py`) keeps the algorithm's order, this module the mechanics: which groups share a process or context-switch
(from the plan), the channels of the steps in flight, DAPO's refill rounds, the held-out evaluation, the driver's
checkpoint state.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from m2flow import config as C
from m2flow.planner.plan import ExecutionPlan
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.workers.actor import ActorWorker
from m2flow.reasoning.workers.critic import CriticWorker
from m2flow.reasoning.workers.inference import InferenceWorker
from m2flow.reasoning.workers.reward import RewardWorker
from m2flow.reasoning.workers.rollout import RolloutWorker
from m2flow.reasoning.workers.tool import ToolWorker
from m2flow.runtime import Channel, launch_all, launch_cohosted, wait_all
from m2flow.runtime.files import load_plain

WORKERS = {"rollout": RolloutWorker, "reward": RewardWorker, "inference": InferenceWorker, "critic": CriticWorker,
           "actor": ActorWorker, "tool": ToolWorker}


@dataclass
class Launched:
    """The running groups by component (`critic`, `tool`: None where the run has none), whether they share one
    process per rank (`cohost`), and those that context-switch with their state's bytes."""
    groups: dict
    cohost: bool
    switched: list
    state_bytes: int

    def __getattr__(self, name: str):
        if name in WORKERS:
            return self.groups.get(name)
        raise AttributeError(name)


def launch(cfg: ReasoningConfig, cluster, plan: ExecutionPlan, names: list[str], model_path: str,
           run_dir: Path) -> Launched:
    """Start every component the plan places. Collocated (every component on the rollout's devices, no channel
    bound): one process per rank hosts them all, the stages taking turns in it; context-switched groups start
    offloaded."""
    cohost = cfg.rollout.cohost and plan.channel_maxsize == 0 and all(
        plan[c].rank_devices == plan["rollout"].rank_devices for c in names)
    args = {c: (cfg,) if c in ("reward", "tool") else (cfg, model_path) for c in names}
    specs = [(WORKERS[c], plan[c], args[c]) for c in names]
    groups = dict(zip(names, (launch_cohosted if cohost else launch_all)(cluster, specs, run_dir=str(run_dir))))
    switched, state_bytes = context_switched(cfg, plan, list(groups.values()))
    for g in switched:  # each takes its state onto the device for its turns only; off it from the start
        g.set_context_switch(True).wait()
        g.offload().wait()
    return Launched(groups, cohost, switched, state_bytes)


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


@dataclass
class Work:
    """A step handed out: the data order before its prompts, the stages' handles, the channel its training
    batches arrive on, the metrics of refill rounds already done."""
    data_state: dict
    handles: list
    ready: Channel
    drawn: dict


class Steps:
    """Hands out steps: rollout -> reward -> inference (-> critic with PPO) on one of `max_staleness + 1` sets of
    channels, so that no stage reads another step's items, keeping `max_staleness` steps of rollout ahead of the
    training."""

    HOPS = ("samples", "scored", "ready", "valued")

    def __init__(self, cfg: ReasoningConfig, plan: ExecutionPlan, launched: Launched, train_set, test_set,
                 run_path: Path, start: int):
        self.cfg, self.plan, self.c, self.train_set = cfg, plan, launched, train_set
        self.lag, self.produced, self.in_flight = cfg.algorithm.max_staleness, start, deque()
        tag = f"{run_path.resolve()}:{time.time_ns()}"
        c = launched
        ranks = {n: g.world_size for n, g in c.groups.items()}
        # each hop knows the ranks that put into it and take from it, so the stage calls carry data only
        ends = {"samples": ("rollout", "reward"), "scored": ("reward", "inference"),
                "ready": ("inference", "critic" if c.critic else "actor"), "valued": ("critic", "actor")}
        hops = self.HOPS if c.critic else self.HOPS[:3]
        self.slots = [{n: Channel.create(f"{tag}/{n}{i}", plan.channel_maxsize, ranks[ends[n][0]], ranks[ends[n][1]])
                       for n in hops} for i in range(self.lag + 1)]
        self.held_out = [test_set[i] for i in range(len(test_set))] if cfg.run.eval_every else []

    def next(self, step: int) -> Work:
        """Step `step`'s work, after handing out the steps up to `step + max_staleness` not handed out yet."""
        while self.produced < self.cfg.run.steps and self.produced <= step + self.lag:
            self.in_flight.append(self._produce(self.produced))
            self.produced += 1
        return self.in_flight.popleft()

    def data_state(self) -> dict:
        """Where a resume restarts the data: where the prompts of the first step still in flight began."""
        return self.in_flight[0].data_state if self.in_flight else self.train_set.state_dict()

    def _produce(self, k: int) -> Work:
        c, ch, data_state = self.c, self.slots[k % (self.lag + 1)], self.train_set.state_dict()
        out = ch.get("valued", ch["ready"])
        if self.cfg.algorithm.refill_rounds:  # on-policy (checked): the rounds run before the step trains
            drawn = self._refill(k, ch)
            return Work(data_state, self._after_scoring(k, ch), out, drawn)
        # handed out in data order: co-hosted, one process runs its calls in the order they are made
        generate = self._generate(k, ch)
        score = c.reward.score(ch["samples"], ch["scored"], k)
        return Work(data_state, [generate, score, *self._after_scoring(k, ch)], out, {})

    def _generate(self, k: int, ch: dict, draw: int = 0):
        c, prompts = self.c, self.train_set.next_batch(self.cfg.rollout.prompts_per_step)
        shards = [prompts[r :: c.rollout.world_size] for r in range(c.rollout.world_size)]
        return c.rollout.per_rank.generate([(s, ch["samples"], k) for s in shards], granularity=self.plan.micro_batch,
                                           draw=draw, tools=c.tool)

    def _after_scoring(self, k: int, ch: dict) -> list:
        """Inference (old and reference logprobs), then with PPO the critic (values, GAE)."""
        c = self.c
        logprobs = c.inference.logprobs(ch["scored"], ch["ready"], k, self.plan.micro_batch)
        return [logprobs, c.critic.values(ch["ready"], ch["valued"], k)] if c.critic else [logprobs]

    def _refill(self, k: int, ch: dict) -> dict:
        """DAPO's dynamic sampling with refill: rounds of rollout.prompts_per_step fresh prompts (as veRL draws
        them) until the reward stage holds that many groups whose rewards differ, or `algorithm.refill_rounds` more
        rounds have run. Each round waits for its scores; the step trains on what was sent (the first
        prompts_per_step groups kept). Returns the rounds' rollout and reward metrics."""
        c, target, rounds = self.c, self.cfg.rollout.prompts_per_step, self.cfg.algorithm.refill_rounds
        tokens = seconds = 0.0
        for draw in range(rounds + 1):
            gen = self._generate(k, ch, draw)
            score = c.reward.score(ch["samples"], ch["scored"], k, target=target, draw=draw, last=draw == rounds)
            made, scores = wait_all([gen, score])
            made = merge_metrics([made])  # over the rollout ranks, as a step's other metrics
            tokens, seconds = tokens + made["rollout/tokens"], seconds + made["rollout/seconds"]
            if scores[0]["reward/groups_kept"] >= target:
                break
        return {**scores[0], "rollout/rounds": draw + 1, "rollout/tokens": tokens, "rollout/seconds": seconds,
                "rollout/tokens_per_s": tokens / max(seconds, 1e-9), "reward/groups_drawn": (draw + 1) * target}

    def evaluate(self, step: int):
        """Greedy pass@1 of the rollout's current weights on the held-out split, shared by its ranks, queued on the
        rollout now; -> a call that waits for it and returns its metrics."""
        rollout = self.c.rollout
        shards = [self.held_out[r :: rollout.world_size] for r in range(rollout.world_size)]
        handle = rollout.per_rank.evaluate([(s, 1, step) for s in shards])

        def metrics() -> dict:
            parts = handle.wait()
            problems = sum(p["problems"] for p in parts)
            return {"eval/pass@1": sum(p["pass@1"] * p["problems"] for p in parts) / max(problems, 1),
                    "eval/problems": problems}
        return metrics

    def destroy(self) -> None:
        for ch in (c for slot in self.slots for c in slot.values()):
            ch.destroy()


def merge_metrics(results: list[list[dict]]) -> dict:
    """Per-rank metric dicts of every stage -> one dict (numbers averaged over ranks)."""
    out: dict = {}
    for per_rank in results:
        for key in per_rank[0] if per_rank and isinstance(per_rank[0], dict) else []:
            values = [r[key] for r in per_rank]
            out[key] = sum(values) / len(values)
    return out


def save_checkpoint(run, cfg: ReasoningConfig, step: int, trainers: list, data_state: dict) -> None:
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
