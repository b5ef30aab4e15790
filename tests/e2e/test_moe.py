"""A mixture of experts through the reasoning flow (issue 17): a tiny Qwen2-MoE (`model.tiny_arch=qwen2_moe`: 4
routed experts, 2 per token, and a shared expert) generates with HF generate (the native engine runs dense Qwen2 and
Llama only, and says so), trains plain and FSDP2-sharded, and its logprobs agree between rollout and trainer."""

import json

import pytest
import torch
from safetensors.torch import load_file

from m2flow import config as C
from m2flow.engines.hf import load_model
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.flow import train


def run(cluster, tmp_path, name, *overrides):
    base = [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.trace=false", "run.steps=2",
            "run.eval_every=0", "data.train_size=200", "data.eval_size=20", "model.tiny_arch=qwen2_moe",
            "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=4", "actor.micro_batch=8",
            "actor.lr=1e-2", "reward.fn=reward_fixtures:digit_fraction", "rollout.check_weight_sync=true"]
    # the native engine's warning is raised in the rollout's process; the metric rollout/native_engine says which ran
    train(C.load(ReasoningConfig, None, base + list(overrides)), cluster=cluster)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_a_mixture_of_experts_trains_plain_and_sharded_alike(cluster, tmp_path):
    one = run(cluster, tmp_path, "one", "actor.share_prompts=false",
              "cluster.placement=rollout,reward,inference: 0; actor: 1")
    two = run(cluster, tmp_path, "two", "actor.share_prompts=false", "actor.backend=fsdp2",
              "cluster.placement=rollout,reward,inference: 0; actor: 0-1")
    for a, b in zip(one, two):
        assert a["rollout/native_engine"] == b["rollout/native_engine"] == 0  # HF generate took over
        assert b["sync/checked"] == 1  # the sharded actor's gathered experts reached the rollout bit for bit
        # on-policy, the rollout's logprobs are the old ones: the trainer computes the same to float rounding
        assert abs(a["actor/ratio_max"] - 1) < 1e-3 and abs(a["actor/ratio_min"] - 1) < 1e-3, a
        assert a["actor/grad_norm"] > 0
        for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)
    wa = load_file(str(tmp_path / "one" / "checkpoints" / "step_2" / "model" / "model.safetensors"))
    wb = load_file(str(tmp_path / "two" / "checkpoints" / "step_2" / "model" / "model.safetensors"))
    experts = [k for k in wa if ".mlp.experts." in k]  # per layer, the 4 experts' weights stacked
    assert len(experts) == 2 * 2 and all(wa[k].shape[0] == 4 for k in experts), experts
    for k in wa:  # Adam at lr 1e-2 turns a gradient's rounding on a near-zero entry into up to ~4e-5 of weight
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-4)
    model = load_model(tmp_path / "one" / "checkpoints" / "step_2" / "model")
    assert model.config.model_type == "qwen2_moe" and model.config.num_experts == 4


def test_shared_prompt_passes_train_a_mixture_of_experts_as_plain_passes_do(cluster, tmp_path):
    shared = run(cluster, tmp_path, "shared", "cluster.placement=rollout,reward,inference,actor: 0-1:0")
    plain = run(cluster, tmp_path, "plain", "actor.share_prompts=false",
                "cluster.placement=rollout,reward,inference,actor: 0-1:0")
    assert all(a["actor/forward_tokens"] < b["actor/forward_tokens"] for a, b in zip(shared, plain))
    for a, b in zip(shared, plain):
        for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5), (a["step"], k)
