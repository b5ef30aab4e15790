"""Critic worker (reasoning PPO): a value model, the policy's transformer with a scalar head, that values every
response token, turns the step's rewards into token-level GAE advantages for the actor, and then learns to predict
the returns (clipped value loss). Each rank holds its share of the whole step (GAE runs backwards over each
response; the advantages are whitened over the step's tokens, moments summed over the ranks). With several ranks the
value model is sharded with FSDP2, as the actor is (`actor.backend=fsdp2`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from m2flow.algorithms import response_gae, value_loss
from m2flow.engines.fsdp import (all_reduce, all_reduce_tensor, full_tensor, load_sharded, save_sharded,
                                 shard_model)
from m2flow.engines.guards import first_nonfinite, nonfinite_update
from m2flow.engines.hf import load_model, load_tokenizer
from m2flow.engines.precision import training_precision
from m2flow.runtime import Worker
from m2flow.runtime.stream import consumers_of, drain, finish, route
from m2flow.types import Batch


class ValueModel(nn.Module):
    """V(prefix) for every position of a batch: the causal LM's transformer (its hidden states; the LM head is not
    used) and a linear head. `forward` is token-aligned like the logprobs: column t holds the value of the state in
    which the token at t was generated, read from the hidden state at t - 1 (column 0: 0)."""

    def __init__(self, lm: nn.Module, seed: int):
        super().__init__()
        self.model = lm.model  # the decoder (`model.layers`, as `shard_model` expects); the LM head stays behind
        width = lm.config.hidden_size
        self.head = nn.Linear(width, 1)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # small: the first values are near 0, so the first advantages are about the rewards
            self.head.weight.copy_(torch.randn(1, width, generator=gen) * width**-0.5 * 0.1)
            self.head.bias.zero_()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Values on the model's device, whatever device `batch` is on."""
        device = self.head.weight.device
        position_ids = batch.get("position_ids")
        hidden = self.model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                            position_ids=None if position_ids is None else position_ids.to(device),
                            use_cache=False).last_hidden_state
        values = self.head(hidden).squeeze(-1).float()  # [B, L]: the value after reading tokens 0..t
        return torch.cat([values.new_zeros(values.shape[0], 1), values[:, :-1]], dim=1)


class CriticWorker(Worker):
    def __init__(self, cfg, model_path: str):
        self.cfg = cfg
        c = cfg.critic
        torch.manual_seed(cfg.run.seed + 1)
        self.precision = training_precision(cfg.model.dtype, cfg.model.mixed_precision)  # as the actor's
        self.model = ValueModel(load_model(model_path, dtype=self.precision.weights, device=self.torch_device),
                                cfg.run.seed).train()
        self.sharded = self.world_size > 1
        if self.sharded:  # every rank holds 1/world of the parameters, gradients and optimizer state
            self.init_process_group()  # nccl on GPUs, gloo on CPUs
            shard_model(self.model, self.torch_device.type)
        self.key = self.rank if self.sharded else None  # sharded ranks read their own share
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr, betas=tuple(cfg.actor.betas),
                                           eps=cfg.actor.eps, weight_decay=c.weight_decay, fused=not self.sharded)
        self.pad_id = load_tokenizer(model_path).pad_token_id
        if not self.sharded:  # context switching moves plain tensors; sharded (DTensor) state stays put
            self.register_offloadable("model", self.model)
            self.register_offloadable("optimizer", self.optimizer)

    def values(self, inp, out, step: int, producers: int | None = None, consumers: int | None = None) -> dict:
        """Take this rank's share of the step from `inp` (until END), value its tokens, attach token-level `advantages`
        (GAE, whitened over the whole step's response tokens) and `returns`, send it to `out` (one share per consumer
        rank when several), END; then train on it. Returns the critic's metrics. The counts of producer and consumer
        ranks default to the channels'."""
        alg, consumers = self.cfg.algorithm, consumers_of(out, consumers)
        shares = list(drain(inp, producers, key=self.key, alone=True))
        if not shares:  # every group was dropped (dynamic sampling): on every rank alike
            finish(out, consumers, keyed=consumers > 1)
            return {"critic/samples": 0}
        batch = Batch.concat(shares, pad_value={"input_ids": self.pad_id})
        # a share of weight 0 is a filler row: its rank got no sample of this step (a step smaller than the group)
        real = torch.cat([torch.full((len(s),), s.meta.get("weight", 1) != 0) for s in shares])
        # multi-turn (agent.tools): the model's tokens only; GAE steps over the tools' answers, no value loss on them
        mask = batch["loss_mask" if "loss_mask" in batch else "response_mask"].float() * real[:, None]
        with self.device_phase("values", step), torch.no_grad():
            passes, _ = self._passes(batch)
            with self.precision.autocast(self.model):
                old = torch.cat([self.model(m.tensors).cpu() for m in passes])[: len(batch)] * mask
        adv, ret = response_gae(batch["rewards"], old, mask, alg.gamma, alg.lam)
        mean, std = self._moments(adv, mask)
        batch["advantages"] = (adv - mean) / (std + 1e-8) * mask  # whitened over the step's response tokens
        batch["values"], batch["returns"] = old, ret
        sent = batch.select(real) if real.any() else batch.select(slice(0, 1))  # the actor's filler: weight 0
        if not real.any():
            sent.meta["weight"] = 0
        if consumers > 1:
            route(out, sent, consumers)
        else:
            out.put(sent, weight=len(sent))
        finish(out, consumers, keyed=consumers > 1)
        # how well the values the advantages came from predicted the returns, over every rank's tokens
        n, v, r, r2, e, e2, rows = self._sum(mask, old * mask, ret * mask, ret.square() * mask, (ret - old) * mask,
                                             (ret - old).square() * mask, real.float())
        var_r, var_e = r2 / max(n, 1) - (r / max(n, 1)) ** 2, e2 / max(n, 1) - (e / max(n, 1)) ** 2
        return self._train(batch, mask, step) | {
            "critic/samples": int(rows), "critic/tokens": int(n), "critic/value_mean": v / max(n, 1),
            "critic/return_mean": r / max(n, 1),
            "critic/advantage_std": std, "critic/explained_var": 1 - var_e / var_r if var_r > 0 else 0.0}

    def _passes(self, batch: Batch) -> tuple[list[Batch], int]:
        """(the batch in passes of actor.micro_batch rows, how many of them are its own): sharded ranks run as many
        passes as the rank with the most (every forward is a collective), the extra ones over the first row, to be
        left out."""
        passes = batch.split(self.cfg.actor.micro_batch)
        count = int(all_reduce(len(passes), "max")) if self.sharded else len(passes)
        return passes + [batch.select(slice(0, 1))] * (count - len(passes)), len(passes)

    def _sum(self, *tensors: torch.Tensor) -> list[float]:
        """Each tensor's sum, over every rank when sharded (one all-reduce), in float64."""
        sums = torch.stack([t.double().sum() for t in tensors])
        return (all_reduce_tensor(sums) if self.sharded else sums).tolist()

    def _moments(self, adv: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
        """The mean and (Bessel) std of `adv` over every rank's response tokens."""
        n, total, squares = self._sum(mask, adv * mask, adv.square() * mask)
        mean = total / max(n, 1)
        return mean, max(squares - n * mean * mean, 0.0) ** 0.5 / max(n - 1, 1) ** 0.5

    def _train(self, batch: Batch, mask: torch.Tensor, step: int) -> dict:
        """Epochs x mini-batches of the clipped value loss over the step's batch (the actor's schedule): the token
        mean over each mini-batch's tokens on every rank (sharded: FSDP averages the gradients, hence the factor)."""
        a, c = self.cfg.actor, self.cfg.critic
        gen = torch.Generator().manual_seed(self.cfg.run.seed * 7919 + step + 1)
        batch["train_mask"] = mask
        losses, clipfracs, weights, norms = [], [], [], []
        with self.device_phase("critic_train", step):
            for _ in range(a.epochs):
                order = torch.randperm(len(batch), generator=gen)
                for rows in torch.tensor_split(order, a.mini_batches):
                    if not len(rows) and not self.sharded:
                        continue
                    part = batch.select(rows if len(rows) else slice(0, 1))  # sharded: a pass of weight 0
                    if not len(rows):
                        part["train_mask"] = part["train_mask"] * 0
                    tokens = part["train_mask"].sum()
                    tokens = all_reduce(float(tokens)) / self.world_size if self.sharded else float(tokens)
                    self.optimizer.zero_grad(set_to_none=True)
                    passes, own = self._passes(part)
                    for i, micro in enumerate(passes):
                        micro = micro.to(self.torch_device)
                        m = micro["train_mask"] * (i < own)
                        with self.precision.autocast(self.model):
                            values = self.model(micro.tensors)
                        loss, stats = value_loss(values, micro["values"], micro["returns"], m, clip=c.value_clip)
                        (loss * m.sum() / max(tokens, 1.0)).backward()  # the token mean over the mini-batch
                        losses.append(float(loss.detach()) * float(m.sum()))
                        clipfracs.append(float(stats["vf_clipfrac"]) * float(m.sum()))
                        weights.append(float(m.sum()))
                    norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)))
                    if not torch.isfinite(torch.tensor(norm)):  # the same global norm on every rank
                        culprit = first_nonfinite((f"the gradient of critic {n}", p.grad)
                                                  for n, p in self.model.named_parameters())
                        self.optimizer.zero_grad(set_to_none=True)
                        nonfinite_update(norm, culprit, a.nonfinite)
                        continue
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    norms.append(norm)
        loss, clipped, tokens = self._sum(torch.tensor(sum(losses)), torch.tensor(sum(clipfracs)),
                                          torch.tensor(sum(weights)))  # token means over every pass of every rank
        return {"critic/vf_loss": loss / max(tokens, 1), "critic/vf_clipfrac": clipped / max(tokens, 1),
                "critic/grad_norm": sum(norms) / max(len(norms), 1)}

    def save_checkpoint(self, directory: str) -> None:
        """`critic_dcp/` under `directory`: the value model and its optimizer (a distributed checkpoint)."""
        with self.holding("checkpoint"):
            save_sharded(self.model, self.optimizer, Path(directory) / "critic_dcp")

    def load_checkpoint(self, directory: str) -> None:
        with self.holding("checkpoint"):
            load_sharded(self.model, self.optimizer, Path(directory) / "critic_dcp")

