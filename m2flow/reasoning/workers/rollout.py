"""Rollout worker: samples n responses per prompt with a generation engine and streams each finished
prompt group to its output channel. It does not score or train.
"""

from __future__ import annotations

import time
import warnings

import torch

from m2flow.engines.base import SamplingParams
from m2flow.engines.hf import HFEngine, load_model, load_tokenizer
from m2flow.reasoning.tasks.datasets import reward_name, reward_timeout
from m2flow.reasoning.tasks.rewards import completion_text
from m2flow.reasoning.tasks.tools import AgentHook, Toolbox, final_answer
from m2flow.reasoning.workers.policy_copy import adapter_receiver, load_policy
from m2flow.runtime import Worker
from m2flow.runtime.stream import finish
from m2flow.runtime.weights import WeightsRef, loaded_digest


def build_engine(kind: str, model, tokenizer, max_slots: int, max_len: int, tools: bool = False):
    """The generation engine named by `rollout.engine`. The native engine runs Qwen2 and Llama models; for any other
    (e.g. a mixture of experts) HF `generate` takes over, with a warning, unless multi-turn tool rollouts (`tools`)
    need the native engine's stop-and-resume."""
    if kind == "native":
        from m2flow.engines.native import SUPPORTED_MODEL_TYPES, NativeEngine

        model_type = model.config.model_type
        if model_type in SUPPORTED_MODEL_TYPES:
            return NativeEngine(model, max_slots=max_slots, max_len=max_len)
        if tools:
            raise ValueError(f"rollout.engine=native runs {', '.join(SUPPORTED_MODEL_TYPES)} models, not "
                             f"{model_type!r}, and agent.tools needs it: multi-turn tool rollouts cannot fall back "
                             f"to HF generate")
        warnings.warn(f"rollout.engine=native runs {', '.join(SUPPORTED_MODEL_TYPES)} models; this one is "
                      f"{model_type!r}: generating with HF generate instead (set rollout.engine=hf to say so)",
                      stacklevel=2)
    return HFEngine(model, tokenizer)


def agent_hook(agent, tokenizer) -> AgentHook | None:
    """The engine's tool hook for `cfg.agent` (None without tools): calls decoded and answered with the policy's
    tokenizer."""
    if not agent.tools:
        return None
    return AgentHook(Toolbox(agent.tools, agent.timeout_s, agent.memory_mb),
                     lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                     lambda ids: tokenizer.decode(ids, skip_special_tokens=False), agent.max_turns)


class RolloutWorker(Worker):
    def __init__(self, cfg, model_path: str):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path, dtype=getattr(torch, cfg.model.dtype), device=self.torch_device).eval()
        self.adapters = adapter_receiver(cfg)  # LoRA adapter syncs: the frozen base they are applied to
        max_len = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens + 1
        self.engine = build_engine(cfg.rollout.engine, self.model, self.tokenizer, cfg.rollout.max_slots, max_len,
                                   tools=bool(cfg.agent.tools))
        self.version = 0
        self.register_offloadable("model", self.model)
        self.agent = agent_hook(cfg.agent, self.tokenizer)  # multi-turn: the engine feeds back tool answers

    def generate(self, prompts: list[dict], out, step: int, consumers: int | None = None, granularity: int = 1,
                 draw: int = 0, tools=None) -> dict:
        """Sample `rollout.n` responses for each prompt {index, ids, answer}; put finished prompt groups into `out`
        once `granularity` samples are ready (one round trip per put; 1: each group at once), then one END per
        consumer rank. `draw`: the step's sampling round (dynamic sampling's refills are rounds 1, 2, ...: each its own
        seed). `tools`: the tool component (agent.tools), whose rank r % its size answers this rank's calls (else
        this process answers them). Returns generation metrics. `consumers` defaults to the channel's."""
        r = self.cfg.rollout
        seed = self.cfg.run.seed * 1_000_003 + step * 101 + self.rank + draw * 7_919
        params = SamplingParams(
            n=r.n, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            stop_token_ids=[self.tokenizer.eos_token_id], seed=seed,
        )
        tokens, ready = 0, []

        def flush() -> None:
            if ready:
                out.put_many(ready, weights=[len(g["responses"]) for g in ready])
                ready.clear()

        def emit(i: int, group) -> None:
            nonlocal tokens
            p = prompts[i]
            tokens += sum(len(g.response_ids) for g in group)
            texts = [completion_text(self.tokenizer, g.response_ids, params.stop_token_ids) for g in group]
            ready.append({
                "index": p["index"], "prompt": p.get("prompt", ""), "prompt_ids": list(p["prompt_ids"]),
                "answer": p["answer"], "columns": p.get("columns", {}),
                "responses": [g.response_ids for g in group], "logprobs": [g.logprobs for g in group],
                # multi-turn: the reward scores the answer after the last tool result; the whole text is kept
                "texts": [final_answer(t) for t in texts] if self.agent else texts,
                "finish": [g.finish_reason for g in group], "version": self.version,
                **({"transcripts": texts, "loss_masks": [g.loss_mask for g in group]} if self.agent else {}),
            })
            if sum(len(g["responses"]) for g in ready) >= granularity:
                flush()

        if self.agent:
            self.agent.remote = None if tools is None else tools.on(self.rank % tools.world_size)
            self.agent.step = step
        with self.device_phase("generate", step):
            start = time.perf_counter()
            self.engine.generate([p["prompt_ids"] for p in prompts], params, on_group_done=emit, tool_hook=self.agent)
            seconds = time.perf_counter() - start
            flush()
        finish(out, consumers)
        metrics = {"rollout/tokens": tokens, "rollout/seconds": seconds,
                   "rollout/tokens_per_s": tokens / max(seconds, 1e-9),
                   "rollout/native_engine": int(not isinstance(self.engine, HFEngine))}
        if self.agent:  # per response: tool calls written, and how each call went
            counts, responses = self.agent.take_counts(), len(prompts) * r.n
            metrics.update({f"agent/{k}": counts.get(k, 0) / responses for k in
                            ("calls", "ok", "error", "timeout", "unknown", "over_turns")})
        return metrics

    def close(self) -> None:
        if self.agent is not None:  # its tool threads
            self.agent.close()

    def offload(self) -> None:
        """The model off the device (between context-switched turns), and the engine's KV cache freed with it."""
        super().offload()
        release = getattr(self.engine, "release_cache", None)  # the native engine's; HF generate keeps none
        if release is not None:
            release()

    def load_weights(self, weights: WeightsRef) -> str | None:
        """Copy the actor's published weights into the engine's model in place; returns their digest (None when not
        checked)."""
        with self.device_phase("weight_sync", weights.version):  # the digest too: with offload the model is off after
            load_policy(self.model, weights, self.adapters)
            self.version = weights.version
            return loaded_digest(self.model, weights)

    def evaluate(self, problems: list[dict], k: int = 1, step: int | None = None) -> dict:
        """Greedy pass@1 (and sampled pass@k when k > 1) of the weights this worker holds now, over held-out problems
        {prompt_ids, answer}, scored by the run's reward function; `problems` is the number scored."""
        from m2flow.reasoning.tasks.evaluate import evaluate

        name = reward_name(self.cfg.reward.fn, self.cfg.data.task)
        with self.device_phase("evaluate", step):
            return evaluate(self.engine, self.tokenizer, problems, name, k=k, max_new_tokens=self.cfg.rollout.max_new_tokens,
                            temperature=self.cfg.rollout.temperature, seed=self.cfg.run.seed,
                            timeout_s=reward_timeout(name, self.cfg.reward.timeout_s), tool_hook=self.agent)
