"""Reward worker: scores prompt groups as they arrive (verifiable rewards with a timeout per call), attaches
group-relative advantages for GRPO-style algorithms, and streams them on. It does not train, and needs no device.
"""

from __future__ import annotations

import torch

from m2flow.algorithms import get_advantage_fn
from m2flow.runtime import Worker
from m2flow.workers.common import drain_batches, finish
from m2flow.workloads.reasoning.rewards import RewardRunner
from m2flow.workloads.reasoning.tasks import reward_name, reward_timeout

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


class RewardWorker(Worker):
    def __init__(self, cfg):
        self.cfg = cfg
        name = reward_name(cfg.reward.fn, cfg.data.task)
        self.runner = RewardRunner(name, timeout_s=reward_timeout(name, cfg.reward.timeout_s))
        self.advantage = cfg.algorithm.advantage
        self.advantage_fn = get_advantage_fn(self.advantage) if self.advantage in GROUP_ESTIMATORS else None

    def score(self, inp, out, step: int, producers: int = 1, consumers: int = 1) -> dict:
        """Score groups from `inp` until END; forward kept groups (with `rewards`, `advantages`) to `out`, then one
        END per consumer rank (the consumers share the queue)."""
        rewards, lengths, kept, dropped, timeouts, errors, advantages = [], [], 0, 0, 0, 0, []
        for groups in drain_batches(inp, producers, alone=self.world_size == 1):
            scored = []
            for group in groups:
                with self.span("reward", step):  # CPU work beside the device's tenants: never takes the device lock
                    n = len(group["texts"])
                    scores, counters = self.runner.score_texts([group.get("prompt", "")] * n, group["texts"],
                                                               [group["answer"]] * n, [group.get("columns", {})] * n)
                timeouts += counters["timeouts"]
                errors += counters["errors"]
                rewards += scores
                lengths += [len(r) for r in group["responses"]]
                if self.cfg.algorithm.dynamic_sampling and len(set(scores)) == 1:
                    dropped += 1  # DAPO: a group whose rewards are all equal carries no signal
                    continue
                group["rewards"] = scores
                if self.advantage_fn is not None:
                    group["advantages"] = self.advantage_fn(torch.tensor(scores, dtype=torch.float32), None,
                                                            len(scores)).tolist()
                    advantages += group["advantages"]
                scored.append(group)
            if scored:  # what one round trip brought goes on in one round trip
                out.put_many(scored, weights=[len(g["rewards"]) for g in scored])
                kept += len(scored)
        finish(out, consumers)
        n = max(len(rewards), 1)
        return {
            "reward/mean": sum(rewards) / n,
            "reward/accuracy": sum(r >= 1.0 for r in rewards) / n,
            "response/length_mean": sum(lengths) / max(len(lengths), 1),
            "reward/timeouts": timeouts, "reward/errors": errors,
            "reward/groups_kept": kept, "reward/groups_dropped": dropped,
            "advantage/abs_mean": sum(abs(a) for a in advantages) / max(len(advantages), 1),
        }
