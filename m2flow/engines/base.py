"""What every generation engine returns and accepts: the contract between rollout workers and engines.

Engines (HF `generate`, the native batched engine) implement `GenerationEngine`; nothing here runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence


@dataclass
class Generation:
    """One sampled response to one prompt.

    `logprobs[i]` is log π(response_ids[i] | prompt, response_ids[:i]) under the temperature-scaled
    policy (logits / temperature, before top-k/top-p truncation), so it is comparable with the
    training forward at the same temperature.
    """

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was produced, and is included) or "length"
    meta: dict = field(default_factory=dict)
    # with a ToolHook: 1 where the model wrote the token, 0 where a tool's answer was inserted (its logprob is 0 there)
    loss_mask: list[int] | None = None


@dataclass
class SamplingParams:
    """How to sample: n responses per prompt, up to max_new_tokens each."""

    n: int = 1
    max_new_tokens: int = 32
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None


GroupCallback = Callable[[int, list[Generation]], None]


class ToolHook(Protocol):
    """Multi-turn generation with tools. When a sequence's response ends with one of `triggers` (token sequences,
    e.g. a closing tag `</calc>`), the engine calls the hook with (prompt index, sample index, the response so far)
    and inserts the token ids it returns (a tool's answer) into that sequence, marked 0 in `loss_mask`, before the
    model writes on; None inserts nothing. Every inserted token counts against `max_new_tokens`. It may also return
    an answer still to come (an object with `done()` and `result()`, e.g. a concurrent.futures.Future, whose result
    holds at least one token): the sequence waits for it while the others generate on."""

    triggers: Sequence[Sequence[int]]

    def __call__(self, prompt_index: int, sample_index: int, response_ids: list[int]): ...


class GenerationEngine(Protocol):
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        on_group_done: GroupCallback | None = None,
        tool_hook: ToolHook | None = None,
    ) -> list[list[Generation]]:
        """Sample `params.n` responses for every prompt; result[i] holds prompt i's group in sample order.

        `on_group_done(prompt_index, group)` is called as soon as all n samples of a prompt are finished,
        before `generate` returns (the producer side of elastic pipelining). `tool_hook`: multi-turn generation
        with tools (see ToolHook); engines without it raise.
        """
        ...

    def update_weights(self, state_dict: dict) -> None:
        """Copy new weights into the engine's model in place (no re-instantiation)."""
        ...
