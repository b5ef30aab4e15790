"""Critic worker (reasoning PPO): a value model, the policy's transformer with a scalar head, that values every
response token, turns the step's rewards into token-level GAE advantages for the actor, and then learns to predict
the returns (clipped value loss). It holds the whole step's batch: GAE runs backwards over each response and the
advantages are whitened over the step's tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from m2flow.algorithms import masked_mean, masked_std, response_gae, value_loss
from m2flow.engines.fsdp import load_sharded, save_sharded
from m2flow.engines.hf import load_model, load_tokenizer
from m2flow.runtime import Worker
from m2flow.types import Batch
from m2flow.workers.common import drain, finish, route
from m2flow.workers.guards import first_nonfinite, nonfinite_update


class ValueModel(nn.Module):
    """V(prefix) for every position of a batch: the causal LM's transformer (its hidden states; the LM head is not
    used) and a linear head. `forward` is token-aligned like the logprobs: column t holds the value of the state in
    which the token at t was generated, read from the hidden state at t - 1 (column 0: 0)."""

    def __init__(self, lm: nn.Module, seed: int):
        super().__init__()
        self.lm = lm
        width = lm.config.hidden_size
        self.head = nn.Linear(width, 1)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # small: the first values are near 0, so the first advantages are about the rewards
            self.head.weight.copy_(torch.randn(1, width, generator=gen) * width**-0.5 * 0.1)
            self.head.bias.zero_()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               position_ids=batch.get("position_ids"), use_cache=False).last_hidden_state
        values = self.head(hidden).squeeze(-1).float()  # [B, L]: the value after reading tokens 0..t
        return torch.cat([values.new_zeros(values.shape[0], 1), values[:, :-1]], dim=1)


class CriticWorker(Worker):
    def __init__(self, cfg, model_path: str):
        self.cfg = cfg
        c = cfg.critic
        torch.manual_seed(cfg.run.seed + 1)
        self.model = ValueModel(load_model(model_path, dtype=getattr(torch, cfg.model.dtype)), cfg.run.seed).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr, betas=tuple(cfg.actor.betas),
                                           eps=cfg.actor.eps, weight_decay=c.weight_decay)
        self.pad_id = load_tokenizer(model_path).pad_token_id
        self.register_offloadable("model", self.model)
        self.register_offloadable("optimizer", self.optimizer)

    def values(self, inp, out, step: int, producers: int = 1, consumers: int = 1) -> dict:
        """Take the step's whole batch from `inp` (until END), value its tokens, attach token-level `advantages`
        (GAE, whitened over the step's response tokens) and `returns`, send it to `out` (one share per consumer rank
        when several), END; then train on it. Returns the critic's metrics."""
        a, alg = self.cfg.actor, self.cfg.algorithm
        shares = list(drain(inp, producers, alone=self.world_size == 1))
        if not shares:  # every group was dropped (dynamic sampling)
            finish(out, consumers, keyed=consumers > 1)
            return {"critic/samples": 0}
        batch = Batch.concat(shares, pad_value={"input_ids": self.pad_id})
        mask = batch["response_mask"].float()
        with self.device_phase("values", step), torch.no_grad():
            old = torch.cat([self.model(m.tensors) for m in batch.split(a.micro_batch)]) * mask
        adv, ret = response_gae(batch["rewards"], old, mask, alg.gamma, alg.lam)
        mean, std = masked_mean(adv, mask), masked_std(adv, mask)
        batch["advantages"] = (adv - mean) / (std + 1e-8) * mask  # whitened over the step's response tokens
        batch["values"], batch["returns"] = old, ret
        if consumers > 1:
            route(out, batch, consumers)
        else:
            out.put(batch, weight=len(batch))
        finish(out, consumers, keyed=consumers > 1)
        _, before = value_loss(old, old, ret, mask)  # how well the values the advantages came from predicted
        return self._train(batch, step) | {
            "critic/samples": len(batch), "critic/value_mean": float(before["value_mean"]),
            "critic/return_mean": float(masked_mean(ret, mask)), "critic/advantage_std": float(std),
            "critic/explained_var": float(before["explained_var"])}

    def _train(self, batch: Batch, step: int) -> dict:
        """Epochs x mini-batches of the clipped value loss over the step's batch (the actor's schedule)."""
        a, c = self.cfg.actor, self.cfg.critic
        gen = torch.Generator().manual_seed(self.cfg.run.seed * 7919 + step + 1)
        losses, clipfracs, norms = [], [], []
        with self.device_phase("critic_train", step):
            for _ in range(a.epochs):
                order = torch.randperm(len(batch), generator=gen)
                for rows in torch.tensor_split(order, a.mini_batches):
                    if not len(rows):
                        continue
                    part = batch.select(rows)
                    self.optimizer.zero_grad(set_to_none=True)
                    tokens = part["response_mask"].sum()
                    for micro in part.split(a.micro_batch):
                        m = micro["response_mask"].float()
                        loss, stats = value_loss(self.model(micro.tensors), micro["values"], micro["returns"], m,
                                                 clip=c.value_clip)
                        (loss * m.sum() / tokens.clamp(min=1)).backward()  # the token mean over the mini-batch
                        losses.append(float(loss.detach()))
                        clipfracs.append(float(stats["vf_clipfrac"]))
                    norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip))
                    if not torch.isfinite(torch.tensor(norm)):
                        culprit = first_nonfinite((f"the gradient of critic {n}", p.grad)
                                                  for n, p in self.model.named_parameters())
                        self.optimizer.zero_grad(set_to_none=True)
                        nonfinite_update(norm, culprit, a.nonfinite)
                        continue
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    norms.append(norm)
        mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
        return {"critic/vf_loss": mean(losses), "critic/vf_clipfrac": mean(clipfracs), "critic/grad_norm": mean(norms)}

    def save_checkpoint(self, directory: str) -> None:
        """`critic_dcp/` under `directory`: the value model and its optimizer (a distributed checkpoint)."""
        with self.holding("checkpoint"):
            save_sharded(self.model, self.optimizer, Path(directory) / "critic_dcp")

    def load_checkpoint(self, directory: str) -> None:
        with self.holding("checkpoint"):
            load_sharded(self.model, self.optimizer, Path(directory) / "critic_dcp")

