"""Channel across nodes: a simulated two-node Ray cluster (ray.cluster_utils.Cluster) in its own process,
because the test session already runs one Ray instance. Producer and consumer are pinned to different nodes."""

import json
import os
import subprocess
import sys

import pytest

from own_ray import START_NODES

SCENARIO = r'''
import hashlib, json
import ray, torch
from m2flow.runtime.channel import Channel

head = {"num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False}
cluster = start_nodes(head, {"num_cpus": 1, "resources": {"node_b": 1}})
ray.init(address=cluster.address, logging_level="ERROR")

def tensors():
    g = torch.Generator().manual_seed(7)
    big = torch.randn(1024, 1024, generator=g).to(torch.bfloat16).t()[::2]  # 1 MiB, not contiguous
    rgb = (torch.arange(64 * 3 * 64 * 64) // 4096 % 7 * 30).to(torch.uint8).reshape(64, 3, 64, 64)  # frames, 768 KiB
    return {"big": big, "small": torch.arange(10, dtype=torch.int64), "scalar": torch.tensor(-0.0), "rgb": rgb}

def digest(d):
    raw = lambda t: t.contiguous().view(-1).view(torch.uint8).numpy()
    return {k: [str(t.dtype), list(t.shape), hashlib.sha256(raw(t)).hexdigest()] for k, t in sorted(d.items())}

@ray.remote(num_cpus=0)
class Proc:
    def node(self):
        return ray.get_runtime_context().get_node_id()
    def put(self, ch, key):
        ch.put(tensors(), key=key)
        return digest(tensors())
    def get(self, ch, key):
        return digest(ch.get(key=key, timeout=60))

a = Proc.options(resources={"node_a": 0.01}).remote()
b = Proc.options(resources={"node_b": 0.01}).remote()
ch = Channel.create("cross-node")
taken = b.get.remote(ch, "a->b")
sent = ray.get(a.put.remote(ch, "a->b"))
got = ray.get(taken, timeout=120)
back = a.get.remote(ch, "b->a")
ray.get(b.put.remote(ch, "b->a"))
z = Channel.create("cross-node-compressed", compress=True)  # the frames travel compressed
taken_z = b.get.remote(z, "a->b")
ray.get(a.put.remote(z, "a->b"))
print("RESULT " + json.dumps({"nodes": ray.get([a.node.remote(), b.node.remote()]),
                               "a_to_b": sent == got, "b_to_a": ray.get(back, timeout=120) == sent,
                               "compressed_a_to_b": ray.get(taken_z, timeout=120) == sent}))
ray.shutdown()
cluster.shutdown()
'''


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_tensor_moves_between_two_nodes_bit_identical_compressed_or_not():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", START_NODES + SCENARIO], capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0 and lines, f"scenario failed (rc={proc.returncode}):\n{output}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["nodes"][0] != result["nodes"][1]  # producer and consumer really sat on different nodes
    assert result["a_to_b"] and result["b_to_a"] and result["compressed_a_to_b"]
