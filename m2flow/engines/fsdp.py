"""Sharded training with torch FSDP2 (`fully_shard`): shard a causal LM over the ranks of the default process group
(gloo on CPU, NCCL on GPU), gather full tensors for weight sync and HF export, and save/load distributed checkpoints
that resume on any rank count. It does not start processes or create the process group (the runtime does).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def shard_model(model: torch.nn.Module, device_type: str = "cpu") -> torch.nn.Module:
    """Shard every decoder layer, then the rest (embeddings, norm, head), over all ranks of the process group.
    Parameters become DTensors; names and the module tree stay as they were."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"shard_model: {type(model).__name__} has no `model.layers` (Qwen2/Llama decoder layers)")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every rank if it is a DTensor (a collective), else itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_items(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full CPU tensor) for every entry of the state dict, in sorted name order, gathered one tensor at a
    time so no rank ever holds more than one unsharded tensor beyond its shard. Every rank must iterate it."""
    state = model.state_dict()
    for name in sorted(state):
        yield name, full_tensor(state[name].detach()).cpu()


def all_reduce(value: float, op: str = "sum") -> float:
    """A scalar reduced over all ranks (sum or max); the value itself when not distributed."""
    if not is_distributed():
        return float(value)
    return float(all_reduce_tensor(torch.tensor([float(value)], dtype=torch.float64), op)[0])


def all_reduce_tensor(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`t` reduced elementwise over all ranks (sum or max), on `t`'s device; `t` itself when not distributed. The
    collective runs where the backend needs it: on the current GPU under NCCL, else on the CPU."""
    if not is_distributed():
        return t
    where = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    moved = t.to(where)
    dist.all_reduce(moved, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return moved.to(t.device)


@contextmanager
def _single_process_ok():
    """Without a process group DCP reads and writes in this one process, which is what we want: say nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Model and optimizer state as a torch distributed checkpoint: each rank writes its shards (a shared
    filesystem across nodes), and `load_sharded` reshards them to whatever rank count loads them."""
    model_state, optim_state = get_state_dict(model, optimizer)
    with _single_process_ok():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Load a `save_sharded` checkpoint written by any number of ranks into this (sharded or plain) model."""
    if not (Path(directory) / ".metadata").exists():
        raise FileNotFoundError(f"{directory}: not a distributed checkpoint (no .metadata file)")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with _single_process_ok():
        dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def export_hf(model: torch.nn.Module, directory: str | Path, tokenizer=None, rank: int = 0,
              items: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """Write a single HF model directory (config.json + model.safetensors) from a sharded or plain model. Every rank
    must call it (the tensors are gathered); only `rank` 0 writes. Tied output embeddings are stored once. `items`:
    the state to write instead of the model's own (e.g. a LoRA model's, merged)."""
    from safetensors.torch import save_file

    config = model.config
    tied = getattr(config, "tie_word_embeddings", False)
    state = {}
    for name, tensor in items if items is not None else full_state_items(model):
        if not (tied and name == "lm_head.weight"):
            state[name] = tensor.detach().cpu().contiguous()
    if rank != 0:
        return
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
