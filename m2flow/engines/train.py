"""Training-side math on HF causal LMs: batch collation, per-token logprobs/entropy, and a small SFT loop.

Pure torch on a model object: no runtime, no distributed code, no RL losses (those live in m2flow.algorithms).
"""

from __future__ import annotations

import functools
import inspect
import math
import random
from typing import NamedTuple, Sequence

import torch


def collate(samples: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad (prompt_ids, response_ids) pairs into one batch.

    Row b is `prompt + response + pad...`; with P = len(prompt), R = len(response), L = max(P + R):
      input_ids      [B, L] long   tokens, pad_id after P + R
      attention_mask [B, L] long   1 on the P + R real tokens
      response_mask  [B, L] float  1 at positions P .. P+R-1, i.e. where the token is a response token
      position_ids   [B, L] long   0 .. L-1 (right padding keeps every real token at its true position)
    Masks are *token-aligned*: `token_logprobs(...)[b, t]` is log π(input_ids[b, t] | input_ids[b, :t]),
    the logprob of the token sitting at t, predicted by the logits at t-1. So a response's logprobs are
    `out[b, P:P+R]`, in the same order as `Generation.logprobs`.
    """
    if not samples:
        raise ValueError("collate: no samples")
    for i, (prompt, _) in enumerate(samples):
        if len(prompt) == 0:
            raise ValueError(f"collate: sample {i} has an empty prompt (the first response token needs a prefix)")
    prompt_lens = torch.tensor([len(p) for p, _ in samples])
    lengths = prompt_lens + torch.tensor([len(r) for _, r in samples])
    B, L = len(samples), int(lengths.max())
    cols = torch.arange(L).expand(B, L)
    real = cols < lengths[:, None]  # [B, L] bool; filled row by row, i.e. in the order of the flat token list
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    input_ids[real] = torch.tensor([t for p, r in samples for t in (*p, *r)], dtype=torch.long)
    attention_mask = real.long()
    response_mask = (real & (cols >= prompt_lens[:, None])).float()
    position_ids = cols.clone()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "position_ids": position_ids,
    }


def _first_needed(batch: dict[str, torch.Tensor]) -> int:
    """The first position whose logits predict a response token: the earliest response start minus one."""
    cols = batch["response_mask"].any(dim=0).nonzero()
    return max(int(cols[0]) - 1, 0) if len(cols) else 0


@functools.lru_cache(maxsize=None)
def _keeps_logits(model_type: type) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model_type.forward).parameters
    except (TypeError, ValueError):
        return False


def _logits(model, batch: dict[str, torch.Tensor], start: int = 0) -> torch.Tensor:
    """Forward pass -> logits [B, L - start, V] of positions start..L-1 (logits[:, j] predict the token at
    start + j + 1). Models that take `logits_to_keep` (HF Llama/Qwen family) project only those positions
    onto the vocabulary; the prompt's hidden states never meet the (often huge) output layer."""
    device = next(model.parameters()).device
    keep = {"logits_to_keep": batch["input_ids"].shape[1] - start} if start and _keeps_logits(type(model)) else {}
    out = model(
        input_ids=batch["input_ids"].to(device),
        attention_mask=batch["attention_mask"].to(device),
        position_ids=batch["position_ids"].to(device) if "position_ids" in batch else None,
        use_cache=False,
        **keep,
    )
    return out.logits if keep else out.logits[:, start:]


CHUNK_BYTES = 64 << 20  # the float32 [rows, L, V] temporaries of the logprob math stay about this size


def _shifted_stats(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, with_entropy: bool, start: int = 0,
    entropy_grad: bool = True, chunk_bytes: int = CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, L - start, V] of positions start..L-1, input_ids [B, L] -> token-aligned logprobs [B, L] (and
    entropy [B, L]); columns 0..start are 0.

    logprob = z[token] - logsumexp(z) with z = logits / temperature, in float32, as many rows at a time as fit
    `chunk_bytes` (one row at least), so that only one such temporary exists besides the logits: a large vocabulary
    is taken a few rows at a time, a small one in one piece. `entropy_grad=False`: the entropy is a
    metric only, computed without building a graph.
    """
    B, T, V = logits.shape
    chunk_rows = max(1, chunk_bytes // max(1, T * V * 4))
    targets = input_ids[:, start + 1:].to(logits.device)
    logps, ents = [], []
    for first in range(0, B, chunk_rows):
        z = logits[first : first + chunk_rows, :-1].float()  # [b, L-1-start, V]
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        logps.append(z.gather(-1, targets[first : first + chunk_rows, :, None]).squeeze(-1) - lse)
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ents.append(lse - (torch.softmax(z, dim=-1) * z).sum(-1))
    zero = logits.new_zeros((B, start + 1), dtype=torch.float32)
    logp = torch.cat([zero, torch.cat(logps)], dim=1)
    ent = torch.cat([zero, torch.cat(ents)], dim=1) if with_entropy else None
    return logp, ent


def token_logprobs(model, batch: dict[str, torch.Tensor], temperature: float = 1.0,
                   share_prompts: bool = False) -> torch.Tensor:
    """[B, L] float32: log π(input_ids[b, t] | input_ids[b, :t]) at response positions, 0 elsewhere.

    π is softmax(logits / temperature), the same distribution `HFEngine` reports logprobs under.
    Differentiable: call under torch.no_grad() for inference-only use. `share_prompts`: see `shared_prompt_logits`.
    """
    return _response_stats(model, batch, temperature, False, True, share_prompts)[0]


def token_logprobs_and_entropy(
    model, batch: dict[str, torch.Tensor], temperature: float = 1.0, entropy_grad: bool = True,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, L] logprobs, [B, L] entropy), both token-aligned and 0 outside the response.

    entropy[b, t] is the entropy of the distribution that sampled the token at t (logits at t-1). With
    `entropy_grad=False` it carries no gradient (a metric: no graph built for it). `share_prompts`: see
    `shared_prompt_logits`.
    """
    return _response_stats(model, batch, temperature, True, entropy_grad, share_prompts)


def _response_stats(model, batch, temperature, with_entropy, entropy_grad, share_prompts):
    mask = batch["response_mask"]
    parts = shared_prompt_logits(model, batch) if share_prompts else None
    if parts is None:  # every row forwards its whole sequence
        start = _first_needed(batch)
        logp, ent = _shifted_stats(_logits(model, batch, start), batch["input_ids"], temperature, with_entropy,
                                   start=start, entropy_grad=entropy_grad)
    else:  # each row forwarded its own tokens only; put their figures back at their columns of the batch
        logp = torch.zeros(mask.shape, dtype=torch.float32, device=parts[0].logits.device)
        ent = torch.zeros_like(logp) if with_entropy else None
        for part in parts:
            own_lp, own_ent = _shifted_stats(part.logits, part.own_ids, temperature, with_entropy,
                                             entropy_grad=entropy_grad)
            keep = part.valid.clone()
            keep[:, 0] = False  # own column 0 is the prompt's last token: predicted by the shared part
            where = (part.rows[:, None].expand_as(part.cols), part.cols)
            logp = logp.index_put(where, own_lp * keep, accumulate=True)
            if with_entropy:
                ent = ent.index_put(where, own_ent * keep, accumulate=True)
    mask = mask.to(logp.device)
    return logp * mask, (ent * mask if with_entropy else None)


@functools.lru_cache(maxsize=None)
def _cache_argument(model_type: type) -> str | None:
    """The name under which the model's forward takes a KV cache (`cache`, formerly `past_key_values`), or None."""
    try:
        params = inspect.signature(model_type.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def _cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer of an HF DynamicCache (transformers 5: `layers`; 4: `key_cache` / `value_cache`)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


BUCKET_COST = 0.05  # a further pass over the responses is taken when it saves more than this share of the padded tokens


def length_buckets(widths: Sequence[int], pass_cost: float = BUCKET_COST) -> list[int]:
    """Cut rows sorted by width (ascending) into contiguous buckets, each padded to its widest row, minimising the
    padded tokens plus `pass_cost` x (all rows x the widest width) per bucket (the fixed cost of one more pass).
    Returns each bucket's end (exclusive): [len(widths)] when one pass is best."""
    n = len(widths)
    if n == 0:
        return []
    ends = [i + 1 for i in range(n) if i + 1 == n or widths[i + 1] != widths[i]]  # a bucket never splits a width
    fixed = pass_cost * n * widths[-1]
    best = {0: (0.0, [])}  # rows covered -> (cost, bucket ends)
    for end in ends:
        best[end] = min(((best[lo][0] + (end - lo) * widths[end - 1] + fixed, best[lo][1] + [end])
                         for lo in best if lo < end), key=lambda x: x[0])
    return best[n][1]


class SharedPart(NamedTuple):
    """One pass over some rows' own tokens: `logits[:, j]` predict `own_ids[:, j + 1]`; `own_ids[i, j]` is the token
    at column `cols[i, j]` of batch row `rows[i]` (j = 0: the prompt's last token); `valid` marks real tokens."""
    rows: torch.Tensor
    logits: torch.Tensor
    own_ids: torch.Tensor
    cols: torch.Tensor
    valid: torch.Tensor


def shared_prompt_logits(model, batch: dict[str, torch.Tensor]) -> list[SharedPart] | None:
    """Forward each distinct prompt of `batch` once, then every row's own tokens against the prompt's keys and values.

    A GRPO batch holds n responses to every prompt; the plain pass runs the prompt through the model n times. Here the
    prompt minus its last token (the shared part) runs once per distinct prompt, with a KV cache; the cache's rows are
    copied out to the batch's rows (a differentiable gather, so each prompt's gradient is the sum over its responses),
    and each row forwards its own part: the prompt's last token and the response, at their true positions, attending
    to the shared part. Rows of similar response length share a pass (`length_buckets`), so that a few long responses
    do not pad every row. The logits equal the plain pass's to float rounding; the prompt tokens go through the model
    once per group instead of once per sample.

    Returns the passes (`SharedPart`), or None where sharing saves nothing (no prompt repeats, one-token prompts) or
    the model's forward takes no KV cache (then the caller runs the plain pass).
    """
    cache_arg = _cache_argument(type(model))
    if cache_arg is None:
        return None
    from transformers import DynamicCache  # engines/hf already depends on transformers; imported on first use

    ids, response = batch["input_ids"], batch["response_mask"]
    B, L = ids.shape
    resp_len = response.sum(1).long()
    shared_len = batch["attention_mask"].sum(1).long() - resp_len - 1  # the prompt without its last token
    S = int(shared_len.max())
    if S <= 0:
        return None
    cols_s = torch.arange(S, device=ids.device)  # the batch's device (a worker moves it to its GPU)
    shared_mask = cols_s < shared_len[:, None]
    keys = torch.cat([torch.where(shared_mask, ids[:, :S], 0), shared_len[:, None]], 1)
    distinct, row_of = torch.unique(keys, dim=0, return_inverse=True)
    if len(distinct) == B:
        return None
    device = next(model.parameters()).device
    prompts = DynamicCache()
    model(input_ids=distinct[:, :S].to(device), attention_mask=(cols_s < distinct[:, S:]).long().to(device),
          position_ids=cols_s.expand(len(distinct), S).to(device), use_cache=True, logits_to_keep=1,
          **{cache_arg: prompts})
    width = 1 + resp_len  # own tokens: the prompt's last one and the response
    order = torch.argsort(width, stable=True)
    shared = _cache_tensors(prompts)
    parts, lo = [], 0
    for hi in length_buckets(width[order].tolist(), BUCKET_COST):
        rows, lo = order[lo:hi], hi
        cache, pick = DynamicCache(), row_of[rows].to(device)  # the bucket's rows of the distinct prompts' cache
        for layer, (k, v) in enumerate(shared):
            cache.update(k[pick], v[pick], layer)
        T = int(width[rows].max())
        j = torch.arange(T, device=ids.device)
        valid = j < width[rows, None]
        pos = shared_len[rows, None] + j
        cols = pos.clamp(max=L - 1)  # clamped columns are padding (not valid)
        own_ids = torch.where(valid, ids[rows].gather(1, cols), 0)
        out = model(input_ids=own_ids.to(device),
                    attention_mask=torch.cat([shared_mask[rows], valid], 1).long().to(device),
                    position_ids=pos.to(device), use_cache=True, **{cache_arg: cache})
        parts.append(SharedPart(rows.to(device), out.logits, own_ids.to(device), cols.to(device), valid.to(device)))
    return parts


def sft(
    model,
    tokenizer,
    pairs: Sequence[tuple[str, str]],
    steps: int,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
    warmup_steps: int | None = None,
    schedule: str = "cosine",
    weight_decay: float = 0.0,
    target_accuracy: float = 0.0,
    accuracy_window: int = 10,
    val_pairs: Sequence[tuple[str, str]] | None = None,
    val_every: int = 25,
) -> list[float]:
    """Fine-tune on prompt -> answer + eos with the loss on answer (and eos) tokens only; returns per-step losses.

    Each step samples `batch_size` pairs (seeded, without replacement within an epoch), AdamW,
    linear warmup (5% of the steps when None) then cosine decay to 10% of lr (`schedule="constant"` keeps
    lr flat after warmup). With `target_accuracy` > 0 it stops early, the schedule still spanning `steps`: with
    `val_pairs` (held back from `pairs`) after the first multiple of `val_every` steps at which their greedy exact
    match (`exact_match`) reaches it; without, after the first step at which the training batches' exact match
    (`batch_exact_match`), averaged over the last `accuracy_window` steps, does. Leaves the model in eval mode.
    """
    if not pairs:
        raise ValueError("sft: no (prompt, answer) pairs")
    if schedule not in ("cosine", "constant"):
        raise ValueError(f"sft: schedule must be 'cosine' or 'constant', got {schedule!r}")
    if not 0.0 <= target_accuracy <= 1.0:
        raise ValueError(f"sft: target_accuracy must be in [0, 1], got {target_accuracy}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("sft: the tokenizer has no eos_token_id (needed to end answers)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    encoded = _encode_pairs(tokenizer, pairs)
    held_out = collate(_encode_pairs(tokenizer, val_pairs), pad) if target_accuracy and val_pairs else None

    warmup = steps // 20 if warmup_steps is None else warmup_steps
    rng = random.Random(seed)
    order: list[int] = []
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    losses: list[float] = []
    matches: list[float] = []
    recent = 0.0
    with _progress(progress, steps, "held-out" if held_out is not None else "exact match") as advance:
        for step in range(steps):
            for group in optim.param_groups:
                group["lr"] = lr * _lr_factor(step, steps, warmup, schedule)
            if len(order) < batch_size:
                fresh = list(range(len(encoded)))
                rng.shuffle(fresh)
                order.extend(fresh)
            idx, order = order[:batch_size], order[batch_size:]
            batch = collate([encoded[i] for i in idx], pad)
            start = _first_needed(batch)
            logits = _logits(model, batch, start)
            logp = _shifted_stats(logits, batch["input_ids"], 1.0, False, start=start)[0]
            mask = batch["response_mask"].to(logp.device)
            loss = -(logp * mask).sum() / mask.sum()
            matches.append(batch_exact_match(logits.detach(), batch, start))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            losses.append(loss.item())
            if held_out is not None:
                if (step + 1) % val_every == 0:
                    recent = _batch_accuracy(model, held_out)
                    model.train()
                reached = (step + 1) % val_every == 0 and recent >= target_accuracy
            else:
                recent = sum(matches[-accuracy_window:]) / len(matches[-accuracy_window:])
                reached = bool(target_accuracy) and len(matches) >= accuracy_window and recent >= target_accuracy
            advance(loss.item(), recent)
            if reached:
                break
    model.eval()
    return losses


def batch_exact_match(logits: torch.Tensor, batch: dict[str, torch.Tensor], start: int = 0) -> float:
    """The share of a batch's rows whose every response token is the argmax of the logits before it (teacher
    forcing): the rows greedy decoding would answer exactly (answer and eos), read off the training pass's logits.
    `logits` [B, L - start, V] as `_logits` returns them."""
    targets = batch["input_ids"][:, start + 1:].to(logits.device)
    scored = batch["response_mask"][:, start + 1:].to(logits.device).bool()
    right = (logits[:, :-1].argmax(-1) == targets) | ~scored
    return right.all(dim=1).float().mean().item()


def exact_match(model, tokenizer, pairs: Sequence[tuple[str, str]]) -> float:
    """The share of (prompt, answer) pairs that greedy decoding answers exactly (answer, then eos), read off one
    teacher-forced pass (`batch_exact_match`). Leaves the model in eval mode."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return _batch_accuracy(model, collate(_encode_pairs(tokenizer, pairs), pad))


def _batch_accuracy(model, batch: dict[str, torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        start = _first_needed(batch)
        return batch_exact_match(_logits(model, batch, start), batch, start)


def _encode_pairs(tokenizer, pairs: Sequence[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    return [(_encode(tokenizer, p), _encode(tokenizer, a) + [tokenizer.eos_token_id]) for p, a in pairs]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _lr_factor(step: int, steps: int, warmup: int, schedule: str) -> float:
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


class _progress:
    """Context manager yielding advance(loss, exact_match): a rich progress bar when enabled, else a no-op."""

    def __init__(self, enabled: bool, total: int, what: str = "exact match"):
        self.enabled, self.total, self.what = enabled, total, what

    def __enter__(self):
        if not self.enabled:
            return lambda loss, match: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("sft"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn(self.what + " {task.fields[match]:.0%}"), TimeRemainingColumn(),
        )
        self.bar.start()
        task = self.bar.add_task("sft", total=self.total, loss=float("nan"), match=0.0)
        return lambda loss, match: self.bar.update(task, advance=1, loss=loss, match=match)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()
        return False
