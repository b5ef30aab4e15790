"""The reasoning flow end to end on a tiny model: collocated and pipelined plans, learning, resume, bad input."""

import json
import math
import random
import re
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch
import yaml
from safetensors.torch import load_file

from m2flow import config as C
from m2flow.embodied.config import EmbodiedConfig
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.flow import train
from m2flow.runtime import WorkerError

KEYS = {"reward/mean", "reward/accuracy", "response/length_mean", "actor/pg_loss", "actor/entropy", "actor/clipfrac",
        "actor/approx_kl", "actor/grad_norm", "rollout/tokens_per_s", "time/step", "time/rollout", "time/weight_sync"}


def make_cfg(tmp_path, name, *overrides):
    base = [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.steps=3",
            "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=4", "actor.micro_batch=8",
            "actor.lr=1e-3", "data.train_size=200", "data.eval_size=20"]
    return C.load(ReasoningConfig, None, base + list(overrides))


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(path):
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("placement,mode", [
    ("rollout,reward,inference,actor: 0-1:0", "collocated"),
    ("rollout: 0; reward,inference,actor: 1", "hybrid"),
])
def test_grpo_steps_train_and_sync(cluster, tmp_path, placement, mode):
    cfg = make_cfg(tmp_path, mode, f"cluster.placement={placement}", "reward.fn=reward_fixtures:digit_fraction",
                   "algorithm.kl_coef=0.01")
    out = train(cfg, cluster)
    assert out["plan"]["mode"] == mode
    metrics = rows(tmp_path / mode)
    assert [r["step"] for r in metrics] == [1, 2, 3]
    for r in metrics:
        assert KEYS <= set(r), KEYS - set(r)
        assert all(math.isfinite(r[k]) for k in KEYS)
    assert any(r["actor/grad_norm"] > 0 for r in metrics)
    for r in metrics:  # per device: step wall time minus the union of its spans
        idle = [r["time/idle/device0"], r["time/idle/device1"]]
        assert all(0 <= s < r["time/step"] for s in idle), (r["step"], idle, r["time/step"])
        assert r["time/idle_fraction"] == pytest.approx(sum(idle) / (2 * r["time/step"]), rel=0.05)
    before = weights(tmp_path / mode / "init_model")
    after = weights(tmp_path / mode / "checkpoints" / "step_3" / "model")
    assert any(not torch.equal(before[k], after[k]) for k in before), "training did not change the weights"
    # rollout.check_weight_sync=first: the start's sync and step 1's verified rollout == actor weights (else train()
    # raised); later syncs trust the transport
    assert [r["sync/checked"] for r in metrics] == [1, 0, 0]
    trace = json.loads((tmp_path / mode / "trace.json").read_text())
    phases = {e.get("name") for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"generate", "reward", "logprobs", "train"} <= phases
    idle = [e for e in trace["traceEvents"] if e.get("ph") == "C" and e["name"] == "idle_fraction"]
    assert sorted(e["pid"] for e in idle) == [0, 0, 0, 1, 1, 1]  # each step's idle share on each device's lane
    by_step = {r["step"]: r["time/idle/device1"] / r["time/step"] for r in metrics}
    got = sorted(e["args"]["idle_fraction"] for e in idle if e["pid"] == 1)
    assert got == pytest.approx(sorted(by_step.values()), rel=0.05)


def test_collocated_components_share_one_process_and_train_as_in_four(cluster, tmp_path):
    """rollout.cohost (default): a collocated plan builds reward, inference and actor in the rollout's process. The
    stages take turns there exactly as four processes take turns on the device: the same metrics, the same weights."""
    common = ["cluster.placement=rollout,reward,inference,actor: 0-1:0", "reward.fn=reward_fixtures:digit_fraction",
              "run.steps=2"]
    for name, flag in (("one", "true"), ("four", "false")):
        train(make_cfg(tmp_path, name, f"rollout.cohost={flag}", *common), cluster)
    pids = {}
    for name in ("one", "four"):
        events = json.loads((tmp_path / name / "trace.json").read_text())["traceEvents"]
        pids[name] = {e["cat"]: e["args"]["pid"] for e in events if e.get("ph") == "X"}
        assert set(pids[name]) == {"rollout", "reward", "inference", "actor"}  # inference only collates here
    assert len(set(pids["one"].values())) == 1 and len(set(pids["four"].values())) == 4
    assert [yaml.safe_load((tmp_path / n / "plan.yaml").read_text())["cohosted"] for n in ("one", "four")] == [True,
                                                                                                              False]
    for a, b in zip(rows(tmp_path / "one"), rows(tmp_path / "four")):
        for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response/length_mean"):
            assert a[k] == b[k], (a["step"], k)
    wa, wb = weights(tmp_path / "one" / "checkpoints" / "step_2" / "model"), weights(
        tmp_path / "four" / "checkpoints" / "step_2" / "model")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_micro_batches_by_tokens_change_the_passes_not_the_update(cluster, tmp_path):
    """actor.micro_batch_tokens (default 8192) cuts the collocated whole batch (32 samples of a dozen tokens) into one
    forward/backward; 0 falls back to actor.micro_batch samples per pass (8 passes of 4). Same update up to rounding."""
    common = ["cluster.placement=rollout,reward,inference,actor: 0-1:0", "reward.fn=reward_fixtures:digit_fraction",
              "run.steps=2", "actor.micro_batch=4"]
    train(make_cfg(tmp_path, "tokens", *common), cluster)
    train(make_cfg(tmp_path, "samples", "actor.micro_batch_tokens=0", *common), cluster)
    by_tokens, by_samples = rows(tmp_path / "tokens"), rows(tmp_path / "samples")
    assert [r["actor/micro_batches"] for r in by_tokens] == [1, 1]
    assert [r["actor/micro_batches"] for r in by_samples] == [8, 8]
    for a, b in zip(by_tokens, by_samples):
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)
    wa, wb = (weights(tmp_path / n / "checkpoints" / "step_2" / "model") for n in ("tokens", "samples"))
    for k in wa:  # Adam moves a weight by up to lr (1e-3) per update, whatever the size of its gradient: a gradient
        # near 0 that rounds otherwise moves it by a share of lr (1.5e-5 on an AVX-512 CPU, one weight of 16384)
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-4)
    with pytest.raises(C.ConfigError, match="actor.micro_batch_tokens must be >= 0, got -1"):
        make_cfg(tmp_path, "bad", "actor.micro_batch_tokens=-1")


def test_shared_prompts_send_fewer_tokens_through_the_model_for_the_same_update(cluster, tmp_path):
    """actor.share_prompts (default on): the actor forwards each group's prompt once. With 2 epochs and a KL term the
    inference stage's old and reference logprobs go through the same pass. Every step forwards fewer tokens than with
    share_prompts=false and makes the same update, to float rounding."""
    common = ["cluster.placement=rollout,reward,inference,actor: 0-1:0", "reward.fn=reward_fixtures:digit_fraction",
              "run.steps=2", "actor.epochs=2", "algorithm.kl_coef=0.05"]
    train(make_cfg(tmp_path, "shared", *common), cluster)
    train(make_cfg(tmp_path, "plain", "actor.share_prompts=false", *common), cluster)
    shared, plain = rows(tmp_path / "shared"), rows(tmp_path / "plain")
    for a, b in zip(shared, plain):
        assert 0 < a["actor/forward_tokens"] < 0.9 * b["actor/forward_tokens"], a["step"]
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl", "actor/approx_kl"):
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-6), (a["step"], k)
    ws, wp = (weights(tmp_path / n / "checkpoints" / "step_2" / "model") for n in ("shared", "plain"))
    for k in ws:  # Adam moves a weight by up to lr (1e-3) per update, whatever the size of its gradient
        torch.testing.assert_close(ws[k], wp[k], rtol=1e-4, atol=1e-4)


def test_pipelined_trace_overlaps_rollout_and_training(cluster, tmp_path):
    """In the pipelined plan the inference/actor device works while rollout still generates. With 8 decode slots for
    16 prompts x 4 samples the engine finishes two prompt groups at a time (continuous batching), so each micro-batch
    of 8 samples is ready several waves before generation ends; with passes of at most 64 padded tokens
    (`actor.micro_batch_tokens`) the actor trains on each as it arrives."""
    cfg = make_cfg(tmp_path, "overlap", "cluster.placement=rollout: 0; reward,inference,actor: 1",
                   "rollout.prompts_per_step=16", "actor.micro_batch=8", "rollout.max_new_tokens=8", "run.steps=2",
                   "rollout.engine=native", "rollout.max_slots=8", "actor.micro_batch_tokens=64")
    train(cfg, cluster)
    events = [e for e in json.loads((tmp_path / "overlap" / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    gen = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "generate"]
    consume = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] in ("logprobs", "train")]
    overlapped = sum(1 for a, b in consume for g0, g1 in gen if a < g1 and b > g0)
    assert overlapped >= 1, "no inference/train span ran while rollout was generating"


def trace_phases(run_dir):
    return {e.get("name") for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"}


def test_on_policy_steps_reuse_the_rollout_logprobs(cluster, tmp_path):
    """1 epoch, 1 mini-batch: `algorithm.old_logprobs: auto` takes the engine's behaviour logprobs instead of an
    inference forward pass (no logprobs span, no weight sync to inference) and learns as a recomputing run does."""
    common = ["cluster.placement=rollout,reward,inference,actor: 0-1:0", "reward.fn=reward_fixtures:digit_fraction",
              "run.steps=2"]
    train(make_cfg(tmp_path, "reuse", *common), cluster)
    train(make_cfg(tmp_path, "recompute", "algorithm.old_logprobs=recompute", *common), cluster)
    reuse, recompute = rows(tmp_path / "reuse"), rows(tmp_path / "recompute")
    assert reuse[0]["reward/mean"] == recompute[0]["reward/mean"]  # same weights, same seeds: same samples
    for a, b in zip(reuse, recompute):
        # the ratio differs from 1 by ~1e-5 (engine vs trainer logprobs); pg_loss is a mean of +-advantages near 0
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], abs=1e-4), a["step"]
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-2, abs=1e-6), a["step"]
        assert a["actor/clipfrac"] == 0 and abs(a["actor/approx_kl"]) < 1e-5  # the ratio is 1 to rounding
    wa = weights(tmp_path / "reuse" / "checkpoints" / "step_2" / "model")
    wb = weights(tmp_path / "recompute" / "checkpoints" / "step_2" / "model")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-4)
    assert "logprobs" not in trace_phases(tmp_path / "reuse") and "train" in trace_phases(tmp_path / "reuse")
    assert "logprobs" in trace_phases(tmp_path / "recompute")
    assert make_cfg(tmp_path, "x").recompute_old_logprobs() is False
    assert make_cfg(tmp_path, "x", "actor.epochs=2").recompute_old_logprobs() is True
    assert make_cfg(tmp_path, "x", "actor.mini_batches=2").recompute_old_logprobs() is True
    assert make_cfg(tmp_path, "x", "actor.epochs=2", "algorithm.old_logprobs=rollout").recompute_old_logprobs() is False
    with pytest.raises(C.ConfigError, match=re.escape("algorithm.old_logprobs must be auto | recompute | rollout, got 'old'")):
        make_cfg(tmp_path, "x", "algorithm.old_logprobs=old")
    with pytest.raises(C.ConfigError, match=re.escape("rollout.check_weight_sync must be first | true | false, got 'last'")):
        make_cfg(tmp_path, "x", "rollout.check_weight_sync=last")
    with pytest.raises(C.ConfigError, match=re.escape("rollout.check_weight_sync must be first | true | false, got 'often'")):
        C.load(EmbodiedConfig, None, ["rollout.check_weight_sync=often"])
    assert [C.load(EmbodiedConfig, None, [f"rollout.check_weight_sync={v}"]).rollout.checks_sync(2)
            for v in ("first", "true", "false")] == [False, True, False]


def test_reward_rises_on_a_learnable_task(cluster, tmp_path):
    cfg = make_cfg(tmp_path, "learn", "run.steps=20", "reward.fn=reward_fixtures:digit_fraction",
                   "rollout.prompts_per_step=8", "rollout.n=8", "actor.micro_batch=64", "actor.lr=3e-3",
                   "cluster.placement=rollout: 0; reward,inference,actor: 1")
    train(cfg, cluster)
    r = [row["reward/mean"] for row in rows(tmp_path / "learn")]
    first, last = sum(r[:4]) / 4, sum(r[-4:]) / 4
    assert last > first + 0.15, f"mean reward did not rise: first steps {r[:4]}, last steps {r[-4:]}"


def test_held_out_accuracy_every_n_steps_is_that_of_the_weights_of_that_step(cluster, tmp_path):
    """`run.eval_every=1`, pipelined and one step off-policy: the rollout worker scores the start model (step 0) and
    every step's synced weights on the held-out split with the run's reward; a row waits for its evaluation while the
    next step is handed out. The figures equal this process's evaluation of the saved models (to one problem)."""
    from m2flow.reasoning.evaluation import evaluate_model

    cfg = make_cfg(tmp_path, "ev", "run.plots=true", "run.steps=4", "run.eval_every=1", "run.save_every=3", "actor.lr=1e-2",
                   "algorithm.max_staleness=1", "reward.fn=reward_fixtures:even_first_char",
                   "cluster.placement=rollout: 0; reward,inference,actor: 1")
    train(cfg, cluster)
    run = tmp_path / "ev"
    metrics = rows(run)
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4] and all(r["eval/problems"] == 20 for r in metrics)
    flow = {r["step"]: r["eval/pass@1"] for r in metrics}
    here = {0: evaluate_model(str(run / "init_model"), cfg, k=1)["pass@1"],
            **{s: evaluate_model(str(run / "checkpoints" / f"step_{s}"), cfg, k=1)["pass@1"] for s in (3, 4)}}
    for s, accuracy in here.items():
        assert abs(flow[s] - accuracy) <= 1 / 20 + 1e-9, (s, flow, here)
    assert max(here.values()) > 0 and len(set(flow.values())) > 2, flow  # compared where it is not 0; it moved
    assert (run / "plots" / "heldout_accuracy.png").exists()


def test_adam_betas_and_eps_reach_the_actors_optimizer(cluster, tmp_path):
    """Adam's first step moves each weight by about lr (m / sqrt(v) = sign of the gradient); with `actor.eps=1e3` it
    moves them by about lr * |g| / 1e3, almost nothing."""
    common = ["run.steps=1", "actor.lr=1e-2", "reward.fn=reward_fixtures:digit_fraction"]  # the default placement
    moved = {}
    for name, extra in (("default", []), ("big_eps", ["actor.eps=1e3", "actor.betas=[0.5, 0.9]"])):
        result = train(make_cfg(tmp_path, name, *common, *extra), cluster)
        plan = yaml.safe_load((tmp_path / name / "plan.yaml").read_text())
        assert result["plan"]["mode"] == "collocated" and plan["cohosted"], plan  # one process over both devices
        before, after = weights(tmp_path / name / "init_model"), weights(tmp_path / name / "checkpoints" / "step_1" / "model")
        moved[name] = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved["default"] == pytest.approx(1e-2, rel=0.05) and moved["big_eps"] < 1e-4, moved
    with pytest.raises(C.ConfigError, match=re.escape("actor.betas must be two numbers [beta1, beta2], got [0.9]")):
        make_cfg(tmp_path, "x", "actor.betas=[0.9]")


def test_eval_of_a_checkpoint_uses_its_runs_data_reward_and_length(cluster, tmp_path, capsys):
    """`m2flow eval` on a run trained from a JSONL file (or on one of its checkpoints) scores that file's held-out
    split with the run's reward and generation length, not the default arithmetic task; overrides apply on top."""
    from m2flow import cli

    rng = random.Random(0)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(40)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{b}=", "result": str(a + b)}) + "\n" for a, b in pairs))
    train(make_cfg(tmp_path, "file", "run.steps=1", "data.task=file", f"data.path={data}", "data.prompt_key=question",
                   "data.answer_key=result", "data.eval_size=12", "reward.fn=exact_match", "rollout.max_new_tokens=3",
                   "cluster.placement=rollout,reward,inference,actor: 0-1:0"), cluster)
    checkpoint = tmp_path / "file" / "checkpoints" / "step_1"
    for target in (tmp_path / "file", checkpoint, checkpoint / "model"):  # a run directory: its newest checkpoint
        assert cli.main(["eval", str(target), "--k", "1"]) == 0
        out = capsys.readouterr().out
        assert f"model: {checkpoint / 'model'}" in out and f"config: the run's config ({checkpoint / 'config.yaml'})" in out
        assert f"data: {data}, held-out split (its last 12 records); reward exact_match, at most 3 new tokens" in out
        assert "problems: 12" in out
    assert cli.main(["eval", str(checkpoint), "--k", "1", "data.eval_size=5"]) == 0
    assert "problems: 5" in capsys.readouterr().out


def test_a_batched_reward_function_gets_each_groups_prompts_completions_answers_and_columns(cluster, tmp_path):
    train(make_cfg(tmp_path, "batched", "run.steps=1", "reward.fn=reward_fixtures:sums_checked"), cluster)
    (row,) = rows(tmp_path / "batched")
    assert row["reward/mean"] == 1.0 and row["reward/errors"] == 0  # every prompt arrived with its own answer
    data = tmp_path / "hints.jsonl"  # a file's other columns reach a batched function as keyword arguments
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a), "hint": str(2 * a)}) + "\n"
                            for a in range(10, 40)))
    train(make_cfg(tmp_path, "columns", "run.steps=1", "data.task=file", f"data.path={data}", "data.eval_size=5",
                   "reward.fn=reward_fixtures:hint_agrees"), cluster)
    (row,) = rows(tmp_path / "columns")
    assert row["reward/mean"] == 1.0 and row["reward/errors"] == 0


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_step_that_raises_kills_the_runs_processes_and_destroys_its_channels(cluster, tmp_path):
    """A batched reward that returns one reward too few fails the step with an error naming the reward worker; the
    run's worker processes are killed (not left running) and its channels are gone."""
    ppid = Path(tempfile.gettempdir(), "m2flow_wrong_count_ppid")
    ppid.unlink(missing_ok=True)
    with pytest.raises(WorkerError, match=r"reward rank 0.*wrong_count \(batched\) returned 3 rewards for 4"):
        train(make_cfg(tmp_path, "boom", "reward.fn=reward_fixtures:wrong_count",
                       "cluster.placement=rollout: 0; reward,inference,actor: 1"), cluster)
    pid = int(ppid.read_text())  # the reward worker's process, which called the function
    deadline = time.monotonic() + 30
    while (alive := running(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"the failed run's reward worker process {pid} is still running"
    run = str((tmp_path / "boom").resolve())
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if run in a["name"]]


class Touch:
    """Unpickling it creates a file: what a malicious checkpoint could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (Path(self.path),)


def test_a_checkpoint_holding_arbitrary_python_objects_is_refused(cluster, tmp_path):
    """Checkpoint state loads as tensors and plain data only: a driver.pt or actor_state.pt that would run code when
    unpickled is refused with an error naming the file, and the code never runs."""
    common = ["reward.fn=reward_fixtures:digit_fraction", "cluster.placement=rollout,reward,inference,actor: 0-1:0"]
    train(make_cfg(tmp_path, "shared", "run.steps=1", *common), cluster)
    ckpt = tmp_path / "shared" / "checkpoints" / "step_1"
    marker = tmp_path / "code_ran"
    for name, error, where in (("driver.pt", ValueError, ""), ("actor_state.pt", WorkerError, r"actor rank 0.*")):
        good = torch.load(ckpt / name, weights_only=True)  # what m2flow writes is plain data
        torch.save({**good, "extra": Touch(marker)}, ckpt / name)
        with pytest.raises(error, match=where + re.escape(f"{name}: refused to load: it holds Python objects")):
            train(make_cfg(tmp_path, "shared", "run.steps=2", "run.resume=true", *common), cluster)
        assert not marker.exists()
        torch.save(good, ckpt / name)


def test_resume_matches_an_uninterrupted_run(cluster, tmp_path):
    common = ["cluster.placement=rollout: 0; reward,inference,actor: 1", "reward.fn=reward_fixtures:digit_fraction"]
    train(make_cfg(tmp_path, "full", "run.steps=4", *common), cluster)
    idle = cluster.idle_processes  # the run's 4 processes (at least) are kept for the next runs
    assert idle >= 4
    train(make_cfg(tmp_path, "parted", "run.steps=2", "run.save_every=2", *common), cluster)
    train(make_cfg(tmp_path, "parted", "run.steps=4", "run.save_every=2", "run.resume=true", *common), cluster)
    assert cluster.idle_processes == idle  # both runs were built in processes a run had used (none was started)
    full, parted = rows(tmp_path / "full"), rows(tmp_path / "parted")
    assert [r["step"] for r in parted] == [1, 2, 3, 4]
    for a, b in zip(full[2:], parted[2:]):
        for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response/length_mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)
    wa = weights(tmp_path / "full" / "checkpoints" / "step_4" / "model")
    wb = weights(tmp_path / "parted" / "checkpoints" / "step_4" / "model")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_bad_input_gets_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        train(make_cfg(tmp_path, "bad1", f"model.path={tmp_path}/nope"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        train(make_cfg(tmp_path, "bad2", "data.task=file", f"data.path={empty}"))
    cols = tmp_path / "cols.jsonl"
    cols.write_text('{"question": "1+1=", "result": "2"}\n')
    with pytest.raises((KeyError, ValueError), match="question"):
        train(make_cfg(tmp_path, "bad3", "data.task=file", f"data.path={cols}"))
    with pytest.raises(ValueError, match="max_prompt_len"):
        train(make_cfg(tmp_path, "bad4", "data.max_prompt_len=2"))
    with pytest.raises(C.ConfigError, match="rollout.engine"):
        make_cfg(tmp_path, "bad5", "rollout.engine=vllm")
