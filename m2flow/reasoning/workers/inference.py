"""Inference worker: turns scored prompt groups into training micro-batches with old-policy (and,
with a KL penalty, reference-policy) logprobs, as the groups arrive. It does not train.
"""

from __future__ import annotations

import copy

import torch

from m2flow.engines.hf import load_model, load_tokenizer
from m2flow.engines.train import collate, token_logprobs
from m2flow.reasoning.workers.policy_copy import adapter_receiver, load_policy
from m2flow.runtime import Worker
from m2flow.runtime.stream import consumers_of, drain, finish, route
from m2flow.runtime.weights import WeightsRef, loaded_digest
from m2flow.types import Batch


def groups_to_batch(groups: list[dict], pad_id: int) -> Batch:
    """Flatten prompt groups into one padded Batch of samples (see engines.train.collate for the layout), with each
    sample's reward, advantage, behaviour logprobs and the weight version that generated it; for multi-turn groups
    (`loss_masks`) a `loss_mask` [B, L]: the response mask with the tool answers' tokens 0."""
    pairs, rewards, advantages, rollout_lp, versions, cut = [], [], [], [], [], []
    for g in groups:
        for i, resp in enumerate(g["responses"]):
            pairs.append((g["prompt_ids"], resp))
            cut.append(g["finish"][i] == "length" if "finish" in g else False)
            versions.append(g.get("version", 0))
            rewards.append(g["rewards"][i])
            advantages.append(g["advantages"][i] if "advantages" in g else 0.0)
            rollout_lp.append(g["logprobs"][i])
    t = collate(pairs, pad_id)
    batch = Batch(dict(t))
    batch["rewards"] = torch.tensor(rewards, dtype=torch.float32)
    batch["advantages"] = torch.tensor(advantages, dtype=torch.float32)
    batch["versions"] = torch.tensor(versions, dtype=torch.long)  # the weight version that generated each sample
    batch["truncated"] = torch.tensor(cut, dtype=torch.bool)  # cut at the length limit, no stop token
    lp = torch.zeros(batch["response_mask"].shape, dtype=torch.float32)
    # one value per response token, row by row (the mask's order); a short list is padded with 0, a long one cut
    flat = [v for (_, resp), values in zip(pairs, rollout_lp)
            for v in [*values[: len(resp)], *[0.0] * (len(resp) - len(values))]]
    lp[batch["response_mask"].bool()] = torch.tensor(flat, dtype=torch.float32)
    batch["rollout_logprobs"] = lp
    if any("loss_masks" in g for g in groups):  # multi-turn: 0 on the tokens a tool wrote (no gradient, no KL)
        loss = batch["response_mask"].clone()
        loss[loss.bool()] = torch.tensor([float(m) for g in groups for i, resp in enumerate(g["responses"])
                                          for m in (g["loss_masks"][i] if "loss_masks" in g else [1] * len(resp))])
        batch["loss_mask"] = loss
    return batch


class InferenceWorker(Worker):
    """Holds the current policy only when it recomputes old logprobs (`cfg.recompute_old_logprobs()`; it then takes
    weight syncs), and the frozen initial policy only for a KL penalty. With neither, it only collates: the old
    logprobs are the rollout's, and it never takes the device."""

    def __init__(self, cfg, model_path: str):
        self.cfg = cfg
        self.pad_id = load_tokenizer(model_path).pad_token_id
        self.recompute = cfg.recompute_old_logprobs()
        kl = cfg.algorithm.kl_coef > 0
        model = (load_model(model_path, dtype=getattr(torch, cfg.model.dtype), device=self.torch_device).eval()
                 if self.recompute or kl else None)
        self.model = model if self.recompute else None
        self.adapters = adapter_receiver(cfg)  # LoRA adapter syncs: the frozen base they are applied to
        # the reference policy is the initial model, frozen: only needed for a KL penalty
        self.ref = (copy.deepcopy(model) if self.recompute else model) if kl else None
        if self.model is not None:
            self.register_offloadable("model", self.model)
        if self.ref is not None:
            self.register_offloadable("ref", self.ref)

    def logprobs(self, inp, out, step: int, micro_batch: int, producers: int | None = None,
                 consumers: int | None = None) -> dict:
        """Collect groups from `inp` into micro-batches of >= `micro_batch` samples, add `old_logprobs`
        (and `ref_logprobs`) to each, put them into `out`; END after the last. With several consumer ranks (a
        data-parallel actor) each micro-batch is split into one share per rank, into the rank's sub-queue. The counts of
        producer and consumer ranks default to the channels'."""
        consumers = consumers_of(out, consumers)
        pending: list[dict] = []
        sent = 0
        for group in drain(inp, producers, alone=self.world_size == 1):
            pending.append(group)
            if sum(len(g["responses"]) for g in pending) >= micro_batch:
                sent += self._emit(pending, out, step, consumers)
                pending = []
        if pending:
            sent += self._emit(pending, out, step, consumers)
        finish(out, consumers, keyed=consumers > 1)
        return {"inference/samples": sent}

    def _emit(self, groups: list[dict], out, step: int, consumers: int) -> int:
        with self.span("collate", step):  # CPU work beside the device's tenants, as reward scoring
            batch = groups_to_batch(groups, self.pad_id)
        if not self.recompute:
            batch["old_logprobs"] = batch["rollout_logprobs"]
        if self.model is not None or self.ref is not None:
            with self.device_phase("logprobs", step), torch.no_grad():
                temperature, share = self.cfg.rollout.temperature, self.cfg.actor.share_prompts
                if self.model is not None:
                    batch["old_logprobs"] = token_logprobs(self.model, batch.tensors, temperature, share).cpu()
                if self.ref is not None:
                    batch["ref_logprobs"] = token_logprobs(self.ref, batch.tensors, temperature, share).cpu()
        if consumers > 1:
            route(out, batch, consumers)
        else:
            out.put(batch, weight=len(batch))
        return len(batch)

    def load_weights(self, weights: WeightsRef) -> str | None:
        if self.model is None:
            raise RuntimeError("inference: load_weights() called, but this worker holds no policy copy "
                               "(old logprobs come from the rollout); the flow syncs only the workers that need it")
        with self.device_phase("weight_sync", weights.version):  # the digest too: with offload the model is off after
            load_policy(self.model, weights, self.adapters)
            return loaded_digest(self.model, weights)
