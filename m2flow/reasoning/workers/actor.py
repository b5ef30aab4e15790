"""Actor worker: updates the policy from training micro-batches (PPO-clip family losses from
m2flow.algorithms), publishes its weights, and saves/loads checkpoints. It does not generate.

With one mini-batch and one epoch the update streams: streamed micro-batches are merged until they fill a pass
(`actor.micro_batch_tokens`) and each pass's gradient is accumulated the moment it is full, so training overlaps
rollout when the plan pipelines them and passes stay large when messages are small. With `actor.backend: fsdp2`
the model is sharded over the actor's ranks (FSDP2) and each rank trains on its share of every micro-batch. With
`model.lora.r` the model carries PEFT adapters and only they train (`m2flow/engines/lora.py`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch

from m2flow.algorithms import (behaviour_weights, get_kl_estimator, get_policy_loss, masked_mean, overlong_filter,
                               token_moments, whiten)
from m2flow.engines.fsdp import (
    all_reduce,
    export_hf,
    full_state_items,
    full_tensor,
    load_sharded,
    save_sharded,
    shard_model,
)
from m2flow.engines.guards import check_weight_growth, first_nonfinite, nonfinite_update, sum_of_squares
from m2flow.engines.hf import load_model, load_tokenizer
from m2flow.engines.lora import adapter_items, add_lora, merged_items, save_adapter
from m2flow.engines.precision import training_precision
from m2flow.engines.train import token_logprobs, token_logprobs_and_entropy
from m2flow.runtime import Worker
from m2flow.runtime.files import load_plain
from m2flow.runtime.stream import drain
from m2flow.runtime.sync import PublishesWeights
from m2flow.runtime.weights import publish, state_digest
from m2flow.types import Batch


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


class ActorWorker(PublishesWeights, Worker):
    def __init__(self, cfg, model_path: str):
        self.cfg = cfg
        a = cfg.actor
        torch.manual_seed(cfg.run.seed)
        self.tokenizer = load_tokenizer(model_path)
        # bf16 mixed precision: float32 master weights and optimizer state, bf16 compute (m2flow/engines/precision.py)
        self.precision = training_precision(cfg.model.dtype, cfg.model.mixed_precision)
        self.model = load_model(model_path, dtype=self.precision.weights, device=self.torch_device).train()
        self.lora = cfg.model.lora if cfg.model.lora.r else None
        # LoRA: adapters injected into the model in place, every other weight frozen; the optimizer gets only them
        self.peft = add_lora(self.model, self.lora) if self.lora else None
        self.sharded = a.backend == "fsdp2"
        if self.world_size > 1 and not self.sharded:
            raise ValueError(f"actor.backend=torch trains on one rank, but the placement gives the actor "
                             f"{self.world_size} ranks; set actor.backend=fsdp2 to shard it over them")
        if self.sharded:  # every rank holds 1/world of the parameters, gradients and optimizer state
            self.init_process_group()  # nccl on GPUs, gloo on CPUs
            shard_model(self.model, self.torch_device.type)
        self.key = self.rank if self.world_size > 1 else None  # data-parallel ranks read their own share
        # fused: one kernel for all parameters (TRL's default too); FSDP2's DTensor shards keep the foreach kernels
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=a.lr, betas=tuple(a.betas), eps=a.eps,
                                           weight_decay=a.weight_decay, fused=not self.sharded)
        total = cfg.run.steps * a.mini_batches * a.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(a.lr_schedule, a.warmup_steps, total))
        self.kl = get_kl_estimator(cfg.algorithm.kl_estimator) if cfg.algorithm.kl_coef > 0 else None
        # off-policy: clip against the proximal policy (this step's own), weight by proximal / behaviour (decoupled PPO)
        self.decoupled = cfg.algorithm.max_staleness > 0 and cfg.algorithm.old_logprobs == "auto"
        self.policy_loss = get_policy_loss(cfg.algorithm.policy_loss)  # ppo: a ratio per token; gspo: per response
        self.whiten = cfg.algorithm.advantage == "reinforce_pp"  # needs the whole step's advantages first
        self.version = 0
        # the prompt-sharing pass decides per micro-batch how many forwards it runs; sharded ranks must run alike
        self.share_prompts = a.share_prompts and not self.sharded
        self.forward_tokens = 0  # tokens through the model (padding included), counted at its input embedding
        self.model.get_input_embeddings().register_forward_hook(self._count_tokens)
        if not self.sharded:  # context switching moves plain tensors; sharded (DTensor) state stays put
            self.register_offloadable("model", self.model)
            self.register_offloadable("optimizer", self.optimizer)

    # -- training ------------------------------------------------------------------------------
    def train(self, inp, step: int, producers: int | None = None) -> dict:
        """One training step on every micro-batch from `inp` (until END). The gradient is the sample-weighted
        mean over the whole global batch, on one rank or summed over data-parallel ranks. Samples generated more
        than `algorithm.max_staleness` weight versions ago are dropped, never trained on (`actor/stale_dropped`).
        `producers` defaults to the channel's."""
        a = self.cfg.actor
        if step < self.cfg.critic.warmup_steps and self.cfg.algorithm.name == "ppo":  # only the critic learns yet
            samples = sum(len(b) for b in drain(inp, producers, key=self.key, alone=True))
            return {"actor/samples": 0, "actor/warmup": 1, "actor/lr": self.scheduler.get_last_lr()[0],
                    "actor/skipped_samples": samples}
        stats: list[tuple[int, dict]] = []
        ages: list[torch.Tensor] = []
        self.skipped, self.bad_loss, self.forward_tokens = 0, None, 0
        whitened = {}
        if a.mini_batches == 1 and a.epochs == 1 and not self.whiten:
            self.optimizer.zero_grad(set_to_none=True)
            seen = 0
            for part, real in self._parts(drain(inp, producers, key=self.key, alone=True), ages):
                with self.device_phase("train", step):
                    seen += self._backward(self._micros(part), stats, real=real)
            with self.device_phase("optimizer", step), self._growth_guard():
                grad_norm, samples = self._step(seen)
            grad_norms = [grad_norm]
        else:
            shares = [self._fresh(s, ages) for s in drain(inp, producers, key=self.key, alone=True)]
            if not shares:  # every group was dropped (dynamic sampling): no data, on every rank alike
                with self.device_phase("optimizer", step):  # the schedule advances as after any step
                    grad_norms = [self._step(0)[0] for _ in range(a.epochs * a.mini_batches)]
                return self._finish(stats, grad_norms, 0, ages, whitened)
            real = [s for s, is_real in shares if is_real]
            full = Batch.concat(real or [shares[0][0]], pad_value={"input_ids": self.tokenizer.pad_token_id})
            if self.whiten:
                whitened = self._whiten(full, bool(real))
            gen = torch.Generator().manual_seed(self.cfg.run.seed * 7919 + step)
            grad_norms, samples = [], 0
            with self.device_phase("train", step), self._growth_guard():
                if self.decoupled:  # the proximal policy: this step's weights, before its first update
                    full["prox_logprobs"] = self._logprobs(full)
                for _ in range(a.epochs):
                    order = torch.randperm(len(full), generator=gen)
                    for rows in torch.tensor_split(order, a.mini_batches):
                        self.optimizer.zero_grad(set_to_none=True)
                        n = self._backward(self._micros(full.select(rows)) if len(rows) else [], stats,
                                           real=bool(real), filler=full)
                        grad_norm, learned = self._step(n)
                        grad_norms.append(grad_norm)
                        samples += learned
        return self._finish(stats, grad_norms, samples, ages, whitened)

    def _finish(self, stats: list, grad_norms: list, samples: int, ages: list, whitened: dict) -> dict:
        """After a step's updates: the new version, the step's metrics."""
        self.version += 1
        out = weighted_mean(stats) | whitened
        grad_norms = [g for g in grad_norms if math.isfinite(g)] or [0.0]  # a skipped update's is not a figure
        age = torch.cat(ages) if ages else torch.zeros(0, dtype=torch.long)
        fresh = age <= self.cfg.algorithm.max_staleness
        kept = age[fresh]
        out.update({"actor/grad_norm": sum(grad_norms) / len(grad_norms), "actor/lr": self.scheduler.get_last_lr()[0],
                    "actor/samples": samples, "actor/micro_batches": len(stats), "actor/stale_dropped": int((~fresh).sum()),
                    "actor/nonfinite_skipped": self.skipped, "actor/forward_tokens": self.forward_tokens,
                    "actor/staleness_mean": float(kept.float().mean()) if len(kept) else 0.0,
                    "actor/staleness_max": int(kept.max()) if len(kept) else 0})
        if (memory := self.device_memory_gb()) is not None:
            out["actor/max_memory_gb"] = memory
        return out

    def _count_tokens(self, module, inputs, output) -> None:
        self.forward_tokens += inputs[0].numel()

    def _whiten(self, full: Batch, real: bool) -> dict:
        """REINFORCE++ (`algorithm.advantage: reinforce_pp`): the reward stage sent group-centred scores; whiten them
        in place over the valid tokens of the whole step (every rank's share), then report the token-weighted mean
        and std of the result (0 and 1 up to the Bessel correction)."""
        lengths = full["response_mask"].sum(-1)
        moments = token_moments(full["advantages"], lengths) if real else torch.zeros(3, dtype=torch.float64)
        if self.sharded:
            moments = torch.tensor([all_reduce(float(m)) for m in moments], dtype=torch.float64)
        full["advantages"] = whiten(full["advantages"], moments)
        n, total, squares = token_moments(full["advantages"], lengths).tolist() if real else (0.0, 0.0, 0.0)
        mean = total / max(n, 1)
        return {"actor/advantage_token_mean": mean,
                "actor/advantage_token_std": math.sqrt(max(squares / max(n, 1) - mean * mean, 0.0))}

    def _fresh(self, share: Batch, ages: list) -> tuple[Batch, bool]:
        """`share` without the samples older than `max_staleness` versions, and whether it still carries samples (a
        share that carries none keeps one row, so that sharded ranks still run their collectives, and learns nothing).
        Appends every sample's age (actor version - generating version) to `ages`."""
        if share.meta.get("weight", 1) == 0:
            return share, False
        if "versions" not in share:  # a batch built without the rollout (no generating version): on-policy
            return share, True
        age = self.version - share["versions"]
        ages.append(age)
        fresh = age <= self.cfg.algorithm.max_staleness
        stale = int((~fresh).sum())
        if stale == 0:
            return share, True
        if stale == len(share):
            return share.select(slice(0, 1)), False
        return share.select(fresh), True

    def _parts(self, shares, ages: list):
        """The streamed shares merged into parts of at least `actor.micro_batch_tokens` padded tokens (a step's last
        part may hold fewer), which `_micros` cuts into passes of at most that many: the message size between stages
        (`actor.micro_batch`) sets how finely data streams, not how small the forward/backward passes are, and the
        cuts depend on the data alone, never on timing, so that a run is reproducible (resume equals an uninterrupted
        run). Streaming training overlaps its producers when a part fills before the step's data has all arrived
        (long sequences, or a smaller `micro_batch_tokens`). Sharded ranks agree on every cut (they receive the same
        number of shares), so they run the same passes. Yields (part, whether it carries samples)."""
        limit = self.cfg.actor.micro_batch_tokens
        pending: list[tuple[Batch, bool]] = []
        for share in shares:
            pending.append(self._fresh(share, ages))
            width = max(s["input_ids"].shape[1] for s, _ in pending)
            full = not limit or sum(len(s) for s, _ in pending) * width >= limit
            if self.sharded:
                full = bool(all_reduce(int(full), "max"))
            if full:
                yield self._merge(pending)
                pending = []
        if pending:
            yield self._merge(pending)

    def _merge(self, pending: list[tuple[Batch, bool]]) -> tuple[Batch, bool]:
        real = [s for s, is_real in pending if is_real]
        if not real:
            return pending[0][0], False
        if len(real) == 1:
            return real[0], True
        return Batch.concat(real, pad_value={"input_ids": self.tokenizer.pad_token_id}), True

    def _logprobs(self, batch: Batch) -> torch.Tensor:
        """Token logprobs of `batch` under the current weights, no gradient, a micro-batch at a time."""
        with torch.no_grad(), self.precision.autocast(self.model):  # the micro-batches share the batch's padded width
            return torch.cat([token_logprobs(self.model, m.tensors, self.cfg.rollout.temperature, self.share_prompts)
                              for m in self._micros(batch)]).cpu()

    def _micros(self, batch: Batch) -> list[Batch]:
        """`batch` cut into forward/backward micro-batches: equal parts of at most `actor.micro_batch_tokens` padded
        tokens (at least one sample each), or of `actor.micro_batch` samples when that is 0."""
        a = self.cfg.actor
        if not a.micro_batch_tokens:
            return batch.split(a.micro_batch)
        rows = max(1, a.micro_batch_tokens // max(batch["input_ids"].shape[1], 1))
        parts = -(-len(batch) // rows)
        base, extra = divmod(len(batch), max(parts, 1))
        bounds = [0]
        for i in range(parts):
            bounds.append(bounds[-1] + base + (i < extra))
        return [batch.select(slice(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]

    def _backward(self, micros: list[Batch], stats: list, real: bool = True, filler: Batch | None = None) -> int:
        """Accumulate sum-of-sample-losses gradients over `micros`; returns the samples learned from. Sharded ranks
        first agree on the number of micro-batches (every forward and backward is a collective) and pad with
        zero-weight passes; `real=False` marks a share that carries no samples."""
        count = len(micros)
        if self.sharded:
            count = int(all_reduce(count, "max"))
        seen = 0
        for i in range(count):
            micro = micros[i] if i < len(micros) else (micros or [filler])[0].select(slice(0, 1))
            weight = len(micro) if real and i < len(micros) else 0
            loss, m = self._loss(micro)
            if self.bad_loss is None and not bool(torch.isfinite(loss)):  # named if the gradient turns out non-finite
                self.bad_loss = f"the loss of micro-batch {i} ({', '.join(f'{k} {v:.4g}' for k, v in m.items())})"
            (loss * weight).backward()
            if weight:
                seen += weight
                stats.append((weight, m))
        return seen

    def _loss(self, micro: Batch) -> tuple[torch.Tensor, dict]:
        alg = self.cfg.algorithm
        micro = micro.to(self.torch_device)
        mask = micro["response_mask"].float()
        extra = {}
        if "loss_mask" in micro:  # multi-turn: only the tokens the model wrote train (not the tools' answers)
            extra["tool_token_frac"] = 1.0 - micro["loss_mask"].sum() / mask.sum().clamp(min=1.0)
            mask = micro["loss_mask"].float()
        if alg.overlong_filter and "truncated" in micro:  # DAPO: a response cut at the limit gets no gradient
            mask = overlong_filter(mask, micro["truncated"])
            extra["overlong_filtered"] = micro["truncated"].float().mean()
        with self.precision.autocast(self.model):
            logprobs, entropy = token_logprobs_and_entropy(self.model, micro.tensors, self.cfg.rollout.temperature,
                                                           entropy_grad=bool(alg.entropy_coef),
                                                           share_prompts=self.share_prompts)
        advantages = micro["advantages"]  # one per response (GRPO), or one per token (PPO's GAE)
        advantages = (advantages.view(-1, 1) if advantages.dim() == 1 else advantages) * mask
        old = micro["old_logprobs"]
        # the engines' numerical mismatch in an on-policy step's first pass (bf16 against float32, kernels)
        extra["logprob_diff"] = masked_mean((logprobs.detach() - old).abs(), mask)
        if self.decoupled:  # PPO clips against the proximal policy; the behaviour gap is an importance weight
            prox = micro["prox_logprobs"] if "prox_logprobs" in micro else logprobs.detach()
            weights, behaviour = behaviour_weights(prox, old, mask, alg.behaviour_weight_cap)
            extra.update(behaviour)
            advantages, old = advantages * weights, prox
        loss, metrics = self.policy_loss(logprobs, old, advantages, mask, clip_low=alg.clip_low,
                                         clip_high=alg.clip_high, dual_clip=alg.dual_clip, agg=alg.loss_agg)
        metrics = {f"actor/{k}": float(v) for k, v in (metrics | extra).items()}
        metrics["actor/pg_loss"] = float(loss.detach())
        ent = masked_mean(entropy, mask)
        metrics["actor/entropy"] = float(ent.detach())
        if self.kl is not None:
            kl = masked_mean(self.kl(logprobs, micro["ref_logprobs"]), mask)
            loss = loss + alg.kl_coef * kl
            metrics["actor/kl"] = float(kl.detach())
        if alg.entropy_coef:
            loss = loss - alg.entropy_coef * ent
        return loss, metrics

    def _step(self, seen: int) -> tuple[float, int]:
        """Turn the accumulated sums into the global sample mean, clip, step. Returns (grad norm, global samples).
        FSDP2 already averaged the gradients over the ranks, hence the world-size factor."""
        total = int(all_reduce(seen)) if self.sharded else seen
        scale = (self.world_size if self.sharded else 1) / max(total, 1)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.actor.grad_clip)))
        if not math.isfinite(norm):  # the same global norm on every rank: they all stop, or all skip
            culprit = self.bad_loss or first_nonfinite((f"the gradient of {n}", p.grad)
                                                       for n, p in self.model.named_parameters())
            self.bad_loss = None
            self.optimizer.zero_grad(set_to_none=True)
            nonfinite_update(norm, culprit, self.cfg.actor.nonfinite)
            self.skipped += 1
            return norm, 0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # no stale gradient is kept (nor offloaded) until the next step
        return norm, total

    @contextmanager
    def _growth_guard(self):
        """Around a step's updates (inside the device phase that makes them, where the weights are on the device):
        stop the run if they grew more than `actor.max_weight_growth` allows."""
        a = self.cfg.actor
        before = self._weight_norm() if a.max_weight_growth else 0.0
        yield
        if a.max_weight_growth:
            check_weight_growth(before, self._weight_norm(), a.max_weight_growth, a.lr)

    def _weight_norm(self) -> float:
        """The 2-norm of all the weights (summed over the shards of a sharded actor)."""
        squares = sum_of_squares(self.model.parameters())
        return math.sqrt(all_reduce(squares) if self.sharded else squares)

    # -- weights and checkpoints ---------------------------------------------------------------
    def publish_weights(self, check: bool = True, local: bool = False):
        """Rank 0 publishes the full weights (a sharded actor gathers them one tensor at a time, every rank taking
        part, and publishes them in buckets), with their digest when the receivers' copies are to be `check`ed;
        other ranks return None. `local`: every receiver lives in rank 0's process (co-hosted): no object store."""
        with self.holding("publish", self.version):
            adapters = self.lora and self.lora.sync == "adapters"  # the receivers apply them to their frozen base
            # as the receivers hold them: with bf16 mixed precision, rounded to bf16 (adapters too, so that the merged
            # digest below is computed as each receiver merges)
            items = self.precision.published(self._state_items(merged=not adapters))
            if adapters:
                digest = None
                if check:  # the digest of the merged weights, which the receivers must then hold bit for bit
                    items = list(items)
                    digest = state_digest(dict(merged_items(items, self.lora.scaling)))
                items = adapter_items(items)
                if self.rank == 0:
                    ref = publish(items, self.version, digest=False, local=local, kind="adapters")
                    ref.digest = digest
                    return ref
            elif self.rank == 0:
                return publish(items, self.version, digest=check, local=local)
            for _ in items:
                pass
            return None

    def _state_items(self, merged: bool = False):
        """The state as (name, tensor) in sorted order, a sharded model's gathered one tensor at a time; `merged`:
        a LoRA model's as the plain model's (adapters merged into the weights)."""
        items = full_state_items(self.model) if self.sharded else iter(sorted(self.model.state_dict().items()))
        return merged_items(items, self.lora.scaling) if merged and self.lora else items

    def save_checkpoint(self, directory: str) -> None:
        """Under `directory`: `actor_dcp/` (model + optimizer as a distributed checkpoint, one shard file per rank,
        loadable on any rank count), `model/` (a single HF model directory; with LoRA the merged model, and
        `adapter/` the adapters as a PEFT directory) and `actor_state.pt` (scheduler, version, RNG). Every rank must
        call it."""
        d = Path(directory)
        with self.holding("checkpoint", self.version):
            save_sharded(self.model, self.optimizer, d / "actor_dcp")
            export_hf(self.model, d / "model", self.tokenizer, self.rank, items=self._state_items(merged=True))
            if self.lora:  # the adapters alone too, as a PEFT adapter directory
                items = self._state_items()
                if self.rank == 0:
                    save_adapter(self.peft, items, d / "adapter")
                else:
                    for _ in items:
                        pass
        if self.rank == 0:
            torch.save({"scheduler": self.scheduler.state_dict(), "version": self.version,
                        "torch_rng": torch.get_rng_state(), "world_size": self.world_size}, d / "actor_state.pt")

    def load_checkpoint(self, directory: str) -> int:
        """Resume from `save_checkpoint`'s output, whatever rank count wrote it."""
        d = Path(directory)
        with self.holding("checkpoint"):
            load_sharded(self.model, self.optimizer, d / "actor_dcp")
        s = load_plain(d / "actor_state.pt")
        self.scheduler.load_state_dict(s["scheduler"])
        self.version = s["version"]
        torch.set_rng_state(s["torch_rng"])
        return self.version


def weighted_mean(stats: list[tuple[int, dict]]) -> dict:
    """Sample-weighted mean of per-micro-batch metric dicts."""
    total = sum(n for n, _ in stats) or 1
    keys = {k for _, m in stats for k in m}
    return {k: sum(n * m.get(k, 0.0) for n, m in stats) / total for k in sorted(keys)}
