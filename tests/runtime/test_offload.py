"""Offload on CPU devices: the state goes to disk, the worker's RSS drops, and onload is bit-identical."""

import hashlib

import psutil
import pytest
import torch

from m2flow.runtime import ComponentPlacement, Worker, offload_state, onload_state, release_all


def _digests(objs: dict) -> dict[str, str]:
    """A hash of every tensor's bytes (params, buffers, grads, optimizer state), by name."""
    out = {}
    for name, obj in objs.items():
        if isinstance(obj, torch.nn.Module):
            tensors = {**dict(obj.named_parameters()), **dict(obj.named_buffers())}
            tensors.update({f"{k}.grad": p.grad for k, p in obj.named_parameters() if p.grad is not None})
        else:
            tensors = {f"{i}.{k}": v for i, s in enumerate(obj.state.values()) for k, v in s.items()}
        for key, t in tensors.items():
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[f"{name}.{key}"] = f"{t.dtype}{tuple(t.shape)}:" + hashlib.blake2b(raw).hexdigest()
    return out


def _model_and_optimizer(width: int, layers: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model.register_buffer("scale", torch.randn(7, dtype=torch.bfloat16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).square().mean().backward()
    opt.step()  # Adam now holds exp_avg, exp_avg_sq and a step tensor per parameter; grads stay set
    return model, opt


class Holder(Worker):
    def __init__(self, width, layers):
        self.model, self.opt = _model_and_optimizer(width, layers)
        self.register_offloadable("model", self.model)
        self.register_offloadable("opt", self.opt)

    def state_bytes(self):
        return sum(
            t.numel() * t.element_size()
            for t in [*self.model.parameters(), *self.model.buffers(), *(p.grad for p in self.model.parameters()),
                      *(v for s in self.opt.state.values() for v in s.values())])

    def rss(self):
        return psutil.Process().memory_info().rss

    def digests(self):
        return _digests({"model": self.model, "opt": self.opt})

    def loaded_inside_phase(self):
        with self.device_phase("work"):
            return self.model[0].weight.numel() > 0 and self.opt.state[self.model[0].weight]["exp_avg"].numel() > 0

    def train_step(self):
        self.opt.zero_grad()
        self.model(torch.randn(2, self.model[0].in_features)).square().mean().backward()
        self.opt.step()
        return True


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_worker_offload_frees_ram_and_onload_is_bit_identical(cluster, tmp_path):
    holder = Holder.launch(cluster, ComponentPlacement("holder", ((0,),)), 2048, 3, run_dir=str(tmp_path))
    try:
        (size,) = holder.state_bytes().wait(timeout=60)
        assert size > 200e6  # 12.6M params: weights + grads + 2 Adam moments
        (before,) = holder.digests().wait(timeout=60)
        (rss_on,) = holder.rss().wait()
        holder.offload().wait(timeout=120)
        holder.offload().wait(timeout=30)  # a second offload is a no-op
        (rss_off,) = holder.rss().wait()
        assert rss_on - rss_off >= 0.8 * size, f"RSS fell by {(rss_on - rss_off) / 1e6:.0f} MB of {size / 1e6:.0f} MB"
        assert list(tmp_path.glob("offload/holder-0-*/state.safetensors"))
        holder.onload().wait(timeout=120)
        assert holder.digests().wait(timeout=60) == [before]
        assert not list(tmp_path.glob("offload/holder-0-*/state.safetensors"))
        assert holder.train_step().wait(timeout=60) == [True]  # the optimizer still drives the same tensors
        assert [s["phase"] for s in holder.spans() if s["phase"] in ("offload", "onload")] == ["offload", "onload"]

        holder.set_context_switch(True).wait()  # now each device phase onloads first and offloads after
        holder.offload().wait(timeout=120)
        assert holder.loaded_inside_phase().wait(timeout=120) == [True]
        (rss_after_phase,) = holder.rss().wait()
        assert rss_on - rss_after_phase >= 0.8 * size
    finally:
        release_all([holder])


def test_offload_functions_keep_tensor_objects_and_tied_weights(tmp_path):
    model, opt = _model_and_optimizer(16, 2)
    model[1].weight = model[0].weight  # tied: one Parameter in two places
    objs = {"model": model, "opt": opt}
    before = _digests(objs)
    weight, moment = model[0].weight, next(iter(opt.state.values()))["exp_avg"]
    offload_state(objs, "cpu", str(tmp_path))
    assert weight.numel() == 0 and moment.numel() == 0 and weight.grad is None
    with pytest.raises(RuntimeError, match="already offloaded"):
        offload_state(objs, "cpu", str(tmp_path))
    onload_state(objs, "cpu", str(tmp_path))
    assert model[0].weight is weight and model[1].weight is weight
    assert next(iter(opt.state.values()))["exp_avg"] is moment
    assert _digests(objs) == before
    with pytest.raises(FileNotFoundError, match="no offloaded state"):
        onload_state(objs, "cpu", str(tmp_path))


def test_offload_refuses_what_is_neither_a_module_nor_an_optimizer(tmp_path):
    with pytest.raises(TypeError, match="expected an nn.Module or an Optimizer"):
        offload_state({"m": torch.zeros(2)}, "cpu", str(tmp_path))
