"""Native batched generation for HF Qwen2/Llama causal LMs: the fast rollout path (CPU or GPU, plain torch ops).

It runs its own forward over the HF model's parameter tensors (no weight copy) with a preallocated KV cache, batched
prefill and decode, continuous batching and streaming of finished prompt groups. It does not train, does not handle
sliding-window/dynamic-RoPE/QK-norm variants, and knows nothing of workers or channels.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Sequence

import torch
import torch.nn.functional as F

from m2flow.engines.base import Generation, GroupCallback, SamplingParams, ToolHook

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalize in fp32, scale in the model dtype. x: [..., hidden]."""
    if x.dtype == torch.float32:  # one fused op, same math
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _add_linear(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Residual + projection, x + h @ weight.T (+ bias), as one addmm where it can. x: [N, out]; h: [N, in]."""
    if bias is None:
        return torch.addmm(x, h, weight.t())
    return x + F.linear(h, weight, bias)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF rotate_half RoPE, x * cos + cat(-x2, x1) * sin, with the sign folded into signed_sin = cat(-sin1, sin2).
    x: [..., head_dim]; cos/signed_sin broadcastable to x."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin


def counter_uniforms(seed: int, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row, a hash of (seed, request, position) alone: a sequence's draws do not depend on
    which other sequences share its decode steps, nor on when (multi-turn: a sequence that waited for a tool)."""
    mask = 0xFFFFFFFF
    x = (requests * 0x85EBCA77 + positions * 0xC2B2AE3D + (seed * 0x9E3779B1 & mask)) & mask
    for _ in range(3):  # xorshift-multiply rounds (lowbias32): products stay below 2^63
        x = ((x ^ (x >> 16)) * 0x7FEB352D) & mask
    x = x ^ (x >> 15)
    return (x.double() + 0.5) / 2.0**32


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and its logprob.

    logits: [R, V] fp32. Returns (tokens [R] long, logprobs [R] fp32). The logprob is log_softmax(logits / T) of the
    chosen token, before top-k/top-p truncation (see `Generation`); greedy (T == 0) reports T = 1 logprobs.
    Sampling is inverse-CDF with one uniform draw per row (cheap on CPU, reproducible through `generator`), or the
    given `uniforms` [R].
    """
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        logprobs = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
        _check_finite(logprobs)
        return tokens, logprobs
    z = logits if params.temperature == 1.0 else logits / params.temperature
    logp = z.log_softmax(-1)
    vocab = z.shape[-1]
    if 0 < params.top_k < vocab or params.top_p < 1.0:
        if 0 < params.top_k < vocab:  # keep tokens >= the k-th largest (ties kept, as in HF)
            kth = torch.topk(z, params.top_k, dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if params.top_p < 1.0:  # drop the low tail whose mass is <= 1 - top_p, always keep the top token (as in HF)
            sorted_z, order = torch.sort(z, dim=-1)
            remove = sorted_z.softmax(-1).cumsum(-1) <= 1.0 - params.top_p
            remove[:, -1] = False
            z = z.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
        probs = z.softmax(-1)
    else:
        probs = logp.exp()
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    _check_finite(total)  # a NaN or +inf logit makes its row's sum NaN (checked on R numbers, not R x V)
    u = (torch.rand(total.shape, device=cdf.device, generator=generator, dtype=cdf.dtype) if uniforms is None
         else uniforms[:, None].to(cdf.dtype)) * total
    u = torch.minimum(u, total.nextafter(torch.zeros_like(total)))  # u < total: the first cdf > u has p > 0
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _check_finite(per_row: torch.Tensor) -> None:
    """Stop on rows whose logits held NaN or +inf (seen in a per-row reduction), before they pick a token."""
    bad = ~torch.isfinite(per_row)
    if bad.any():
        raise FloatingPointError(f"the model produced non-finite logits (NaN or inf) in {int(bad.sum())} of "
                                 f"{per_row.shape[0]} sequences: its weights are not finite or too large (a learning "
                                 f"rate too high, e.g. actor.lr, or a broken model directory)")


class NativeEngine:
    """Batched generation over an HF Qwen2/Llama `*ForCausalLM` (fp32/bf16/fp16, any device).

    model: the HF model; the engine reads its parameter tensors directly at every `generate` call, so in-place weight
        updates (`update_weights`, or `model.load_state_dict` by anyone) are seen without re-instantiation.
    max_slots: most sequences decoded at once (KV cache rows); more requests wait and refill finished slots.
    max_len: cap on prompt + response tokens per sequence (default: the config's max_position_embeddings).
    prefill_tokens: most padded prompt tokens per prefill forward (bounds activation memory for long prompts).

    KV cache: k and v tensors [layers, slots, kv_heads, length, head_dim] in the model dtype, allocated on first use
    for the call's need (slots = min(max_slots, requests), length = longest prompt + max_new_tokens) and reused by
    later calls, grown only when a call needs more.
    """

    def __init__(self, model, max_slots: int = 256, max_len: int | None = None, prefill_tokens: int = 16384):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"NativeEngine supports {SUPPORTED_MODEL_TYPES}, got model_type={cfg.model_type!r}")
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ValueError("NativeEngine does not support sliding-window attention layers")
        rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if "dynamic" in rope_type or rope_type == "longrope":
            raise ValueError(f"NativeEngine does not support sequence-length dependent RoPE ({rope_type!r})")
        self.model = model
        self.max_slots = max_slots
        self.max_len = max_len or cfg.max_position_embeddings
        self.prefill_tokens = prefill_tokens
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scale = self.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        self._k = self._v = None  # KV cache, see class docstring
        self._cos = self._sin = None  # RoPE tables [length, head_dim] from the model's own rotary module (sin signed)

    # ------------------------------------------------------------------ public API

    def update_weights(self, state_dict: dict) -> None:
        """Copy `state_dict` (names as in `model.state_dict()`) into the model in place; a partial dict updates only
        its keys; unknown keys raise. Tied weights share one tensor, so either name updates both."""
        own = dict(self.model.named_parameters(remove_duplicate=False))
        own.update(self.model.named_buffers(remove_duplicate=False))
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise KeyError(f"update_weights: unknown keys {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        with torch.no_grad():
            for name, value in state_dict.items():
                own[name].copy_(value)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        on_group_done: GroupCallback | None = None,
        tool_hook: ToolHook | None = None,
    ) -> list[list[Generation]]:
        """Sample `params.n` responses per prompt with continuous batching; see `GenerationEngine.generate`.

        Requests (prompt i, sample j) are queued prompt-major; each finished sequence's slot is refilled with the next
        request at once, and `on_group_done(i, group)` fires as soon as prompt i's n samples are all finished.
        Reproducible for a fixed `params.seed` and engine configuration (one torch.Generator drives every draw).

        With `tool_hook`, a sequence whose response ends in a trigger gets the hook's tokens fed to it one per decode
        step, in place of sampled ones (the other sequences decode on meanwhile), then samples again. A hook may
        return an answer to come (an object with `done()` and `result()`, e.g. a concurrent.futures.Future): that
        sequence then waits, feeding nothing new, while the others decode on. With a hook, each sampled token's
        uniform is a hash of (seed, request, position) (`counter_uniforms`), so when a tool answers does not change
        what a sequence samples.
        """
        prompts = [list(map(int, p)) for p in prompts]
        results: list[list[Generation | None]] = [[None] * params.n for _ in prompts]
        if not prompts or params.n == 0:
            return results
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if min(map(len, prompts)) == 0:
            raise ValueError("every prompt needs at least one token")
        need_len = max(map(len, prompts)) + params.max_new_tokens
        if need_len > self.max_len:
            raise ValueError(f"prompt + max_new_tokens = {need_len} exceeds max_len = {self.max_len}")

        w = self._weights()
        dev = w["embed"].device
        n_req = len(prompts) * params.n
        S = min(self.max_slots, n_req)
        self._ensure_cache(S, need_len, w)
        gen = None if params.seed is None else torch.Generator(device=dev).manual_seed(params.seed)
        stop = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=dev)
        stop_set = set(stop.tolist())
        max_new = params.max_new_tokens

        # per-slot state: the token to feed next, cached length, tokens generated, outputs so far
        last_tok = torch.zeros(S, dtype=torch.long, device=dev)
        lens = torch.zeros(S, dtype=torch.long, device=dev)
        n_gen = torch.zeros(S, dtype=torch.long, device=dev)
        out_tok = torch.zeros(S, max_new, dtype=torch.long, device=dev)
        out_lp = torch.zeros(S, max_new, dtype=torch.float32, device=dev)
        slot_req: list[tuple[int, int] | None] = [None] * S  # (prompt_index, sample_index) per slot
        state = (last_tok, lens, n_gen, out_tok, out_lp)
        if tool_hook is not None:  # tokens to feed instead of sampling: force_buf[s, at:end]; where they went: 0
            triggers = [list(map(int, t)) for t in tool_hook.triggers]
            trigger_ends = torch.tensor(sorted({t[-1] for t in triggers}), dtype=torch.long, device=dev)
            force_buf = torch.zeros(S, max_new, dtype=torch.long, device=dev)
            force_at = torch.zeros(S, dtype=torch.long, device=dev)
            force_end = torch.zeros(S, dtype=torch.long, device=dev)
            out_mask = torch.ones(S, max_new, dtype=torch.int8, device=dev)
            # a request whose tool answer is not in yet: its slot feeds a dummy token each step without advancing
            hold = torch.zeros(S, dtype=torch.long, device=dev)
            waiting: dict[tuple[int, int], object] = {}  # request -> the hook's pending answer (done(), result())
            # draws by (seed, request, position): when a tool answers cannot change what a sequence samples
            req_id = torch.zeros(S, dtype=torch.long, device=dev)
            draw_seed = params.seed if params.seed is not None else int(torch.randint(2**31, ()))
            state += (force_buf, force_at, force_end, out_mask, hold, req_id)

        def draw(slots: torch.Tensor, logits: torch.Tensor):
            if tool_hook is None or params.temperature == 0:
                return sample_tokens(logits, params, gen)
            return sample_tokens(logits, params, gen, counter_uniforms(draw_seed, req_id[slots], n_gen[slots]))
        free = list(range(S))
        pending = deque((i, j) for i in range(len(prompts)) for j in range(params.n))
        n_done = [0] * len(prompts)

        def record(slots: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
            """Append one token per slot; finish slots that hit a stop token or max_new_tokens."""
            forced = None
            if tool_hook is not None:
                if waiting:  # answers come in; the slots still waiting record nothing this step
                    keep = take_answers(slots)
                    slots, tokens, logprobs = slots[keep], tokens[keep], logprobs[keep]
                pos = n_gen[slots]
                tokens, logprobs, forced = force_tokens(slots, pos, tokens, logprobs)
            else:
                pos = n_gen[slots]
            out_tok[slots, pos] = tokens
            out_lp[slots, pos] = logprobs
            n_gen[slots] = pos + 1
            last_tok[slots] = tokens
            done = pos + 1 >= max_new
            if len(stop):
                hit = torch.isin(tokens, stop)
                done |= hit if forced is None else hit & ~forced  # a tool's answer never ends a sequence
            if tool_hook is not None:
                call_tools(slots[~done & ~forced & torch.isin(tokens, trigger_ends)])
            if not bool(done.any()):
                return
            done_slots = slots[done]
            counts = n_gen[done_slots].tolist()
            toks, lps = out_tok[done_slots].tolist(), out_lp[done_slots].tolist()
            for s, c, t, lp in zip(done_slots.tolist(), counts, toks, lps):
                i, j = slot_req[s]
                slot_req[s] = None
                free.append(s)
                reason = "stop" if t[c - 1] in stop_set else "length"
                mask = out_mask[s, :c].tolist() if tool_hook is not None else None
                results[i][j] = Generation(i, j, prompts[i], t[:c], lp[:c], reason, loss_mask=mask)
                n_done[i] += 1
                if n_done[i] == params.n and on_group_done is not None:
                    with torch.inference_mode(False):
                        on_group_done(i, results[i])

        def force_tokens(slots, pos, tokens, logprobs):
            """Where a slot has a tool's answer to feed, its next token instead of the sampled one (logprob 0,
            loss mask 0) -> (tokens, logprobs, which were forced)."""
            forced = force_at[slots] < force_end[slots]
            if bool(forced.any()):
                fs = slots[forced]
                tokens, logprobs = tokens.clone(), logprobs.clone()
                tokens[forced] = force_buf[fs, force_at[fs]]
                logprobs[forced] = 0.0
                out_mask[fs, pos[forced]] = 0
                force_at[fs] += 1
            return tokens, logprobs, forced

        def call_tools(candidates) -> None:
            """Slots whose response now ends in a trigger: ask the hook; queue what it returns, or wait for it."""
            for s in candidates.tolist():
                c = int(n_gen[s])
                resp = out_tok[s, :c].tolist()
                if not any(len(t) <= c and resp[c - len(t):] == t for t in triggers):
                    continue
                answer = tool_hook(*slot_req[s], resp)
                if hasattr(answer, "done"):  # an answer to come: the slot holds once the trigger is cached
                    waiting[slot_req[s]] = answer
                else:
                    queue_answer(s, answer)

        def queue_answer(s: int, ids) -> None:
            c = int(n_gen[s])
            k = min(len(ids or ()), max_new - c)  # the answer counts against max_new_tokens
            if k:
                force_buf[s, :k] = torch.tensor(ids[:k], dtype=torch.long, device=dev)
                force_at[s], force_end[s] = 0, k

        def take_answers(slots) -> torch.Tensor:
            """Queue the answers that are in; -> which of `slots` record this step (not those still waiting)."""
            keep = torch.ones(len(slots), dtype=torch.bool, device=dev)
            for pos, s in enumerate(slots.tolist()):
                answer = waiting.get(slot_req[s])
                if answer is None:
                    continue
                if answer.done():
                    del waiting[slot_req[s]]
                    hold[s] = 0
                    ids = answer.result()
                    if not ids:  # this step fed a dummy: only an answer's first token can follow it
                        raise ValueError(f"tool hook: an answer that comes later must hold tokens; request "
                                         f"{slot_req[s]} got {ids!r}")
                    queue_answer(s, ids)
                else:
                    hold[s] = 1  # from the next step on it feeds a dummy at its length, without advancing
                    keep[pos] = False
            return keep

        while True:
            if pending and free:  # continuous batching: prefill waiting requests into free slots at once
                free.sort()
                take = [free.pop(0) for _ in range(min(len(pending), len(free)))]
                reqs = [pending.popleft() for _ in take]
                for s, r in zip(take, reqs):
                    slot_req[s] = r
                for slots, logits in self._prefill(w, prompts, take, reqs):
                    lens[slots] = torch.tensor([len(prompts[slot_req[s][0]]) for s in slots.tolist()], device=dev)
                    n_gen[slots] = 0
                    if tool_hook is not None:  # a new request in these slots: nothing to feed, every token its own
                        force_at[slots], force_end[slots], hold[slots] = 0, 0, 0
                        out_mask[slots] = 1
                        req_id[slots] = torch.tensor([i * params.n + j for i, j in (slot_req[s] for s in
                                                                                     slots.tolist())], device=dev)
                    tokens, logprobs = draw(slots, logits)
                    record(slots, tokens, logprobs)
                continue
            A = S - len(free)
            if A == 0:
                break
            if free and min(free) < A:  # no requests left: move active slots into the holes so they are [0, A)
                self._compact(slot_req, free, A, state)
            if tool_hook is not None and waiting and bool(hold[:A].all()):  # every sequence waits for a tool
                time.sleep(0.0005)
            logits = self._decode(w, last_tok[:A], lens[:A], int(lens[:A].max()) + 1)
            lens[:A] += 1 if tool_hook is None else 1 - hold[:A]
            active = torch.arange(A, device=dev)
            tokens, logprobs = draw(active, logits)
            record(active, tokens, logprobs)
        return results

    # ------------------------------------------------------------------ model forward

    def _weights(self) -> dict:
        """Fresh references to the model's parameter tensors (no copies)."""
        m = self.model
        layers = []
        for layer in m.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            layers.append(
                dict(
                    ln1=layer.input_layernorm.weight,
                    ln2=layer.post_attention_layernorm.weight,
                    q=(a.q_proj.weight, a.q_proj.bias),
                    k=(a.k_proj.weight, a.k_proj.bias),
                    v=(a.v_proj.weight, a.v_proj.bias),
                    o=(a.o_proj.weight, a.o_proj.bias),
                    gate=(mlp.gate_proj.weight, mlp.gate_proj.bias),
                    up=(mlp.up_proj.weight, mlp.up_proj.bias),
                    down=(mlp.down_proj.weight, mlp.down_proj.bias),
                    act=mlp.act_fn,
                )
            )
        model = m.model
        return dict(embed=model.embed_tokens.weight, norm=model.norm.weight, lm_head=m.lm_head.weight, layers=layers)

    def release_cache(self) -> None:
        """Free the KV cache and RoPE tables (a context switch off the device); the next `generate` rebuilds them."""
        self._k = self._v = self._cos = self._sin = None

    def _ensure_cache(self, slots: int, length: int, w: dict) -> None:
        """Allocate (or grow) the KV cache and RoPE tables to hold `slots` sequences of `length` tokens."""
        emb = w["embed"]
        if self._k is not None and self._k.device == emb.device and self._k.dtype == emb.dtype:
            if self._k.shape[1] >= slots and self._k.shape[3] >= length:
                return
            slots, length = max(slots, self._k.shape[1]), max(length, self._k.shape[3])
        self._k = self._v = None  # free the old cache before allocating the new one
        shape = (len(w["layers"]), slots, self.n_kv, length, self.head_dim)
        # zeros, not empty: masked-out cache entries must be finite (0 * NaN would poison the attention sum)
        self._k = torch.zeros(shape, dtype=emb.dtype, device=emb.device)
        self._v = torch.zeros(shape, dtype=emb.dtype, device=emb.device)
        pos = torch.arange(length, device=emb.device)[None]
        cos, sin = self.model.model.rotary_emb(self._k[0, :1, 0], pos)  # [1, length, head_dim]
        half = self.head_dim // 2
        self._cos, self._sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def _layer_out(self, x: torch.Tensor, attn: torch.Tensor, lw: dict) -> torch.Tensor:
        """Residual + o_proj, then the MLP block. x: [N, hidden]; attn: [N, heads * head_dim]."""
        x = _add_linear(x, attn, *lw["o"])
        h = _rms_norm(x, lw["ln2"], self.eps)
        return _add_linear(x, lw["act"](F.linear(h, *lw["gate"])) * F.linear(h, *lw["up"]), *lw["down"])

    def _logits(self, x: torch.Tensor, w: dict) -> torch.Tensor:
        """x: [R, hidden] -> fp32 logits [R, vocab]."""
        return F.linear(_rms_norm(x, w["norm"], self.eps), w["lm_head"]).float()

    def _prefill(self, w: dict, prompts: list[list[int]], slots: list[int], reqs: list[tuple[int, int]]):
        """Run the prompts of `reqs` into cache rows `slots`; yields (slot indices [R], next-token logits [R, V]).

        Samples of one prompt share one forward (its KV is written to each of their slots). Prompts are right-padded
        to the longest in their chunk: the causal mask alone keeps real tokens off the pads, and the pads' cache
        entries lie beyond the slot's length, masked until decode overwrites them.
        """
        dev = w["embed"].device
        by_prompt: dict[int, list[int]] = {}
        for s, (i, _) in zip(slots, reqs):
            by_prompt.setdefault(i, []).append(s)
        unique = sorted(by_prompt, key=lambda i: len(prompts[i]))  # similar lengths together: less padding
        start = 0
        while start < len(unique):  # chunks of at most prefill_tokens padded tokens (at least one prompt)
            end = start + 1
            while end < len(unique) and (end + 1 - start) * len(prompts[unique[end]]) <= self.prefill_tokens:
                end += 1
            chunk = unique[start:end]
            start = end
            T = len(prompts[chunk[-1]])
            ids = torch.tensor([prompts[i] + [0] * (T - len(prompts[i])) for i in chunk], device=dev)
            rows = [s for i in chunk for s in by_prompt[i]]
            inv = torch.tensor([u for u, i in enumerate(chunk) for _ in by_prompt[i]], device=dev)
            rows_t = torch.tensor(rows, device=dev)
            last = torch.tensor([len(prompts[i]) - 1 for i in chunk], device=dev)
            yield rows_t, self._prefill_forward(w, ids, rows_t, inv, last)

    def _prefill_forward(
        self, w: dict, ids: torch.Tensor, rows: torch.Tensor, inv: torch.Tensor, last: torch.Tensor
    ) -> torch.Tensor:
        """ids: [U, T] right-padded prompts; rows: [R] cache rows; inv: [R] prompt of each row; last: [U] last index.
        Writes KV at positions [0, T) of each row; returns logits [R, vocab] after each row's last prompt token."""
        U, T = ids.shape
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        cos, sin = self._cos[None, :T, None], self._sin[None, :T, None]  # [1, T, 1, D]
        x = F.embedding(ids.view(-1), w["embed"])  # [U * T, hidden]
        same_rows = len(rows) == U  # one sample per prompt, in order: no gather needed
        for l, lw in enumerate(w["layers"]):
            h = _rms_norm(x, lw["ln1"], self.eps)
            q = _rope(F.linear(h, *lw["q"]).view(U, T, H, D), cos, sin).transpose(1, 2)  # [U, H, T, D]
            k = _rope(F.linear(h, *lw["k"]).view(U, T, KV, D), cos, sin).transpose(1, 2)  # [U, KV, T, D]
            v = F.linear(h, *lw["v"]).view(U, T, KV, D).transpose(1, 2)
            self._k[l, rows, :, :T] = k if same_rows else k[inv]
            self._v[l, rows, :, :T] = v if same_rows else v[inv]
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=H != KV)
            x = self._layer_out(x, attn.transpose(1, 2).reshape(U * T, H * D), lw)
        return self._logits(x.view(U, T, -1)[torch.arange(U, device=ids.device), last], w)[inv]

    def _decode(self, w: dict, tokens: torch.Tensor, lens: torch.Tensor, width: int) -> torch.Tensor:
        """One decode step for cache rows [0, A).

        tokens: [A] next input token; lens: [A] cached length (= its position); width: attend over cache [0, width),
        >= max(lens) + 1. Writes KV at `lens`; returns logits [A, vocab]. GQA without copying the cache: queries are
        viewed as [A, kv_heads, group, D] against keys [A, kv_heads, width, D].
        """
        A = tokens.shape[0]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        rows = torch.arange(A, device=tokens.device)
        cos, sin = self._cos[lens][:, None], self._sin[lens][:, None]  # [A, 1, D]
        masked = torch.arange(width, device=tokens.device)[None] > lens[:, None]  # [A, width]: not yet cached
        masked = masked[:, None, None]
        x = F.embedding(tokens, w["embed"])  # [A, hidden]
        for l, lw in enumerate(w["layers"]):
            h = _rms_norm(x, lw["ln1"], self.eps)
            q = _rope(F.linear(h, *lw["q"]).view(A, H, D), cos, sin)
            k = _rope(F.linear(h, *lw["k"]).view(A, KV, D), cos, sin)
            self._k[l][rows, :, lens] = k
            self._v[l][rows, :, lens] = F.linear(h, *lw["v"]).view(A, KV, D)
            keys, values = self._k[l, :A, :, :width], self._v[l, :A, :, :width]  # [A, KV, width, D]
            scores = torch.matmul(q.view(A, KV, H // KV, D), keys.transpose(-1, -2)) * self.scale
            probs = scores.masked_fill_(masked, -math.inf).float().softmax(-1).to(x.dtype)  # [A, KV, group, width]
            attn = torch.matmul(probs, values).reshape(A, H * D)
            x = self._layer_out(x, attn, lw)
        return self._logits(x, w)

    def _compact(self, slot_req: list, free: list[int], A: int, state: tuple[torch.Tensor, ...]) -> None:
        """Move the active slots at index >= A into the free slots below A (cache rows and the per-slot `state`
        tensors, slot-major), so that decode runs over the prefix [0, A)."""
        holes = sorted(s for s in free if s < A)
        movers = [s for s in range(A, len(slot_req)) if slot_req[s] is not None]
        dev = self._k.device
        dst, src = torch.tensor(holes, device=dev), torch.tensor(movers, device=dev)
        for cache in (self._k, self._v):
            cache[:, dst] = cache[:, src]
        for t in state:
            t[dst] = t[src]
        for d, s in zip(holes, movers):
            slot_req[d], slot_req[s] = slot_req[s], None
        free[:] = list(range(A, len(slot_req)))
