"""Batch: the data vocabulary shared by workers, channels and flows — a dict of tensors with a common
leading dimension plus plain-Python meta. It carries data; it computes nothing RL-specific.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch


@dataclass
class Batch:
    """`tensors[k]` all share dim 0 (the sample axis, size `len(batch)`); `meta` holds per-batch values."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch tensors disagree on their leading dimension: {sizes}")

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0] if self.tensors else 0

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(f"Batch has no tensor '{key}'; it has: {', '.join(self.tensors)}") from None

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if self.tensors and value.shape[0] != len(self):
            raise ValueError(f"tensor '{key}' has {value.shape[0]} rows; the batch has {len(self)}")
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def select(self, index: torch.Tensor | Sequence[int] | slice) -> "Batch":
        """Rows `index` of every tensor (a slice, index list or bool mask)."""
        if not isinstance(index, (slice, torch.Tensor)):
            index = torch.as_tensor(list(index), dtype=torch.long)
        return Batch({k: v[index] for k, v in self.tensors.items()}, dict(self.meta))

    def split(self, size: int) -> list["Batch"]:
        """Consecutive chunks of at most `size` rows."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Sequence["Batch"], pad_value: dict[str, float] | None = None) -> "Batch":
        """Stack batches along dim 0; tensors with different trailing length (dim 1) are right-padded
        with `pad_value[key]` (default 0). Meta comes from the first batch."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        keys = list(batches[0].tensors)
        for b in batches[1:]:
            if list(b.tensors) != keys:
                raise ValueError(f"Batch.concat: key mismatch {keys} vs {list(b.tensors)}")
        out = {}
        for k in keys:
            parts = [b.tensors[k] for b in batches]
            if parts[0].dim() >= 2:
                width = max(p.shape[1] for p in parts)
                fill = (pad_value or {}).get(k, 0)
                parts = [
                    torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, width - p.shape[1]), value=fill)
                    if p.shape[1] < width else p
                    for p in parts
                ]
            out[k] = torch.cat(parts, dim=0)
        return Batch(out, dict(batches[0].meta))

    def to(self, device: str | torch.device) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.meta))
