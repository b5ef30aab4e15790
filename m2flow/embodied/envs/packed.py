"""Packed observations: several named arrays of fixed shapes and dtypes (a camera frame, the robot's state, the task's
instruction) laid out in one uint8 row, so that everything an env worker, a channel, a trajectory or a replay buffer
does to an observation (stack it, slice it, cat it along the env axis, send it, keep it in shared memory, compress
it) it does to one contiguous array, as for a state vector. A frame stays uint8 the whole way (no float copy of it
exists before the policy's first layer), and the policy reads each field as a view of the row (`PackedLayout.unpack`:
no copy).

The fields are laid out in the order given, each at an offset aligned to 8 bytes, and the row is padded to a multiple of
8, so that a row of any [B, nbytes] batch views as its fields' dtypes in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from gymnasium import spaces

ALIGN = 8
_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32}


@dataclass(frozen=True)
class Field:
    name: str
    dtype: str  # a numpy dtype name: uint8, float32 or int32
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


class PackedLayout:
    """Where each field lies in a packed row. `PackedLayout([Field("state", "float32", (48,)), ...])`."""

    def __init__(self, fields: list[Field]):
        names = [f.name for f in fields]
        if len(set(names)) != len(names) or not fields:
            raise ValueError(f"a packed layout needs distinct field names, got {names}")
        for f in fields:
            if np.dtype(f.dtype) not in _TORCH:
                raise ValueError(f"packed field {f.name!r}: dtype {f.dtype} is not one of uint8, float32, int32")
        self.fields = {f.name: f for f in fields}
        self.offsets, at = {}, 0
        for f in fields:
            self.offsets[f.name] = at
            at += -(-f.nbytes // ALIGN) * ALIGN
        self.nbytes = at

    def space(self) -> spaces.Box:
        """The observation space of packed rows: [nbytes] uint8."""
        return spaces.Box(0, 255, (self.nbytes,), np.uint8)

    def pack(self, **arrays: np.ndarray) -> np.ndarray:
        """One row [nbytes] uint8 from each field's array (cast to its dtype; every field must be given)."""
        if set(arrays) != set(self.fields):
            raise ValueError(f"pack: got fields {sorted(arrays)}, the layout has {sorted(self.fields)}")
        row = np.zeros(self.nbytes, np.uint8)
        for name, value in arrays.items():
            f, at = self.fields[name], self.offsets[name]
            value = np.asarray(value)
            if value.shape != f.shape:
                raise ValueError(f"pack: field {name!r} of shape {value.shape}, expected {f.shape}")
            row[at:at + f.nbytes] = np.ascontiguousarray(value, dtype=f.dtype).view(np.uint8).reshape(-1)
        return row

    def unpack(self, rows: torch.Tensor | np.ndarray) -> dict[str, torch.Tensor]:
        """rows [B, nbytes] uint8 -> {name: [B, *shape] of the field's dtype}, each a view of `rows` (no copy)."""
        x = torch.as_tensor(rows)
        if x.dtype != torch.uint8 or x.ndim != 2 or x.shape[1] != self.nbytes:
            raise ValueError(f"unpack: packed rows [B, {self.nbytes}] uint8 expected, got {tuple(x.shape)} {x.dtype}")
        if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) % ALIGN):
            x = x.contiguous()
        if x.shape[0] == 0:
            return {name: torch.zeros((0, *f.shape), dtype=_TORCH[np.dtype(f.dtype)]) for name, f in self.fields.items()}
        out = {}
        for name, f in self.fields.items():
            at = self.offsets[name]
            part = x[:, at:at + f.nbytes]
            dtype = _TORCH[np.dtype(f.dtype)]
            if dtype != torch.uint8:
                if part.storage_offset() % np.dtype(f.dtype).itemsize:  # a row slice at an odd place: copy once
                    part = part.clone()
                part = part.view(dtype)
            out[name] = part.reshape(x.shape[0], *f.shape)
        return out
