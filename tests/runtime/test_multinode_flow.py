"""Flows on a simulated two-node Ray cluster (ray.cluster_utils). The reasoning flow: rollout on node 0, inference on
node 1, the FSDP2 actor with one rank on each node; channels, weight sync and gloo collectives cross nodes. The
embodied flow from pixels: frames cross nodes, compressed or not. Runs in a subprocess, apart from the session
`cluster` fixture, because it needs its own Ray instance."""

import textwrap

import pytest

from own_ray import START_NODES, run_script

# One simulated cluster and one interpreter for both flows (one cluster start and one set of imports instead of two):
# each part prints its own line, or its traceback, so one failing leaves the other's test to pass.
SCRIPT = START_NODES + textwrap.dedent('''
    import json, sys, traceback
    import ray

    from m2flow import config as C
    from m2flow.embodied.config import EmbodiedConfig
    from m2flow.embodied.flow import train as train_embodied
    from m2flow.reasoning.config import ReasoningConfig
    from m2flow.reasoning.flow import train as train_reasoning
    from m2flow.runtime import Cluster


    def reasoning(cluster):
        cfg = C.load(ReasoningConfig, None, [
            f"run.dir={sys.argv[1]}", "run.name=two_nodes", "run.progress=false", "run.steps=3", "run.trace=false",
            "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=4", "actor.micro_batch=8",
            "actor.backend=fsdp2", "data.train_size=100", "data.eval_size=10",
            "cluster.placement=rollout,reward: 0; inference: 1; actor: 0-1"])
        out = train_reasoning(cfg, cluster)
        print("REASONING OK", json.dumps({"placement": out["plan"]["placement"],
                                            "samples": out["metrics"]["actor/samples"]}))


    def frames(cluster):
        for compress in ("true", "false"):
            cfg = C.load(EmbodiedConfig, "ppo_pickcube", [
                f"run.dir={sys.argv[1]}", f"run.name=frames_{compress}", "run.progress=false", "run.steps=2",
                "run.trace=false", "run.save_every=0", "eval.episodes=0", "env.pixels=true", "env.image_size=48",
                "policy.kind=vla", "vla.dim=32", "vla.layers=1", "vla.heads=2", "env.num_envs=4", "rollout.steps=6",
                "actor.epochs=1", "actor.minibatch_size=12", f"cluster.compress_frames={compress}",
                "cluster.placement=env: 0; rollout,actor: 1"])
            train_embodied(cfg, cluster)
        print("FRAMES OK")


    nodes = start_nodes({"num_cpus": 1, "include_dashboard": False}, {"num_cpus": 1})
    cluster = Cluster(address=nodes.address, cpu_devices=1)
    try:
        assert cluster.num_devices == 2 and cluster.device(0).node_id != cluster.device(1).node_id, cluster
        for part in (reasoning, frames):
            try:
                part(cluster)
            except Exception:
                print(f"{part.__name__.upper()} FAILED", flush=True)
                traceback.print_exc()
    finally:
        ray.shutdown()
        nodes.shutdown()
''')


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """(exit code, output, run directory) of SCRIPT, run once for the module's tests."""
    where = tmp_path_factory.mktemp("two_nodes")
    code, out = run_script(SCRIPT, where, str(where), timeout=540)
    return code, out, where


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_reasoning_flow_runs_across_two_nodes(two_nodes):
    code, out, tmp_path = two_nodes
    assert code == 0 and "REASONING OK" in out, out[-4000:]
    assert '"actor": [[0], [1]]' in out and '"samples": 16' in out, out[-2000:]
    rows = (tmp_path / "two_nodes" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3
    assert sorted(p.name for p in (tmp_path / "two_nodes" / "checkpoints" / "step_3" / "actor_dcp").glob("*.distcp")) \
        == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_frames_cross_nodes_compressed_and_the_run_is_the_same(two_nodes):
    """cluster.compress_frames on a simulated two-node cluster, ManiSkill3's PickCube from pixels, the env worker on
    node 0, policy and actor on node 1: the frames travel compressed (the ratio logged), losslessly: the run's
    losses equal those of the same run without compression."""
    import json

    code, out, tmp_path = two_nodes
    assert code == 0 and "FRAMES OK" in out, out[-4000:]
    runs = {c: [json.loads(line) for line in open(tmp_path / f"frames_{c}" / "metrics.jsonl")]
            for c in ("true", "false")}
    assert all(r["env/obs_compression"] > 2 for r in runs["true"]), [r.get("env/obs_compression") for r in runs["true"]]
    assert not any("env/obs_compression" in r for r in runs["false"])
    for key in ("actor/pg_loss", "actor/vf_loss", "actor/approx_kl", "actor/grad_norm", "env_steps"):
        assert [r[key] for r in runs["true"]] == [r[key] for r in runs["false"]], key
