"""Shared helpers of the algorithms package: masks, group indices, loss aggregation, name lookup.
Pure tensor functions on torch only; nothing here knows about workers, devices or flows."""

from __future__ import annotations

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def lookup(table: dict, kind: str, name: str):
    """table[name], or ValueError("unknown {kind} 'name'; valid: a, b, c")."""
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(table))}")
    return table[name]


def as_mask(mask: Tensor | None, like: Tensor) -> Tensor:
    """mask[*S] (bool, or 0/1 numbers) or None -> bool[*S]; None means every element is valid.

    The shape must equal like.shape exactly (no broadcasting: a silent broadcast hides bugs)."""
    if mask is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device)
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != data shape {tuple(like.shape)}")
    return mask != 0


def masked_mean(x: Tensor, mask: Tensor | None, dim: int | None = None) -> Tensor:
    """Mean of x[*S] over mask[*S] (all of it, or along `dim`); 0 where nothing is valid.

    Masked-out elements of x may hold anything (nan, inf): they never reach the result."""
    m = as_mask(mask, x)
    total = torch.where(m, x, torch.zeros_like(x))
    if dim is None:
        return total.sum() / m.sum().clamp(min=1)
    return total.sum(dim) / m.sum(dim).clamp(min=1)


def masked_std(x: Tensor, mask: Tensor | None) -> Tensor:
    """Unbiased (Bessel-corrected) std of the valid elements of x[*S] -> 0-dim; 0 if fewer than 2."""
    m = as_mask(mask, x)
    n = m.sum()
    centered = torch.where(m, x - masked_mean(x, m), torch.zeros_like(x))
    var = centered.pow(2).sum() / (n - 1).clamp(min=1)
    return torch.where(n > 1, var.sqrt(), torch.zeros_like(var))


def aggregate(values: Tensor, mask: Tensor | None, mode: str = "token-mean",
              denom: float | None = None) -> Tensor:
    """Reduce per-token values[B, T] to a 0-dim loss over the valid tokens of mask[B, T].

    token-mean:          sum of valid values / number of valid tokens (any shape works).
    seq-mean-token-sum:  per sequence the sum over its valid tokens, then the mean over sequences.
    seq-mean-token-mean: per sequence the mean over its valid tokens, then the mean over sequences.
    Sequences (rows) with no valid token are padding: they are not counted. An all-masked batch
    gives 0 (with a gradient path), never nan. `denom` replaces the count in the final division
    (tokens for token-mean, sequences for seq-*): pass the count of the whole mini-batch when a
    loss is summed over its micro-batches, so that the sum equals the loss of the whole batch.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGG_MODES)}")
    m = as_mask(mask, values)
    v = torch.where(m, values, torch.zeros_like(values))
    if mode == "token-mean":
        count = m.sum().clamp(min=1) if denom is None else denom
        return v.sum() / count
    if values.dim() != 2:
        raise ValueError(f"{mode} needs values of shape [B, T], got {tuple(values.shape)}")
    per_seq = v.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / m.sum(-1).clamp(min=1)
    count = m.any(-1).sum().clamp(min=1) if denom is None else denom
    return per_seq.sum() / count


def group_index(groups: int | Tensor, n: int, device: torch.device | None = None) -> tuple[Tensor, int]:
    """Group membership of n samples -> (index LongTensor[n] with values in [0, G), G).

    groups is either an int k (the group size: samples [0, k) are group 0, [k, 2k) group 1, ...;
    n must be a multiple of k) or a tensor[n] of integer group ids (any values, any order)."""
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 1 or n % groups:
            raise ValueError(f"group size {groups} must be >= 1 and divide the batch size {n}")
        return torch.arange(n, device=device) // groups, n // groups
    if not isinstance(groups, Tensor) or groups.shape != (n,) or groups.is_floating_point() \
            or groups.dtype == torch.bool:
        raise ValueError(f"groups must be an int group size or an integer tensor of shape [{n}] "
                         f"with one group id per sample, got {groups!r}")
    ids, index = torch.unique(groups, return_inverse=True)
    return index.to(device) if device is not None else index, ids.numel()


def as_flag(x: Tensor, like: Tensor, name: str) -> Tensor:
    """A done-style flag tensor (bool or 0/1 numbers) with like's shape -> bool tensor."""
    if x.shape != like.shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} != {tuple(like.shape)}")
    return x != 0
