"""The flows on a GPU (issue 17). Marked `cuda`: skipped where torch sees no GPU, as on this project's CI; on a
machine with one, `pytest -m cuda tests` runs them. The reasoning workers place their models on their rank's GPU
(`Worker.torch_device`) and report the GPU memory they held (`actor/max_memory_gb`); channels and weight syncs carry
host tensors between processes; collocated components take turns on the one GPU, offloading their state to pinned
host memory between turns with `cluster.offload=true`."""

import json

import pytest
from safetensors.torch import load_file

from m2flow import config as C
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.flow import train as train_embodied
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.flow import train

pytestmark = pytest.mark.cuda

ALL_ON_THE_GPU = "cluster.placement=rollout,reward,inference,actor: 0"
BF16_LOGPROB_TOLERANCE = 0.05  # as tests/e2e/test_bf16.py (docs/guide.md, bf16)


def run(cluster, tmp_path, name, *overrides) -> list[dict]:
    base = [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.trace=false", "run.steps=3",
            "run.eval_every=0", "data.train_size=200", "data.eval_size=20", "rollout.prompts_per_step=8",
            "rollout.n=4", "rollout.max_new_tokens=4", "actor.micro_batch=8", "actor.lr=1e-2",
            "reward.fn=reward_fixtures:digit_fraction", "rollout.check_weight_sync=true", ALL_ON_THE_GPU]
    train(C.load(ReasoningConfig, None, base + list(overrides)), cluster=cluster)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_grpo_on_one_gpu_learns_with_its_models_on_the_gpu(gpu_cluster, tmp_path):
    rows = run(gpu_cluster, tmp_path, "learn", "run.steps=20", "rollout.n=8", "actor.micro_batch=64",
               "actor.lr=3e-3")
    for r in rows:
        assert r["actor/max_memory_gb"] > 0, r  # the actor's model and batches were on the GPU
        assert r["sync/checked"] == 1, r  # the rollout holds the actor's weights bit for bit
        assert r["actor/logprob_diff"] < 1e-3, r  # float32 on both sides (GPU kernels: not bit-equal)
    reward = [r["reward/mean"] for r in rows]
    first, last = sum(reward[:4]) / 4, sum(reward[-4:]) / 4
    assert last > first + 0.15, f"mean reward did not rise: first steps {reward[:4]}, last steps {reward[-4:]}"


def test_bf16_mixed_precision_on_a_gpu_syncs_half_the_bytes_within_the_logprob_tolerance(gpu_cluster, tmp_path):
    fp32 = run(gpu_cluster, tmp_path, "fp32")
    mixed = run(gpu_cluster, tmp_path, "mixed", "model.dtype=bfloat16")
    for a, b in zip(fp32, mixed, strict=True):
        assert b["sync/checked"] == 1 and b["sync/bytes"] * 2 == a["sync/bytes"], b
        assert 0 < b["actor/logprob_diff"] < BF16_LOGPROB_TOLERANCE, b
        assert b["actor/grad_norm"] > 0 and b["actor/max_memory_gb"] > 0, b


def test_offload_on_a_gpu_moves_state_off_it_between_turns_and_trains_as_resident(gpu_cluster, tmp_path):
    """Every stateful component holds a model (old and reference policies, the actor's optimizer): with
    `cluster.offload=true` each moves its state to pinned host memory when its turn on the GPU ends."""
    stateful = ["algorithm.kl_coef=0.01", "algorithm.old_logprobs=recompute", "run.save_every=3"]
    resident = run(gpu_cluster, tmp_path, "resident", *stateful)
    switched = run(gpu_cluster, tmp_path, "switched", *stateful, "cluster.offload=true")
    for a, b in zip(resident, switched, strict=True):
        assert b["offload/state_bytes"] > 0, b
        for k in ("reward/mean", "actor/pg_loss", "actor/kl"):
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), (a["step"], k, a[k], b[k])
    final = "checkpoints/step_3/model/model.safetensors"
    wa, wb = (load_file(str(tmp_path / name / final)) for name in ("resident", "switched"))
    assert all((wa[k] - wb[k]).abs().max() < 1e-4 for k in wa)


def test_the_embodied_flow_runs_on_gpu_devices(gpu_cluster, tmp_path):
    """The embodied policies (small MLPs) stay on the CPU on GPU devices; the flow runs as on CPU slots."""
    cfg = C.load(EmbodiedConfig, "ppo_cartpole", [f"run.dir={tmp_path}", "run.name=cartpole", "run.progress=false",
                                                     "run.steps=2", "cluster.placement=env,rollout,actor: 0"])
    train_embodied(cfg, gpu_cluster)
    rows = [json.loads(line) for line in (tmp_path / "cartpole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)
