"""A simulated two-node Ray cluster (ray.cluster_utils): devices are listed per node and ranks land on both.

It needs its own Ray instance, so it runs in a subprocess (apart from the session `cluster` fixture).
"""

import textwrap

import pytest

from own_ray import START_NODES, run_script

SCRIPT = START_NODES + textwrap.dedent('''
    import ray

    from m2flow.runtime import Cluster, Worker, parse_placement

    class Where(Worker):
        def where(self):
            with self.device_phase("probe"):  # each node's device lock server answers
                return self.info()

        def allreduce(self, x):
            import torch, torch.distributed as dist
            self.init_process_group()
            t = torch.tensor([float(x)])
            dist.all_reduce(t)
            return t.item()

    nodes = start_nodes({"num_cpus": 1, "include_dashboard": False}, {"num_cpus": 1})
    cluster = Cluster(address=nodes.address, cpu_devices=1)
    try:
        assert len(cluster.nodes) == 2 and cluster.num_devices == 2, cluster
        assert cluster.device(0).node_id != cluster.device(1).node_id
        group = Where.launch(cluster, parse_placement("where: all", cluster.num_devices)["where"])
        infos = group.where().wait(timeout=60)
        assert [i["node_id"] for i in infos] == [cluster.device(0).node_id, cluster.device(1).node_id], infos
        assert [i["env"]["LOCAL_RANK"] for i in infos] == ["0", "0"]
        assert group.call_per_rank("allreduce", [(1,), (2,)]).wait(timeout=60) == [3.0, 3.0]
        print("MULTINODE OK", [i["node_id"][:8] for i in infos])
    finally:
        ray.shutdown()
        nodes.shutdown()
''')


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_ranks_are_placed_on_both_nodes(tmp_path):
    code, out = run_script(SCRIPT, tmp_path, timeout=240)
    assert code == 0 and "MULTINODE OK" in out, out[-4000:]
