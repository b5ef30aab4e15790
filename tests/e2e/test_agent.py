"""Agentic RL (issue 16): multi-turn rollouts with a calculator in real GRPO runs. A supervised warm start on
tool-use traces teaches the format; the run's rollouts then stop at each call, get the calculator's answer fed
back, and write on; the actor trains only the tokens the model wrote."""

import json

import pytest
import yaml

from m2flow import config as C
from m2flow.api import train as api_train
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.flow import train
from m2flow.reasoning.warm_start import prepare_model

TOOL_TRACE_TOKENS = 44  # <calc>37+45</calc><result>82</result>82 and eos, with room


BASE = ["run.progress=false", "run.trace=false", "run.steps=2", "run.eval_every=2", "data.eval_size=40",
        "data.train_size=2000", "sft.steps=300", "sft.batch_size=64", "rollout.prompts_per_step=8", "rollout.n=4",
        f"rollout.max_new_tokens={TOOL_TRACE_TOKENS}", "cluster.placement=rollout,reward,inference,actor: 0-1:0"]
TOOLS = "agent.tools={calc: calc}"


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """`model.path` of the warm start the runs with the calculator share (BASE's 300 steps on tool-use traces, the
    flow's own `prepare_model`): run once for the module instead of once per run, with `sft.steps=0` in the runs."""
    where = tmp_path_factory.mktemp("tool_warm_start")
    path = prepare_model(C.load(ReasoningConfig, None, [f"run.dir={where}", *BASE, TOOLS]), where)
    return [f"model.path={path}", "sft.steps=0"]


def run(cluster, tmp_path, name, *overrides, trainer=train):
    base = [f"run.dir={tmp_path}", f"run.name={name}", *BASE]
    trainer(C.load(ReasoningConfig, None, base + list(overrides)), cluster=cluster)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_a_grpo_run_calls_the_calculator_and_trains_only_the_tokens_the_model_wrote(cluster, tmp_path, tool_model):
    tools = run(cluster, tmp_path, "tools", TOOLS, *tool_model, "run.trace=true")
    plain = run(cluster, tmp_path, "plain")
    # the tool component (placed beside the reward: here in the one collocated process) answered the calls
    plan = (tmp_path / "tools" / "plan.yaml").read_text()
    assert "tool:" in plan and "rollout,reward,inference,actor,tool: 0-1:0" in plan
    trace = json.loads((tmp_path / "tools" / "trace.json").read_text())
    spans = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace) if e.get("name") == "tool"]
    assert len(spans) >= 8, len(spans)
    steps = [r for r in tools if "agent/calls" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["agent/calls"] >= 0.5, r  # the warm start taught the model to call the calculator
        assert r["agent/ok"] >= 0.8 * r["agent/calls"] and r["agent/timeout"] == r["agent/unknown"] == 0, r
        # the calculator's answers (<result>...</result>, about half of each response) get no gradient
        assert 0.3 < r["actor/tool_token_frac"] < 0.6, r
        assert r["reward/mean"] > 0, r  # final answers after the result are scored
    assert all("agent/calls" not in r and "actor/tool_token_frac" not in r for r in plain)
    # the same warm-start budget without the tool: the model has to add in its head
    with_tool = [r["eval/pass@1"] for r in tools if "eval/pass@1" in r]
    without = [r["eval/pass@1"] for r in plain if "eval/pass@1" in r]
    print("held-out pass@1 with the tool", with_tool, "without", without)
    assert len(with_tool) == len(without) == 2
    assert min(with_tool) >= 0.8 and min(with_tool) > max(without) + 0.3, (with_tool, without)


def test_grpo_steps_raise_the_tool_call_success_rate(cluster, tmp_path):
    """A warm start where half the references call the calculator (`sft.tool_fraction=0.5`) leaves a model that calls
    it on about half of its samples, and is mostly right when it does. GRPO rewards the right answers, so within a
    few steps the model calls the calculator, with calls it answers, on most samples, and held-out accuracy rises."""
    rows = run(cluster, tmp_path, "mixed", TOOLS, "sft.tool_fraction=0.5", "sft.steps=600",
               "actor.lr=2e-4", "rollout.prompts_per_step=16", "rollout.n=8", "run.steps=10", "run.eval_every=10",
               "data.eval_size=100")
    steps = [r for r in rows if "agent/ok" in r]
    assert len(steps) == 10

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    ok_before, ok_after = mean("agent/ok", steps[:3]), mean("agent/ok", steps[-3:])
    reward_before, reward_after = mean("reward/mean", steps[:3]), mean("reward/mean", steps[-3:])
    held_out = [r["eval/pass@1"] for r in rows if "eval/pass@1" in r]
    print(f"\ncalls answered per response {ok_before:.2f} -> {ok_after:.2f}, reward {reward_before:.2f} -> "
          f"{reward_after:.2f}, held-out pass@1 {held_out}")
    assert 0.3 < ok_before < 0.7, ok_before  # the mixed warm start: the calculator on about half of the samples
    assert ok_after > ok_before + 0.15 and reward_after > reward_before + 0.1, (ok_before, ok_after)
    assert len(held_out) == 2 and held_out[1] >= held_out[0] + 0.1, held_out


def test_an_agent_run_in_the_pipelined_plan_resumes_as_an_uninterrupted_run(cluster, tmp_path, tool_model):
    """Rollout on device 0 streams multi-turn groups to reward, inference and actor on device 1 (the loss masks
    travel with them through the merged passes), the tool component there answering its calls; a run stopped after
    step 2 and resumed gives step 3 as a run that went through, from the same warm start (the draws do not depend on
    when an answer comes back)."""
    tools = [TOOLS, *tool_model, "cluster.placement=rollout: 0; reward,inference,actor: 1", "run.eval_every=0"]
    full = run(cluster, tmp_path, "full", *tools, "run.steps=3")
    run(cluster, tmp_path, "parted", *tools, "run.steps=2", "run.save_every=2")
    parted = run(cluster, tmp_path, "parted", *tools, "run.steps=3", "run.save_every=2", "run.resume=true")
    assert [r["step"] for r in parted] == [1, 2, 3] and full[0]["agent/calls"] >= 0.5
    # the tool component, beside the reward on device 1 in a process of its own, answered over Ray
    assert "reward,inference,actor,tool: 1" in (tmp_path / "full" / "plan.yaml").read_text()
    assert all(r["agent/ok"] >= 0.8 * r["agent/calls"] for r in full)
    for a, b in zip(full, parted):
        for k in ("reward/mean", "agent/calls", "actor/tool_token_frac", "actor/pg_loss", "actor/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k, a[k], b[k])


def test_auto_mode_profiles_the_rollout_with_its_tool_calls_and_places_the_tools_beside_the_reward(
        cluster, tmp_path, tool_model):
    """`cluster.placement=auto` with tools: the profiler's rollout calls the tool component (in its process, as a
    collocated plan has it), so the rollout's measured times include the waits for the answers; the tool component
    takes no device, and the chosen plan puts it beside the reward."""
    rows = run(cluster, tmp_path, "auto", TOOLS, *tool_model, "cluster.placement=auto", "run.eval_every=0",
               trainer=api_train)
    details = json.loads((tmp_path / "auto" / "profile_details.json").read_text())
    assert {c["devices"] for c in details["tool_calls"]} == {1, 2}
    assert all(c["calls"] >= 0.5 * c["batch"] and c["seconds"] > 0 for c in details["tool_calls"]), details["tool_calls"]
    plan = yaml.safe_load((tmp_path / "auto" / "plan.yaml").read_text())
    assert plan["placement"]["tool"] == plan["placement"]["reward"], plan
    assert all(r["agent/calls"] >= 0.5 and r["agent/ok"] >= 0.8 * r["agent/calls"] for r in rows), rows



def test_ppo_with_a_critic_trains_an_agent_on_the_models_tokens(cluster, tmp_path, tool_model):
    """`algorithm.name=ppo` with tools: the critic values the model's tokens only (GAE steps over the tools' answers,
    unit-tested in test_algorithms_advantages.py), and the run trains on as GRPO's does."""
    rows = run(cluster, tmp_path, "ppo", TOOLS, *tool_model, "algorithm.name=ppo", "algorithm.advantage=gae",
               "critic.lr=5e-4", "run.eval_every=0")
    for r in rows:
        assert r["agent/calls"] >= 0.5 and 0.3 < r["actor/tool_token_frac"] < 0.6, r
        assert r["critic/samples"] == 32 and r["critic/vf_loss"] >= 0 and r["critic/grad_norm"] > 0, r
        # the tokens it valued are the model's: the responses' tokens less the tools' share of them
        written = r["response/length_mean"] * 32
        assert r["critic/tokens"] == pytest.approx(written * (1 - r["actor/tool_token_frac"]), rel=0.1), r
        assert r["critic/tokens"] < 0.75 * written and r["reward/mean"] > 0, r
