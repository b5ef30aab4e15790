"""Training precision: which dtype the trained weights (and so the optimizer state) are kept in, and which dtype the
forward and backward passes compute in.

- float32: both float32.
- bf16 mixed precision (`model.dtype: bfloat16`, `model.mixed_precision: true`, the default): the trained weights and
  the optimizer state stay float32 (the master copy) and the passes compute in bf16 under `torch.autocast` (matmuls in
  bf16, reductions and norms in float32, gradients reaching the float32 weights), as TRL/Accelerate do with `bf16`. The
  copies that only generate or score (rollout, inference) hold bf16 weights; a weight sync sends the master weights
  rounded to bf16, which is what those copies hold, so a checked sync still compares bit for bit.
- pure bf16 (`model.mixed_precision: false`): the trained weights themselves are bf16.

A sharded (FSDP2) model autocasts the same way over float32 shards, so that it computes what one process computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    weights: torch.dtype  # the trained (master) weights and the optimizer state
    compute: torch.dtype  # the forward and backward passes

    @property
    def mixed(self) -> bool:
        return self.weights != self.compute

    def autocast(self, model: torch.nn.Module):
        """Around a forward pass of `model` (on its device type): autocast to the compute dtype when mixed."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(next(model.parameters()).device.type, dtype=self.compute)

    def published(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) items of the trained state as the policy's other copies hold them: floating tensors
        rounded to the compute dtype when mixed, else as they are."""
        for name, t in items:
            yield name, (t.to(self.compute) if self.mixed and t.is_floating_point() else t)


def training_precision(dtype: str, mixed: bool) -> Precision:
    """The precision of a trained copy of a model whose configured dtype is `dtype` (`model.dtype`): float32 master
    weights computing in `dtype` when `mixed`, else weights and compute both in `dtype`."""
    compute = getattr(torch, dtype)
    return Precision(torch.float32 if mixed else compute, compute)
