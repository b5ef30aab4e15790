"""Rejection-sampling fine-tuning (RAFT) as your own m2flow flow: sample n answers per prompt, keep the best one of
each prompt if it is right, train the policy on the kept answers, sync the weights, repeat. It is built from the
runtime (Worker, Channel, a placement) and m2flow's rollout, reward, inference and actor workers, plus one new
worker, Select. The same driver runs collocated or disaggregated: only the placement changes.

    python examples/best_of_n.py "rollout,reward,select,inference,actor: 0"       # all on device 0, taking turns
    python examples/best_of_n.py "rollout: 0; reward,select,inference,actor: 1"   # generation on its own device
"""

import sys
import time

from m2flow import config as C
from m2flow.engines.hf import load_tokenizer
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.tasks.datasets import build_datasets
from m2flow.reasoning.warm_start import prepare_model
from m2flow.reasoning.workers.actor import ActorWorker
from m2flow.reasoning.workers.inference import InferenceWorker
from m2flow.reasoning.workers.reward import RewardWorker
from m2flow.reasoning.workers.rollout import RolloutWorker
from m2flow.runtime import Channel, Cluster, Worker, launch_all, parse_placement, running, wait_all
from m2flow.runtime.stream import drain, finish
from m2flow.runtime.sync import sync_weights

COMPONENTS = ["rollout", "reward", "select", "inference", "actor"]
PER_SAMPLE = ("responses", "logprobs", "texts", "finish", "rewards")  # a prompt group's per-answer fields


class Select(Worker):
    """Passes on each prompt group's best answer when its reward is 1, with advantage 1: the actor's policy loss is
    then the negative log-likelihood of the kept answers (its ratio is 1: one update per batch)."""

    def best(self, inp, out) -> dict:
        groups = kept = 0
        for group in drain(inp):
            groups += 1
            i = max(range(len(group["rewards"])), key=group["rewards"].__getitem__)
            if group["rewards"][i] >= 1.0:
                out.put({**group, **{k: [group[k][i]] for k in PER_SAMPLE}, "advantages": [1.0]})
                kept += 1
        finish(out)
        return {"select/kept": kept / max(groups, 1)}


def train(cfg: ReasoningConfig, placement: str, cluster: Cluster | None = None) -> list[dict]:
    cluster = cluster or Cluster(cpu_devices=2)
    model = prepare_model(cfg, cfg.run.path)  # a tiny model + SFT warm start, as the reasoning flow builds it
    prompts, _ = build_datasets(cfg.data, load_tokenizer(model), cfg.run.seed)
    plan = parse_placement(placement, cluster.num_devices, COMPONENTS)
    groups = launch_all(cluster, [
        (RolloutWorker, plan["rollout"], (cfg, model)), (RewardWorker, plan["reward"], (cfg,)),
        (Select, plan["select"], ()), (InferenceWorker, plan["inference"], (cfg, model)),
        (ActorWorker, plan["actor"], (cfg, model))])
    rollout, reward, select, inference, actor = groups
    tag = f"best_of_n/{time.time_ns()}"
    samples, scored, best, ready = (Channel.create(f"{tag}/{name}") for name in ("samples", "scored", "best", "ready"))
    history = []
    with running(groups):  # released after, killed if a step raises
        sync_weights(actor, [rollout], check=True)
        for step in range(cfg.run.steps):
            batch = prompts.next_batch(cfg.rollout.prompts_per_step)
            results = wait_all([rollout.generate(batch, samples, step), reward.score(samples, scored, step),
                                select.best(scored, best), inference.logprobs(best, ready, step, cfg.actor.micro_batch),
                                actor.train(ready, step)])
            sync_weights(actor, [rollout], check=False)
            history.append({k: v for per_rank in results for k, v in per_rank[0].items()})
            print(f"step {step + 1}: reward {history[-1]['reward/mean']:.3f}, kept {history[-1]['select/kept']:.2f}")
    for channel in (samples, scored, best, ready):
        channel.destroy()
    return history


if __name__ == "__main__":
    cfg = C.load(ReasoningConfig, "grpo_arithmetic", ["run.name=best_of_n", "run.steps=20", *sys.argv[2:]])
    train(cfg, sys.argv[1] if len(sys.argv) > 1 else "rollout,reward,select,inference,actor: 0")
