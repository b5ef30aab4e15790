"""DAPO data shaping: dynamic sampling (drop groups without signal), overlong-response penalty and filter.
Pure functions that pick and reshape data; generating more to refill a batch is the flow's job."""

from __future__ import annotations

import torch
from torch import Tensor

from .common import group_index


@torch.no_grad()
def filter_groups(scores: Tensor, groups: int | Tensor,
                  max_groups: int | None = None) -> tuple[Tensor, dict[str, int]]:
    """Dynamic sampling: scores[B], groups (group size or group id per sample [B]) ->
    (index LongTensor[K] of the samples to keep, in their original order; info).

    A group whose scores are all equal (all solved, all failed, or a group of one) has zero
    group-relative advantage and is dropped. max_groups keeps only the first max_groups surviving
    groups (by first appearance), so a flow refilling towards a target takes exactly what it lacks:

        kept, have = [], 0
        while have < target_groups:
            batch = generate_and_score(...)
            idx, info = filter_groups(batch["scores"], group_size, max_groups=target_groups - have)
            kept.append(batch.select(idx)); have += info["selected_groups"]

    info (python ints): groups, kept_groups, dropped_groups (= groups - kept_groups, before the
    max_groups cut) and selected_groups (the kept groups actually returned)."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got {tuple(scores.shape)}")
    if max_groups is not None and max_groups < 0:
        raise ValueError(f"max_groups must be >= 0, got {max_groups}")
    index, g = group_index(groups, scores.shape[0], scores.device)
    s = scores.float() if not scores.is_floating_point() else scores
    empty = torch.zeros(g, dtype=s.dtype, device=s.device)
    hi = empty.clone().scatter_reduce_(0, index, s, "amax", include_self=False)
    lo = empty.clone().scatter_reduce_(0, index, s, "amin", include_self=False)
    keep_group = hi != lo                                                                 # [G]
    kept = int(keep_group.sum())
    first = torch.full((g,), scores.shape[0], dtype=torch.long, device=s.device)
    first = first.scatter_reduce_(0, index, torch.arange(scores.shape[0], device=s.device), "amin")
    order = first.argsort()                               # group ids by first appearance in the batch
    chosen = order[keep_group[order]][:max_groups]        # [:None] keeps all
    selected = torch.zeros_like(keep_group)
    selected[chosen] = True
    idx = torch.nonzero(selected[index]).flatten()
    info = {"groups": g, "kept_groups": kept, "dropped_groups": g - kept,
            "selected_groups": int(selected.sum())}
    return idx, info


@torch.no_grad()
def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment: response lengths[B] -> penalty[B] (<= 0) to add to the scores.

    0 up to max_len - cache_len, then linear down to -factor at max_len, and -factor beyond:
        p = factor * min(0, max(-1, (max_len - cache_len - L) / cache_len))"""
    if not (0 < cache_len <= max_len):
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    expected = max_len - cache_len
    slope = (expected - lengths.to(torch.float32)) / cache_len
    return factor * slope.clamp(-1.0, 0.0)


@torch.no_grad()
def overlong_filter(mask: Tensor, truncated: Tensor) -> Tensor:
    """DAPO overlong filtering: mask[B, T], truncated[B] (hit the length limit without EOS) ->
    mask[B, T] (same dtype) with the truncated responses' tokens masked out of the loss."""
    if mask.dim() != 2 or truncated.shape != mask.shape[:1]:
        raise ValueError(f"need mask [B, T] and truncated [B], got {tuple(mask.shape)}, "
                         f"{tuple(truncated.shape)}")
    keep = (truncated == 0)[:, None]
    return torch.where(keep, mask, torch.zeros_like(mask))
