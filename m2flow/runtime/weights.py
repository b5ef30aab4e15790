"""Versioned weight sync between groups: the sender publishes a state dict once into the Ray object
store (shared memory on one node, moved by Ray between nodes) and every receiver loads it in place.

It moves tensors and checks them; it does not know which model they belong to.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass

import numpy as np
import ray
import torch


@dataclass
class WeightsRef:
    """A published state dict: `ref` points at {name: numpy array} in the object store."""

    version: int
    ref: list  # [ObjectRef], wrapped so Ray passes the reference itself, not its value
    digest: str


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw bits
        return t.view(torch.int16).numpy()
    return t.numpy()


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """A hash of names, dtypes, shapes and raw bytes: equal digests mean bit-identical weights."""
    h = hashlib.sha1()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(_to_numpy(t).tobytes())
    return h.hexdigest()


def publish(state: dict[str, torch.Tensor], version: int) -> WeightsRef:
    """Put a state dict into the object store once; receivers fetch it zero-copy on the same node."""
    arrays = {k: _to_numpy(v) for k, v in state.items()}
    dtypes = {k: str(v.dtype) for k, v in state.items()}
    return WeightsRef(version, [ray.put((arrays, dtypes))], state_digest(state))


def fetch(weights: WeightsRef) -> dict[str, torch.Tensor]:
    """The published state dict as torch tensors (read-only views of shared memory where possible)."""
    arrays, dtypes = ray.get(weights.ref[0])
    out = {}
    for k, a in arrays.items():
        with warnings.catch_warnings():  # read-only shared memory: receivers copy out of it, never write
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(a)
        out[k] = t.view(torch.bfloat16) if dtypes[k] == "torch.bfloat16" else t
    return out


@torch.no_grad()
def load_into(module: torch.nn.Module, weights: WeightsRef) -> None:
    """Copy published weights into `module`'s existing parameters and buffers in place."""
    state = fetch(weights)
    own = dict(module.state_dict())
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"weights v{weights.version} lack {len(missing)} tensors, e.g. {missing[:3]}")
    for name, tensor in own.items():
        tensor.copy_(state[name])
