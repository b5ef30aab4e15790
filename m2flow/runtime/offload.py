"""Offload: move a worker's torch state (module parameters, buffers, grads, optimizer state) off its device and back.

CPU devices: the tensors go to a safetensors file and their memory goes back to the OS; the tensor objects stay
(so optimizers and hooks keep their references) but hold empty storage until `onload_state`. It does not decide
when to offload (`Worker.offload()` / flows do) and does not lock the device (`Worker.device_phase` does).
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["offload_state", "onload_state", "offloadable_bytes"]

_FILE = "state.safetensors"


def _slots(objs: dict) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) for every parameter, buffer and optimizer-state tensor, each tensor object once."""
    out, seen = [], set()

    def add(key, t):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out.append((key, t))

    for name, obj in objs.items():
        if isinstance(obj, torch.nn.Module):
            for pname, p in obj.named_parameters():
                add(f"{name}.param.{pname}", p)
            for bname, b in obj.named_buffers():
                add(f"{name}.buffer.{bname}", b)
        elif isinstance(obj, torch.optim.Optimizer):
            for gi, group in enumerate(obj.param_groups):
                for pi, p in enumerate(group["params"]):
                    for k, v in obj.state.get(p, {}).items():
                        add(f"{name}.state.{gi}.{pi}.{k}", v)
        else:
            raise TypeError(f"offload: {name!r} is a {type(obj).__name__}; expected an nn.Module or an Optimizer")
    return out


def offloadable_bytes(objs: dict) -> int:
    """Bytes `offload_state` would move for `objs` now: parameters, buffers, optimizer state and gradients (0 while
    they are offloaded)."""
    tensors = [t for _, t in _slots(objs)] + [p.grad for _, p in _grads(objs) if p.grad is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def _grads(objs: dict) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"{name}.grad.{pname}", p) for name, obj in objs.items() if isinstance(obj, torch.nn.Module)
            for pname, p in obj.named_parameters()]


def _malloc_trim() -> None:
    """Return freed heap pages to the OS (glibc keeps small freed blocks otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def offload_state(objs: dict, device_kind: str, directory: str) -> str:
    """Move the state of `objs` ({name: nn.Module | Optimizer}) off the device. Returns where it went.

    cpu: write all tensors to `directory/state.safetensors`, replace each tensor's storage by an empty one and
    trim the heap, so the process RSS drops by about the state size. gpu: copy to pinned host memory.
    """
    if device_kind == "gpu":
        return _to_host(objs)
    if device_kind != "cpu":
        raise ValueError(f"offload: device_kind must be 'cpu' or 'gpu', got {device_kind!r}")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, _FILE)
    if os.path.exists(path):
        raise RuntimeError(f"offload: {path} exists, so this state is already offloaded; call onload_state first")
    slots = _slots(objs)
    grads = [(key, p) for key, p in _grads(objs) if p.grad is not None]
    tensors = {key: t.detach().contiguous() for key, t in slots}
    tensors.update({key: p.grad.detach().contiguous() for key, p in grads})
    save_file(tensors, path + ".tmp")
    os.replace(path + ".tmp", path)
    del tensors
    for _, p in grads:
        p.grad = None
    for _, t in slots:
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    _malloc_trim()
    return path


def onload_state(objs: dict, device_kind: str, directory: str) -> None:
    """Undo `offload_state`: tensors come back bit-identical, into the same tensor objects."""
    if device_kind == "gpu":
        return _to_device(objs)
    path = os.path.join(directory, _FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"onload: no offloaded state at {path}; was offload_state called with this directory?")
    with safe_open(path, framework="pt") as f:  # memory-mapped; each tensor is copied out once
        keys = set(f.keys())
        for key, t in _slots(objs):
            if key not in keys:
                raise KeyError(f"onload: {key!r} is not in {path}; the modules/optimizers changed since offload")
            t.data = f.get_tensor(key).clone()
        for key, p in _grads(objs):
            if key in keys:
                p.grad = f.get_tensor(key).clone()
    os.remove(path)


# GPU: state moves to pinned host memory inside the same tensor objects, and back (run on an H100: the tests marked
# `cuda`).


def _each_tensor(objs: dict, move: Callable[[torch.Tensor], torch.Tensor]) -> None:
    for _, t in _slots(objs):
        t.data = move(t.data)
    for _, p in _grads(objs):
        if p.grad is not None:
            p.grad = move(p.grad)


def _to_host(objs: dict) -> str:
    _each_tensor(objs, lambda t: torch.empty_like(t, device="cpu", pin_memory=True).copy_(t) if t.is_cuda else t)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return "pinned host memory"


def _to_device(objs: dict) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    _each_tensor(objs, lambda t: t.to(device, non_blocking=True) if t.is_pinned() else t)
    torch.cuda.synchronize()
