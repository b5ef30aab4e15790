"""Held-out evaluation of a generation engine on prompt/answer problems: greedy pass@1 and sampled
pass@k. It takes any engine with the GenerationEngine interface; it does not load models.
"""

from __future__ import annotations

from typing import Sequence

from m2flow.engines.base import SamplingParams
from m2flow.reasoning.tasks.rewards import RewardRunner, completion_text
from m2flow.reasoning.tasks.tools import final_answer


def evaluate(engine, tokenizer, items: Sequence[dict], reward_fn: str, k: int = 8, max_new_tokens: int = 8,
             temperature: float = 1.0, seed: int = 0, timeout_s: float | None = None, tool_hook=None) -> dict:
    """items: {"prompt_ids", "answer"}. Returns {"pass@1" (greedy), "pass@k" (any of k samples correct),
    "sampled_accuracy" (mean over the k samples), "problems"}. With `tool_hook` (an AgentHook) the responses are
    multi-turn, scored on their final answer, and "tool_calls" (per greedy response) is added."""
    prompts = [list(it["prompt_ids"]) for it in items]
    stop = [tokenizer.eos_token_id]

    def text(g) -> str:
        t = completion_text(tokenizer, g.response_ids, stop)
        return final_answer(t) if tool_hook is not None else t

    greedy = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=0.0,
                                                     stop_token_ids=stop), tool_hook=tool_hook)
    out = {"problems": len(items)}
    if tool_hook is not None:
        out["tool_calls"] = tool_hook.take_counts().get("calls", 0) / max(len(items), 1)
    with RewardRunner(reward_fn, timeout_s=timeout_s) as runner:
        texts = [text(g[0]) for g in greedy]
        scores, _ = runner.score_texts([it.get("prompt", "") for it in items], texts, [it["answer"] for it in items],
                                       [it.get("columns", {}) for it in items])
        out["pass@1"] = sum(s >= 1.0 for s in scores) / max(len(scores), 1)
        if k > 1:
            sampled = engine.generate(prompts, SamplingParams(n=k, max_new_tokens=max_new_tokens, temperature=temperature,
                                                              stop_token_ids=stop, seed=seed), tool_hook=tool_hook)
            if tool_hook is not None:
                tool_hook.take_counts()
            pairs = [(it, text(s)) for group, it in zip(sampled, items) for s in group]
            scores, _ = runner.score_texts([it.get("prompt", "") for it, _ in pairs], [t for _, t in pairs],
                                           [it["answer"] for it, _ in pairs], [it.get("columns", {}) for it, _ in pairs])
            correct = [s >= 1.0 for s in scores]
            out[f"pass@{k}"] = sum(any(correct[i * k:(i + 1) * k]) for i in range(len(items))) / max(len(items), 1)
            out["sampled_accuracy"] = sum(correct) / max(len(correct), 1)
    return out
