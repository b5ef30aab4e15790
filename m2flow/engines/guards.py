"""Guards that keep a training step from turning a model into silent garbage (both actors use them): a non-finite
loss or gradient is found before the update is applied and named; an update that blows the weights up (a learning
rate far too high wrecks a model without any NaN: the policy saturates, every gradient becomes 0) stops the run.
What to do about a non-finite update is `actor.nonfinite` (stop | skip); the growth bound is `actor.max_weight_growth`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) parameter or gradient; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def sum_of_squares(tensors: Iterable[torch.Tensor]) -> float:
    """sum(t**2) over every element of `tensors` (of a sharded model: this rank's shards; all-reduce for the whole)."""
    norms = [torch.linalg.vector_norm(_local(t).detach().float()) for t in tensors]
    return float(torch.stack(norms).square().sum()) if norms else 0.0


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """The name of the first tensor holding NaN or inf (None entries are skipped), or None."""
    for name, t in named:
        if t is not None and not bool(torch.isfinite(_local(t)).all()):
            return name
    return None


def nonfinite_update(norm: float, culprit: str | None, policy: str, component: str = "actor") -> None:
    """For a gradient whose norm is not finite: raise (policy `stop`) naming the first non-finite tensor, or return
    so that the caller drops the update (policy `skip`)."""
    if policy == "stop":
        raise FloatingPointError(
            f"{component}: non-finite gradient (norm {norm}), first non-finite: {culprit or 'unknown'}; the update was "
            f"not applied. Lower {component}.lr, or set {component}.nonfinite=skip to drop such updates and go on")


def check_weight_growth(before: float, after: float, limit: float, lr: float, component: str = "actor") -> None:
    """Stop when the weights' norm went non-finite or grew more than `limit` times in one training step (`limit` 0:
    only the non-finite check). `before`, `after`: the norms around the step."""
    if not math.isfinite(after):
        raise FloatingPointError(f"{component}: the weights are not finite after this step (norm {after}); the run "
                                 f"stops (the last checkpoint is intact). Lower {component}.lr")
    if limit and before > 0 and after > limit * before:
        raise FloatingPointError(
            f"{component}: one training step multiplied the norm of the weights by {after / before:.3g} (from "
            f"{before:.4g} to {after:.4g}; {component}.max_weight_growth={limit:g}): {component}.lr={lr:g} is far too "
            f"high for this model. The run stops rather than train a wrecked model (the last checkpoint is intact)")
