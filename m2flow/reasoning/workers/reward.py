"""Reward worker: scores prompt groups as they arrive (verifiable rewards with a timeout per call), attaches
group-relative advantages for GRPO-style algorithms, and streams them on. It does not train, and needs no device.
"""

from __future__ import annotations

import torch

from m2flow.algorithms import get_advantage_fn, overlong_penalty
from m2flow.reasoning.tasks.datasets import reward_name, reward_timeout
from m2flow.reasoning.tasks.rewards import RewardRunner
from m2flow.runtime import Worker
from m2flow.runtime.stream import drain_batches, finish

# advantage -> what the reward stage attaches per group (REINFORCE++: the group-centred score; the actor whitens it
# over the whole step's tokens)
GROUP_ESTIMATORS = {"grpo": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo", "reinforce_pp": "dr_grpo"}


class RewardWorker(Worker):
    def __init__(self, cfg):
        self.cfg = cfg
        self.runner_name = reward_name(cfg.reward.fn, cfg.data.task)
        self.runner = RewardRunner(self.runner_name, timeout_s=reward_timeout(self.runner_name, cfg.reward.timeout_s))
        self.advantage = cfg.algorithm.advantage
        fn = GROUP_ESTIMATORS.get(self.advantage)
        self.advantage_fn = get_advantage_fn(fn) if fn else None
        self._step = None  # (step, responses' values, counts): a step's figures, over its sampling rounds

    def score(self, inp, out, step: int, producers: int | None = None, consumers: int | None = None,
              target: int | None = None, draw: int = 0, last: bool = True) -> dict:
        """Score groups from `inp` until END; forward kept groups (with `rewards`, `advantages`) to `out`, then one
        END per consumer rank (the consumers share the queue). `rewards` are the shaped scores the advantages are made
        of: the task reward plus DAPO's overlong penalty when `algorithm.overlong_buffer` is set.

        DAPO's refill (`target`: the groups the step trains on): round `draw` of the step forwards kept groups until
        the step holds `target` (later ones are surplus, not sent) and ends the stream only once it does, or when it
        is the `last` round. Its metrics count every round of the step so far. The counts of producer and consumer
        ranks default to the channels'."""
        alg = self.cfg.algorithm
        if draw == 0 or self._step is None or self._step[0] != step:  # a new step's counts
            self._step = (step, {"task": [], "shaped": [], "penalty": [], "length": [], "advantage": []},
                          {"kept": 0, "dropped": 0, "surplus": 0, "timeouts": 0, "errors": 0, "truncated": 0})
        _, seen, count = self._step  # seen: one value per response
        for groups in drain_batches(inp, producers, alone=self.world_size == 1):
            scored = []
            for group in groups:
                with self.span("reward", step):  # CPU work beside the device's tenants: never takes the device lock
                    n = len(group["texts"])
                    scores, counters = self.runner.score_texts([group.get("prompt", "")] * n, group["texts"],
                                                               [group["answer"]] * n, [group.get("columns", {})] * n)
                count["timeouts"] += counters["timeouts"]
                count["errors"] += counters["errors"]
                count["truncated"] += sum(f == "length" for f in group.get("finish", ()))
                lengths = [len(r) for r in group["responses"]]
                seen["task"] += scores
                seen["length"] += lengths
                if alg.overlong_buffer:  # DAPO: a response near the length limit loses reward (its eos counts)
                    penalty = overlong_penalty(torch.tensor(lengths), self.cfg.rollout.max_new_tokens,
                                               alg.overlong_buffer, alg.overlong_penalty).tolist()
                    seen["penalty"] += penalty
                    scores = [s + p for s, p in zip(scores, penalty)]
                seen["shaped"] += scores
                if alg.dynamic_sampling and len(set(scores)) == 1:
                    count["dropped"] += 1  # DAPO: a group whose rewards are all equal carries no signal
                    continue
                if target is not None and count["kept"] + len(scored) >= target:
                    count["surplus"] += 1  # the step is full: DAPO's refill keeps the first `target` groups
                    continue
                group["rewards"] = scores
                if self.advantage_fn is not None:
                    group["advantages"] = self.advantage_fn(torch.tensor(scores, dtype=torch.float32), None,
                                                            len(scores)).tolist()
                    seen["advantage"] += group["advantages"]
                scored.append(group)
            if scored:  # what one round trip brought goes on in one round trip
                out.put_many(scored, weights=[len(g["rewards"]) for g in scored])
                count["kept"] += len(scored)
        self._check_errors(step, len(seen["task"]), count["errors"] + count["timeouts"])
        if target is None or last or count["kept"] >= target:
            finish(out, consumers)
        n = max(len(seen["task"]), 1)
        mean = lambda xs: sum(xs) / n  # noqa: E731 - over every scored response
        return {
            "reward/mean": mean(seen["task"]),
            "reward/accuracy": mean([r >= 1.0 for r in seen["task"]]),
            "reward/shaped_mean": mean(seen["shaped"]),
            "reward/overlong_penalty": mean(seen["penalty"]),
            "response/length_mean": mean(seen["length"]),
            "response/truncated_frac": count["truncated"] / n,  # cut at rollout.max_new_tokens, no stop token
            "reward/timeouts": count["timeouts"], "reward/errors": count["errors"],
            "reward/groups_kept": count["kept"], "reward/groups_dropped": count["dropped"],
            "reward/groups_surplus": count["surplus"],
            "advantage/abs_mean": sum(abs(a) for a in seen["advantage"]) / max(len(seen["advantage"]), 1),
        }

    def _check_errors(self, step: int, scored: int, failed: int) -> None:
        """A step in which more than reward.max_error_fraction of the samples could not be scored stops the run: a
        reward function that cannot score would otherwise train on zeros and end as if all were well."""
        limit = self.cfg.reward.max_error_fraction
        if scored and failed > limit * scored:
            raise RuntimeError(f"reward.fn {self.runner_name}: {failed} of the {scored} samples of step {step + 1} "
                               f"could not be scored (more than reward.max_error_fraction={limit:g}); the first: "
                               f"{self.runner.first_error or 'timed out (reward.timeout_s)'}")
