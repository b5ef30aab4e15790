"""Actor worker: updates the policy from training micro-batches (PPO-clip family losses from
m2flow.algorithms), publishes its weights, and saves/loads checkpoints. It does not generate.

With one mini-batch and one epoch the update streams: each micro-batch's gradient is accumulated
the moment it arrives, so training overlaps rollout when the plan pipelines them.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from m2flow.algorithms import get_kl_estimator, masked_mean, policy_loss
from m2flow.engines.hf import load_model, load_tokenizer
from m2flow.engines.train import token_logprobs_and_entropy
from m2flow.runtime import Worker
from m2flow.runtime.weights import publish
from m2flow.types import Batch
from m2flow.workers.common import drain


def lr_lambda(schedule: str, warmup: int, total: int):
    """LR multiplier per optimizer step: linear warm-up, then constant or cosine to 10%."""
    def f(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        if schedule == "cosine":
            progress = min(1.0, (i - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0
    return f


class ActorWorker(Worker):
    def __init__(self, cfg, model_path: str):
        self.cfg = cfg
        torch.manual_seed(cfg.run.seed)
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path, dtype=getattr(torch, cfg.model.dtype)).train()
        a = cfg.actor
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
        total = cfg.run.steps * a.mini_batches * a.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(a.lr_schedule, a.warmup_steps, total))
        self.kl = get_kl_estimator(cfg.algorithm.kl_estimator) if cfg.algorithm.kl_coef > 0 else None
        self.version = 0
        self.register_offloadable("model", self.model)
        self.register_offloadable("optimizer", self.optimizer)

    # -- training ------------------------------------------------------------------------------
    def train(self, inp, step: int, producers: int = 1) -> dict:
        """One training step on every micro-batch from `inp` (until END)."""
        a = self.cfg.actor
        stats: list[tuple[int, dict]] = []
        if a.mini_batches == 1 and a.epochs == 1:
            self.optimizer.zero_grad(set_to_none=True)
            seen = 0
            for batch in drain(inp, producers):
                with self.device_phase("train", step):
                    for micro in batch.split(a.micro_batch):
                        loss, m = self._loss(micro)
                        (loss * len(micro)).backward()
                        seen += len(micro)
                        stats.append((len(micro), m))
            with self.device_phase("optimizer", step):
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad /= max(seen, 1)
                grad_norm = self._step()
            grad_norms = [grad_norm]
        else:
            full = Batch.concat(list(drain(inp, producers)), pad_value={"input_ids": self.tokenizer.pad_token_id})
            gen = torch.Generator().manual_seed(self.cfg.run.seed * 7919 + step)
            grad_norms = []
            with self.device_phase("train", step):
                for _ in range(a.epochs):
                    order = torch.randperm(len(full), generator=gen)
                    size = math.ceil(len(full) / a.mini_batches)
                    for mb in full.select(order).split(size):
                        self.optimizer.zero_grad(set_to_none=True)
                        for micro in mb.split(a.micro_batch):
                            loss, m = self._loss(micro)
                            (loss * len(micro) / len(mb)).backward()
                            stats.append((len(micro), m))
                        grad_norms.append(self._step())
        self.version += 1
        out = weighted_mean(stats)
        out.update({"actor/grad_norm": sum(grad_norms) / len(grad_norms), "actor/lr": self.scheduler.get_last_lr()[0],
                    "actor/samples": sum(n for n, _ in stats)})
        return out

    def _loss(self, micro: Batch) -> tuple[torch.Tensor, dict]:
        alg = self.cfg.algorithm
        mask = micro["response_mask"].float()
        logprobs, entropy = token_logprobs_and_entropy(self.model, micro.tensors, self.cfg.rollout.temperature)
        advantages = micro["advantages"].view(-1, 1) * mask
        loss, metrics = policy_loss(logprobs, micro["old_logprobs"], advantages, mask, clip_low=alg.clip_low,
                                    clip_high=alg.clip_high, dual_clip=alg.dual_clip, agg=alg.loss_agg)
        metrics = {f"actor/{k}": float(v) for k, v in metrics.items()}
        metrics["actor/pg_loss"] = float(loss.detach())
        ent = masked_mean(entropy, mask)
        metrics["actor/entropy"] = float(ent.detach())
        if self.kl is not None:
            kl = masked_mean(self.kl(logprobs, micro["ref_logprobs"]), mask)
            loss = loss + alg.kl_coef * kl
            metrics["actor/kl"] = float(kl)
        if alg.entropy_coef:
            loss = loss - alg.entropy_coef * ent
        return loss, metrics

    def _step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.actor.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return float(norm)

    # -- weights and checkpoints ---------------------------------------------------------------
    def publish_weights(self):
        return publish(self.model.state_dict(), self.version)

    def save_checkpoint(self, directory: str) -> None:
        """An HF model directory (safetensors) + optimizer/scheduler/RNG state under `directory`."""
        d = Path(directory)
        self.model.save_pretrained(d / "model", safe_serialization=True)
        self.tokenizer.save_pretrained(d / "model")
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "version": self.version, "torch_rng": torch.get_rng_state()}, d / "actor_state.pt")

    def load_checkpoint(self, directory: str) -> int:
        from safetensors.torch import load_file

        d = Path(directory)
        state = load_file(d / "model" / "model.safetensors")
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise ValueError(f"checkpoint {d} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        s = torch.load(d / "actor_state.pt", weights_only=False)
        self.optimizer.load_state_dict(s["optimizer"])
        self.scheduler.load_state_dict(s["scheduler"])
        self.version = s["version"]
        torch.set_rng_state(s["torch_rng"])
        return self.version


def weighted_mean(stats: list[tuple[int, dict]]) -> dict:
    """Sample-weighted mean of per-micro-batch metric dicts."""
    total = sum(n for n, _ in stats) or 1
    keys = {k for _, m in stats for k in m}
    return {k: sum(n * m.get(k, 0.0) for n, m in stats) / total for k in sorted(keys)}
