"""Versioned weight sync between groups: the sender publishes a state dict once into the Ray object
store (shared memory on one node, moved by Ray between nodes) and every receiver loads it in place. When every
receiver lives in the sender's process (co-hosted groups), the sender publishes the tensors themselves instead:
no object-store copy, and the receivers copy straight from them.

It moves tensors and checks them; it does not know which model they belong to.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import ray
import torch

BUCKET_BYTES = 64 << 20  # a published state dict is split into object-store entries of about this size


@dataclass
class WeightsRef:
    """A published state dict: each entry of `ref` points at one bucket {name: numpy array} in the object store."""

    version: int
    ref: list  # [ObjectRef per bucket], wrapped in a list so Ray passes the references themselves, not their values
    digest: str | None  # state_digest of the weights; None when the sender did not ask receivers to check them
    local: str | None = None  # the publishing process (Ray worker id) when the weights stay in it; `ref` is then empty
    kind: str = "full"  # what the tensors are: "full" (a state dict to load) or "adapters" (LoRA, to apply to a base)
    nbytes: int = 0  # bytes of the published tensors


_PUBLISHED: dict[int, dict[str, torch.Tensor]] = {}  # this process's in-process publication: version -> tensors


def _process_id() -> str:
    return ray.get_runtime_context().get_worker_id()


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw bits
        return t.view(torch.int16).numpy()
    return t.numpy()


def _hash_into(h, name: str, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
    h.update(_to_numpy(t).tobytes())


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """A hash of names, dtypes, shapes and raw bytes: equal digests mean bit-identical weights."""
    h = hashlib.sha1()
    for name in sorted(state):
        _hash_into(h, name, state[name])
    return h.hexdigest()


def publish(state: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int,
            bucket_bytes: int = BUCKET_BYTES, digest: bool = True, local: bool = False,
            kind: str = "full") -> WeightsRef:
    """Put a state dict into the object store in buckets of about `bucket_bytes`; receivers on the same node read
    them zero-copy, others get them moved by Ray (one copy per node: a broadcast). `state` may be a dict or an
    iterator of (name, tensor) in sorted name order, e.g. tensors gathered one at a time from a sharded model.
    `digest=False`: no hash of the bytes (it costs a pass over every weight on sender and receivers alike).
    `local=True`: every receiver runs in this process; it keeps the tensors themselves (the latest publication only)
    and receivers copy from them: do not change them until the receivers have loaded. `kind`: what receivers do
    with them (see WeightsRef)."""
    items = sorted(state.items()) if isinstance(state, dict) else state
    h, refs, arrays, dtypes, size, last, total = hashlib.sha1(), [], {}, {}, 0, None, 0
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        if last is not None and name <= last:
            raise ValueError(f"publish: tensors must come in sorted name order; {name!r} came after {last!r}")
        last = name
        total += tensor.numel() * tensor.element_size()
        if digest:
            _hash_into(h, name, tensor)
        if local:
            kept[name] = tensor.detach()
            continue
        arrays[name], dtypes[name] = _to_numpy(tensor), str(tensor.dtype)
        size += arrays[name].nbytes
        if size >= bucket_bytes:
            refs.append(ray.put((arrays, dtypes)))
            arrays, dtypes, size = {}, {}, 0
    if local:
        _PUBLISHED.clear()
        _PUBLISHED[version] = kept
        return WeightsRef(version, [], h.hexdigest() if digest else None, local=_process_id(), kind=kind, nbytes=total)
    if arrays or not refs:
        refs.append(ray.put((arrays, dtypes)))
    return WeightsRef(version, refs, h.hexdigest() if digest else None, kind=kind, nbytes=total)


def _buckets(weights: WeightsRef) -> Iterator[dict[str, torch.Tensor]]:
    """Each bucket as {name: tensor} (read-only views of shared memory where possible), fetched one at a time."""
    if weights.local is not None:
        if weights.local != _process_id() or weights.version not in _PUBLISHED:
            raise RuntimeError(f"weights v{weights.version} were published for receivers in the publishing process "
                               f"only (publish(local=True)); this receiver runs in another process, or a newer "
                               f"version replaced them")
        yield _PUBLISHED[weights.version]
        return
    for ref in weights.ref:
        arrays, dtypes = ray.get(ref)
        out = {}
        for k, a in arrays.items():
            with warnings.catch_warnings():  # read-only shared memory: receivers copy out of it, never write
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(a)
            out[k] = t.view(torch.bfloat16) if dtypes[k] == "torch.bfloat16" else t
        yield out


def fetch(weights: WeightsRef) -> dict[str, torch.Tensor]:
    """The published state dict as torch tensors."""
    return {k: v for bucket in _buckets(weights) for k, v in bucket.items()}


def loaded_digest(module: torch.nn.Module, weights: WeightsRef) -> str | None:
    """What a receiver reports after loading `weights` into `module`: its state digest when the sender published one
    (the flow checks them), else None."""
    return state_digest(module.state_dict()) if weights.digest is not None else None


@torch.no_grad()
def load_into(module: torch.nn.Module, weights: WeightsRef) -> None:
    """Copy published weights into `module`'s existing parameters and buffers in place, one bucket at a time."""
    if weights.kind != "full":
        raise ValueError(f"weights v{weights.version} are {weights.kind}, not a state dict: this receiver cannot load "
                         f"them (LoRA adapters need model.lora on the receiver's side too)")
    own = dict(module.state_dict())
    loaded: set[str] = set()
    for bucket in _buckets(weights):
        for name, tensor in bucket.items():
            if name in own:
                own[name].copy_(tensor)
                loaded.add(name)
    missing = sorted(set(own) - loaded)
    if missing:
        raise ValueError(f"weights v{weights.version} lack {len(missing)} tensors, e.g. {missing[:3]}")
