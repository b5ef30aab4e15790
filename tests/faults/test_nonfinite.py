"""No silent garbage (issue 20): a learning rate that wrecks the model, a model directory with NaN weights, a reward
function that cannot score and a non-finite loss each stop the run with a message naming the component and what went wrong, or, with
`actor.nonfinite=skip`, drop the update and count it. Each ends in bounded time."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from m2flow import config as C
from m2flow.embodied import flow as embodied
from m2flow.embodied.config import EmbodiedConfig
from m2flow.engines.hf import init_tiny_model
from m2flow.engines.train import collate
from m2flow.reasoning import flow as reasoning
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.workers.actor import ActorWorker
from m2flow.runtime import Channel, WorkerError, parse_placement, release_all
from m2flow.runtime.stream import finish
from m2flow.runtime.weights import fetch
from m2flow.types import Batch


def reasoning_cfg(tmp_path, name, *overrides):
    return C.load(ReasoningConfig, None, [
        f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.trace=false", "run.steps=3",
        "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=4", "data.train_size=100",
        "data.eval_size=10",
        "cluster.placement=rollout,reward,inference,actor: 0-1:0", *overrides])


@pytest.mark.timeout(300)
def test_a_learning_rate_that_wrecks_the_model_stops_the_run(cluster, tmp_path):
    """actor.lr=1e6 once ran to the end with exit 0 and a destroyed model (loss 0, grad norm 0, reward 0). A reward
    with partial credit, so that the first step has a gradient to take."""
    with pytest.raises(WorkerError, match=r"actor rank 0: train\(\) raised FloatingPointError: actor: one training "
                                          r"step multiplied the norm of the weights by .*actor.lr=1e\+06 is far too high"):
        reasoning.train(reasoning_cfg(tmp_path, "lr", "actor.lr=1e6", "reward.fn=faulty_rewards:share_of_digits"), cluster)
    assert not (tmp_path / "lr" / "checkpoints" / "step_3").exists()


@pytest.mark.timeout(300)
def test_nan_weights_in_the_model_directory_are_named_by_the_rollout(cluster, tmp_path):
    """Once `index 260 is out of bounds for dimension 1 with size 260` inside the sampler."""
    model = init_tiny_model(tmp_path / "nan_model", seed=0)
    weights = load_file(str(model / "model.safetensors"))
    name = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WorkerError, match=r"rollout rank 0: generate\(\) raised FloatingPointError: the model produced "
                                          r"non-finite logits \(NaN or inf\) in \d+ of \d+ sequences"):
        reasoning.train(reasoning_cfg(tmp_path, "nan_model", f"model.path={model}"), cluster)


@pytest.mark.timeout(300)
def test_a_reward_function_that_cannot_score_most_samples_stops_the_run(cluster, tmp_path):
    """Once every sample scored 0, counted in reward/errors, and the run exited 0. This function scores the reference
    answer (so the check before the run passes) and raises on anything else, as on most of an untrained model's."""
    with pytest.raises(WorkerError, match=r"reward rank 0: score\(\) raised RuntimeError: reward.fn "
                                          r"faulty_rewards:fails_unless_right: \d+ of the 32 samples of step 1 could not "
                                          r"be scored \(more than reward.max_error_fraction=0.5\); the first: raised "
                                          r"ValueError: cannot parse"):
        reasoning.train(reasoning_cfg(tmp_path, "reward", "reward.fn=faulty_rewards:fails_unless_right"), cluster)
    assert not (tmp_path / "reward" / "checkpoints" / "step_1").exists()


@pytest.mark.timeout(300)
def test_embodied_learning_rate_that_wrecks_the_policy_stops_the_run(cluster, tmp_path):
    cfg = C.load(EmbodiedConfig, None, [
        f"run.dir={tmp_path}", "run.name=lr", "run.progress=false", "run.trace=false", "run.steps=3",
        "env.id=CartPole-v1", "env.num_envs=4", "rollout.steps=16", "eval.episodes=0", "actor.lr=1e6"])
    with pytest.raises(WorkerError, match=r"actor rank 0: train\(\) raised FloatingPointError: actor: one training "
                                          r"step multiplied the norm of the weights"):
        embodied.train(cfg, cluster)


def nan_batch(n: int = 6) -> Batch:
    """Samples whose advantages are NaN: the loss, and so every gradient, is NaN."""
    rng = random.Random(0)
    pairs = [([rng.randrange(4, 18) for _ in range(4)], [rng.randrange(4, 18) for _ in range(3)]) for _ in range(n)]
    batch = Batch(dict(collate(pairs, pad_id=0)))
    batch["advantages"] = torch.full((n,), float("nan"))
    batch["old_logprobs"] = torch.zeros(batch["input_ids"].shape)
    return batch


def train_on(actor, batch: Batch, step: int) -> dict:
    channel = Channel.create(f"nonfinite-{step}-{random.random()}")
    try:
        channel.put(batch)
        finish(channel)
        return actor.train(channel, step).wait()[0]
    finally:
        channel.destroy()


@pytest.mark.timeout(300)
def test_a_nan_loss_stops_the_step_naming_it_or_is_skipped_and_counted(cluster, tmp_path):
    model = init_tiny_model(tmp_path / "model", seed=1)
    placement = parse_placement("actor: 0", 2)["actor"]
    stop = ActorWorker.launch(cluster, placement, reasoning_cfg(tmp_path, "stop"), str(model))
    skip = ActorWorker.launch(cluster, placement, reasoning_cfg(tmp_path, "skip", "actor.nonfinite=skip"), str(model))
    try:
        with pytest.raises(WorkerError, match=r"actor rank 0: train\(\) raised FloatingPointError: actor: non-finite "
                                              r"gradient \(norm nan\), first non-finite: the loss of micro-batch 0 "
                                              r"\(.*actor/pg_loss nan.*the update was not applied"):
            train_on(stop, nan_batch(), 0)
        before = {k: v.clone() for k, v in fetch(skip.publish_weights().wait()[0]).items()}
        metrics = train_on(skip, nan_batch(), 0)
        after = fetch(skip.publish_weights().wait()[0])
        assert metrics["actor/nonfinite_skipped"] == 1 and metrics["actor/samples"] == 0
        assert all(torch.equal(before[k], after[k]) for k in before)  # the update was dropped, whole
        json.dumps(metrics)  # the row metrics.jsonl would get is plain data
    finally:
        release_all([stop, skip])


@pytest.mark.timeout(300)
def test_the_cli_reports_a_failed_worker_in_a_few_lines_with_exit_code_1(tmp_path):
    """What a person sees: the component and rank, what it raised, the end of its own traceback; no driver
    traceback (that is `--debug`)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "m2flow.cli", "train", "ppo_cartpole", f"run.dir={tmp_path}", "run.progress=false",
           "run.steps=3", "env.num_envs=4", "rollout.steps=16", "eval.episodes=0", "actor.lr=1e6",
           "cluster.placement=env,rollout,actor: 0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    err = [line for line in proc.stderr.splitlines() if not line.startswith(("20", "(", "[", "WARNING", "\x1b"))]
    assert proc.returncode == 1, proc.stderr[-3000:]
    start = next(i for i, line in enumerate(err) if line.startswith("m2flow: "))
    assert err[start].startswith("m2flow: actor rank 0 failed: train() raised FloatingPointError: actor: one training "
                                 "step multiplied the norm of the weights by"), proc.stderr[-3000:]
    assert err[start + 1] == "  the worker's traceback ends:" and "--debug" in err[-1]
    assert len(err) - start <= 10 and "Traceback (most recent call last)" not in proc.stderr
