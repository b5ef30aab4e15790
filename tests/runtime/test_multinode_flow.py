"""The reasoning flow on a simulated two-node Ray cluster (ray.cluster_utils): rollout on node 0, inference on node 1,
the FSDP2 actor with one rank on each node; channels, weight sync and gloo collectives cross nodes. Runs in a
subprocess, apart from the session `cluster` fixture, because it needs its own Ray instance."""

import textwrap

import pytest

from own_ray import START_NODES, run_script

SCRIPT = START_NODES + textwrap.dedent('''
    import json, sys
    import ray

    from m2flow import config as C
    from m2flow.reasoning.config import ReasoningConfig
    from m2flow.reasoning.flow import train
    from m2flow.runtime import Cluster

    nodes = start_nodes({"num_cpus": 1, "include_dashboard": False}, {"num_cpus": 1})
    cluster = Cluster(address=nodes.address, cpu_devices=1)
    try:
        assert cluster.num_devices == 2 and cluster.device(0).node_id != cluster.device(1).node_id, cluster
        cfg = C.load(ReasoningConfig, None, [
            f"run.dir={sys.argv[1]}", "run.name=two_nodes", "run.progress=false", "run.steps=3", "run.trace=false",
            "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=4", "actor.micro_batch=8",
            "actor.backend=fsdp2", "data.train_size=100", "data.eval_size=10",
            "cluster.placement=rollout,reward: 0; inference: 1; actor: 0-1"])
        out = train(cfg, cluster)
        print("TWO NODES OK", json.dumps({"placement": out["plan"]["placement"],
                                          "samples": out["metrics"]["actor/samples"]}))
    finally:
        ray.shutdown()
        nodes.shutdown()
''')


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_reasoning_flow_runs_across_two_nodes(tmp_path):
    code, out = run_script(SCRIPT, tmp_path, str(tmp_path), timeout=420)
    assert code == 0 and "TWO NODES OK" in out, out[-4000:]
    assert '"actor": [[0], [1]]' in out and '"samples": 16' in out, out[-2000:]
    rows = (tmp_path / "two_nodes" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3
    assert sorted(p.name for p in (tmp_path / "two_nodes" / "checkpoints" / "step_3" / "actor_dcp").glob("*.distcp")) \
        == ["__0_0.distcp", "__1_0.distcp"]
