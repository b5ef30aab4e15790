"""bf16 (issue 17): `model.dtype=bfloat16` gives the rollout and inference bf16 weights and, with
`model.mixed_precision` (the default), the actor and critic float32 master weights and optimizer state computing in
bf16 (autocast). A weight sync sends the master weights rounded to bf16, half the bytes, and the receivers hold them
bit for bit; the rollout's and the trainer's logprobs then differ by bf16 rounding, within the documented tolerance."""

import json

import pytest
import torch
from safetensors.torch import load_file

from m2flow import config as C
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.flow import train

# README (bf16): the mean |trainer - rollout| logprob per response token on a bf16 run (float32: ~1e-7)
BF16_LOGPROB_TOLERANCE = 0.05


def run(cluster, tmp_path, name, *overrides):
    base = [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.trace=false", "run.steps=3",
            "run.eval_every=0", "data.train_size=200", "data.eval_size=20", "rollout.prompts_per_step=8",
            "rollout.n=4", "rollout.max_new_tokens=4", "actor.micro_batch=8", "actor.lr=1e-2",
            "reward.fn=reward_fixtures:digit_fraction", "rollout.check_weight_sync=true"]
    train(C.load(ReasoningConfig, None, base + list(overrides)), cluster=cluster)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def exported(tmp_path, name, step=3):
    return load_file(str(tmp_path / name / "checkpoints" / f"step_{step}" / "model" / "model.safetensors"))


def on_bf16_grid(t: torch.Tensor) -> bool:
    return bool((t.to(torch.bfloat16).float() == t.float()).all())


def test_mixed_precision_keeps_float32_masters_and_syncs_bf16(cluster, tmp_path):
    split = "cluster.placement=rollout,reward,inference: 0; actor: 1"
    fp32 = run(cluster, tmp_path, "fp32", split)
    mixed = run(cluster, tmp_path, "mixed", split, "model.dtype=bfloat16")
    for a, b in zip(fp32, mixed):
        assert b["sync/checked"] == 1  # the rollout holds the masters rounded to bf16, bit for bit
        assert b["sync/bytes"] * 2 == a["sync/bytes"]  # 2 bytes a weight instead of 4
        assert a["actor/logprob_diff"] < 1e-5  # float32 engines agree to float rounding
        assert 1e-5 < b["actor/logprob_diff"] < BF16_LOGPROB_TOLERANCE, b
        assert b["actor/grad_norm"] > 0
    # the trained weights are float32 masters: after three updates they are off the bf16 grid
    masters = exported(tmp_path, "mixed")
    assert all(t.dtype == torch.float32 for t in masters.values())
    assert not all(on_bf16_grid(t) for t in masters.values())
    # pure bf16 (mixed_precision=false) trains the bf16 weights themselves
    pure = run(cluster, tmp_path, "pure", split, "model.dtype=bfloat16", "model.mixed_precision=false",
               "run.steps=1")
    assert pure[0]["sync/bytes"] == mixed[0]["sync/bytes"] and pure[0]["sync/checked"] == 1
    assert all(on_bf16_grid(t) for t in exported(tmp_path, "pure", step=1).values())


def test_mixed_precision_shards_and_trains_a_critic_and_adapters(cluster, tmp_path):
    """FSDP2 over 2 ranks autocasts over float32 shards: it computes what one process computes. PPO's critic and
    LoRA adapters (their checked syncs merged in bf16 as each receiver merges) run in bf16 too."""
    common = ["run.steps=2", "model.dtype=bfloat16", "algorithm.name=ppo", "algorithm.advantage=gae", "critic.lr=1e-4",
              "model.lora.r=8", "actor.share_prompts=false"]
    one = run(cluster, tmp_path, "one", *common, "cluster.placement=rollout,reward,inference: 0; actor,critic: 1")
    two = run(cluster, tmp_path, "two", *common, "actor.backend=fsdp2",  # two sharded groups on the same devices
              "cluster.placement=rollout,reward,inference: 0; actor,critic: 0-1")
    for a, b in zip(one, two):
        assert a["sync/checked"] == b["sync/checked"] == 1
        assert a["critic/samples"] > 0 and a["actor/logprob_diff"] < BF16_LOGPROB_TOLERANCE
        assert a["reward/mean"] == b["reward/mean"]  # the same samples
        # step 1 to bf16 rounding of a sum split over two ranks; after an update (Adam moves each weight by about lr
        # x the sign of its gradient) that rounding shows at bf16's precision, 2^-8 = 0.4%
        rel = 1e-3 if a["step"] == 1 else 1e-2
        for k in ("critic/value_mean", "critic/vf_loss", "critic/advantage_std", "critic/grad_norm", "actor/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=rel, abs=1e-6), (a["step"], k, a[k], b[k])
