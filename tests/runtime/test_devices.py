"""GPU-ready workers (issue 17): every worker computes on its placement's device through one property,
`Worker.torch_device` (the rank's first visible GPU on GPU devices, else the CPU), moves what it computes on there
and hands on CPU tensors; no worker or flow branches on CUDA itself. On a CPU machine every flow test runs these code
paths with the CPU as the device; the tests marked `cuda` run them on a GPU wherever one exists (skipped here)."""

import re
import uuid
from pathlib import Path

import pytest
import torch

from m2flow.runtime import Channel, Worker, offload_state, onload_state, parse_placement, release_all
from m2flow.runtime.cluster import Device

ROOT = Path(__file__).resolve().parents[2] / "m2flow"


def test_a_rank_computes_on_its_first_visible_gpu_on_gpu_devices_and_on_the_cpu_otherwise():
    w = Worker()  # a plain local object: no devices
    assert w.torch_device == torch.device("cpu")
    w.devices = [Device(0, "node", "10.0.0.1", "gpu", (0, 1), gpu_id=3), Device(1, "node", "10.0.0.1", "gpu", (2,), 5)]
    assert w.torch_device == torch.device("cuda", 0)  # CUDA_VISIBLE_DEVICES=3,5 in its process: GPU 3 is cuda:0
    w.devices = [Device(0, "node", "10.0.0.1", "cpu", (0, 1))]
    assert w.torch_device == torch.device("cpu")


def test_no_worker_or_flow_branches_on_cuda_itself():
    """Device choices live in the runtime (`torch_device`, the process group's backend, offload) and the engines
    (which follow their model's device); workers and flows only use them."""
    for path in [*(ROOT / "workers").glob("*.py"), *(ROOT / "flows").glob("*.py")]:
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        assert not re.search(r"cuda|is_available\(\)|\"nccl\"|'nccl'", code), path.name


class Mover(Worker):
    def __init__(self):
        self.model = torch.nn.Linear(8, 8).to(self.torch_device)
        self.register_offloadable("model", self.model)

    def where(self) -> str:
        return str(next(self.model.parameters()).device)

    def send(self, channel) -> None:
        channel.put({"x": torch.arange(6.0, device=self.torch_device).reshape(2, 3)})


@pytest.mark.cuda
def test_on_a_gpu_a_worker_computes_there_and_its_tensors_reach_other_processes_through_host_memory(gpu_cluster):
    group = Mover.launch(gpu_cluster, parse_placement("mover: 0", gpu_cluster.num_devices)["mover"])
    try:
        assert group.where().wait() == ["cuda:0"]
        channel = Channel.create(f"cuda-tensors-{uuid.uuid4().hex[:8]}")
        group.send(channel).wait()
        item = channel.get(timeout=60)
        assert item["x"].device.type == "cpu" and item["x"].tolist() == [[0, 1, 2], [3, 4, 5]]
    finally:
        release_all([group])


@pytest.mark.cuda
def test_on_a_gpu_offload_moves_state_to_pinned_host_memory_and_back_bit_for_bit():
    model = torch.nn.Linear(64, 64).cuda()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    offload_state({"model": model}, "gpu", "unused")
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    onload_state({"model": model}, "gpu", "unused")
    for k, v in model.state_dict().items():
        assert v.device.type == "cuda" and torch.equal(v, before[k])


def test_a_local_instance_keeps_token_authentication_without_rays_notice_of_it(caplog):
    """Every run printed Ray's 'Token authentication is enabled for this Ray cluster' notice; its warning that
    authentication is off is kept (Ray's own functions log both, through Ray's logger)."""
    import logging

    from ray._private.authentication import authentication_token_setup as ray_auth

    from m2flow.runtime.cluster import _quiet_token_notice

    ours = [f for f in ray_auth.logger.filters if type(f).__name__ == "_DropTokenNotice"]  # a Cluster of the session
    for f in ours:
        ray_auth.logger.removeFilter(f)
    with caplog.at_level(logging.WARNING, logger=ray_auth.logger.name):
        ray_auth._warn_token_auth_enabled()
        assert "Token authentication is enabled for this Ray cluster" in caplog.text  # Ray's notice, as Ray logs it
        caplog.clear()
        _quiet_token_notice()
        _quiet_token_notice()  # once is enough; twice adds nothing
        ray_auth._warn_token_auth_enabled()
        ray_auth._warn_token_auth_disabled()
    assert "Token authentication is enabled" not in caplog.text
    assert "Token authentication is disabled for this Ray cluster" in caplog.text
    assert sum(type(f).__name__ == "_DropTokenNotice" for f in ray_auth.logger.filters) == 1
