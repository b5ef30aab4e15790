"""LoRA in real runs (`model.lora`, issue 17): the actor trains only the adapters; a weight sync sends only them and
each receiver applies them to its frozen base, holding the actor's merged weights bit for bit (checked every step);
checkpoints hold the adapters (a PEFT directory) and `model/` merged; a run resumes as it would have gone on."""

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from m2flow import config as C
from m2flow.engines.hf import load_model
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.evaluation import evaluate_model
from m2flow.reasoning.flow import train

TOOL_TRACE_TOKENS = 44  # <calc>37+45</calc><result>82</result>82 and eos, with room


def run(cluster, tmp_path, name, *overrides):
    base = [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.trace=false",
            "data.train_size=2000", "data.eval_size=100", "sft.batch_size=64"]
    train(C.load(ReasoningConfig, None, base + list(overrides)), cluster=cluster)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_a_lora_run_learns_and_syncs_only_its_adapters(cluster, tmp_path):
    """The tool-use warm start of the agent preset (the model calls the calculator on about half of its samples),
    then GRPO with rank-16 adapters, rollout on device 0 and the actor on device 1: held-out accuracy rises as with
    full fine-tuning (docs/agent.md), while each sync moves the adapters only."""
    rows = run(cluster, tmp_path, "lora", "agent.tools={calc: calc}", "sft.steps=600", "sft.tool_fraction=0.5",
               f"rollout.max_new_tokens={TOOL_TRACE_TOKENS}", "rollout.prompts_per_step=16", "rollout.n=8",
               "run.steps=6", "run.eval_every=6", "model.lora.r=16", "model.lora.alpha=32", "actor.lr=2e-3",
               "rollout.check_weight_sync=true", "cluster.placement=rollout: 0; reward,inference,actor: 1")
    steps = [r for r in rows if "sync/bytes" in r]
    held_out = [r["eval/pass@1"] for r in rows if "eval/pass@1" in r]
    print(f"\nheld-out pass@1 {held_out}, sync bytes {steps[0]['sync/bytes']}")
    assert len(steps) == 6 and all(r["sync/checked"] == 1 for r in steps)  # merged weights equal, bit for bit
    assert len(held_out) == 2 and held_out[1] >= held_out[0] + 0.15, held_out

    ckpt = tmp_path / "lora" / "checkpoints" / "step_6"
    adapters = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    assert all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert all(r["sync/bytes"] == adapter_bytes for r in steps)  # the adapters, nothing else
    model_bytes = sum(t.numel() * t.element_size() for t in load_model(ckpt / "model").state_dict().values())
    assert adapter_bytes < model_bytes / 2

    # model/ is the merged model, a plain HF directory: `m2flow eval` scores it as the run's last evaluation did
    merged = load_file(str(ckpt / "model" / "model.safetensors"))
    assert not any("lora" in n or "base_layer" in n for n in merged)
    cfg = C.load(ReasoningConfig, str(tmp_path / "lora" / "config.yaml"))
    assert evaluate_model(str(ckpt / "model"), cfg, k=1)["pass@1"] == pytest.approx(held_out[1], abs=0.011)
    # and adapter/ on the warm-start model is the same function
    peft = PeftModel.from_pretrained(load_model(tmp_path / "lora" / "sft_model"), str(ckpt / "adapter")).eval()
    x = torch.randint(3, 20, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(peft(x).logits, load_model(ckpt / "model").eval()(x).logits, rtol=1e-4, atol=1e-4)


def test_a_lora_run_resumes_as_an_uninterrupted_run(cluster, tmp_path):
    """Merged-weight syncs (`model.lora.sync=merged`), one process: stopped after step 2 and resumed, step 3 and 4
    equal a run that went through, adapters and all (the optimizer state holds only the adapters')."""
    common = ["model.lora.r=8", "model.lora.sync=merged", "reward.fn=reward_fixtures:digit_fraction", "actor.lr=1e-2",
              "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=4", "actor.micro_batch=8",
              "run.eval_every=0", "cluster.placement=rollout,reward,inference,actor: 0-1:0"]
    full = run(cluster, tmp_path, "full", "run.steps=4", *common)
    run(cluster, tmp_path, "parted", "run.steps=2", "run.save_every=2", *common)
    parted = run(cluster, tmp_path, "parted", "run.steps=4", "run.save_every=2", "run.resume=true", *common)
    assert [r["step"] for r in parted] == [1, 2, 3, 4]
    full_bytes = sum(t.numel() * t.element_size()
                     for t in load_model(tmp_path / "full" / "init_model").state_dict().values())
    assert all(r["sync/bytes"] == full_bytes for r in full)  # merged: the whole model
    assert_same_steps_and_weights(full[2:], parted[2:], tmp_path / "full", tmp_path / "parted", 4)


def test_a_sharded_lora_actor_trains_as_one_process_does(cluster, tmp_path):
    """`actor.backend=fsdp2` over 2 ranks with adapters: the adapters are sharded with the frozen base, gathered one
    tensor at a time for each sync (checked every step) and checkpoint; the steps equal a one-process actor's."""
    common = ["model.lora.r=8", "reward.fn=reward_fixtures:digit_fraction", "actor.lr=1e-2", "run.steps=2",
              "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=4", "actor.micro_batch=8",
              "actor.share_prompts=false", "run.eval_every=0", "rollout.check_weight_sync=true"]
    one = run(cluster, tmp_path, "one", *common, "cluster.placement=rollout,reward,inference: 0; actor: 1")
    two = run(cluster, tmp_path, "two", *common, "actor.backend=fsdp2",
              "cluster.placement=rollout,reward,inference: 0; actor: 0-1")
    assert all(a["sync/bytes"] == b["sync/bytes"] and b["sync/checked"] == 1 for a, b in zip(one, two))
    assert_same_steps_and_weights(one, two, tmp_path / "one", tmp_path / "two", 2)


def assert_same_steps_and_weights(rows_a, rows_b, run_a, run_b, step: int) -> None:
    """Two runs' step metrics, and their checkpoint's adapters and merged model, equal to float rounding."""
    for a, b in zip(rows_a, rows_b, strict=True):
        for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)
    for part in ("adapter/adapter_model.safetensors", "model/model.safetensors"):
        wa = load_file(str(run_a / "checkpoints" / f"step_{step}" / part))
        wb = load_file(str(run_b / "checkpoints" / f"step_{step}" / part))
        assert wa.keys() == wb.keys()
        for k in wa:  # Adam moves a weight by up to lr per update, whatever the size of its gradient: a gradient near
            # 0 that rounds otherwise moves it by a share of lr (2.2e-5 with lr 1e-2 on an AVX-512 CPU, one of 512)
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-4)
