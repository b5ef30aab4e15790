"""Auto mode on this machine (issue 6): `cluster.placement: auto` profiles the reasoning flow, plans for the 2 CPU
devices and trains the chosen plan; then every other plan the flow can run there trains for as many steps. Auto must
pick the plan its cost model ranks fastest; the measured times are printed beside the predictions, not asserted
(timings stay out of pass/fail tests: `python benchmarks/plans.py` measures how close auto's choice comes)."""

import json
import time
from pathlib import Path

import pytest
from auto_check import auto_outputs, check_auto_choice

from m2flow import config as C
from m2flow.api import measure_plan, train
from m2flow.auto import flow_plans
from m2flow.planner.profile import Profile
from m2flow.reasoning.config import ReasoningConfig
from m2flow.runtime import parse_placement

COMPONENTS = ["rollout", "reward", "inference", "actor"]
STEPS = 4  # per plan; the first warms up, the median of the other 3 is the measured step time


def make_cfg(tmp_path, placement="auto"):
    return C.load(ReasoningConfig, None, [
        f"run.dir={tmp_path}", "run.name=auto", "run.progress=false", "run.trace=false", f"run.steps={STEPS}",
        "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=8", "actor.micro_batch=32",
        "data.train_size=200", "data.eval_size=20", f"cluster.placement={placement}"])


def test_flow_plans_are_runnable_by_the_flow():
    """Every plan offered runs one process per component (a rank may span devices), offload off, whole groups."""
    p = Profile.load(Path(__file__).resolve().parents[1] / "fixtures" / "profiles" / "reasoning_8xh100.json")
    result = flow_plans(p, 8, group=8, top=1000)
    assert result.candidates
    for c in result.candidates:
        placement = parse_placement(c.spec, 8, COMPONENTS)
        assert all(placement[name].world_size == 1 for name in COMPONENTS), c.spec
        assert not c.offload and c.micro_batch % 8 == 0
        assert placement.mode == c.mode


def test_flow_plans_offload_where_the_resident_state_does_not_fit_when_offload_is_allowed():
    """With devices too small for every component's state at once, only plans that offload fit: with
    `cluster.offload` allowed (`offload=True`) the planner offers them and the plan it launches offloads; without, it
    offers none of them."""
    import dataclasses

    from m2flow.auto import plan_of

    p = Profile.load(Path(__file__).resolve().parents[1] / "fixtures" / "profiles" / "reasoning_8xh100.json")
    # on one device the four components' state and activations need 246 GB resident, 122 GB with offload
    big, small = (dataclasses.replace(p, machine=dataclasses.replace(p.machine, devices=1, memory_bytes=int(gb * 1e9)))
                  for gb in (300, 150))
    fits = flow_plans(big, 1, group=8, top=1000, offload=True)
    assert not fits.best.offload  # memory enough: offloading only costs switch time
    tight = flow_plans(small, 1, group=8, top=1000, offload=True)
    assert tight.candidates and all(c.offload for c in tight.candidates)
    assert plan_of(tight.best, tight).offload
    assert not flow_plans(small, 1, group=8, top=1000).candidates


@pytest.mark.timeout(1800)  # 5-6 min at a load average of 15 on 2 cores (8 profiling + 16 flow worker launches)
def test_auto_picks_the_plan_it_predicts_fastest_and_every_plan_runs(cluster, tmp_path):
    cfg = make_cfg(tmp_path)
    run = tmp_path / "auto"
    start = time.perf_counter()
    train(cfg, cluster=cluster)  # placement: auto -> profile, plan, train the chosen plan, report
    print(f"\nauto mode (profile + plan + {STEPS} steps): {time.perf_counter() - start:.0f} s")

    profile = Profile.load(run / "profile.json")
    for name in COMPONENTS:
        assert {m.devices for m in profile.measurements if m.component == name} == {1, 2}, name
    assert profile.components["actor"].state_bytes > 0 and profile.components["actor"].fixed_seconds > 0
    assert profile.transfer.latency_seconds > 0 and profile.transfer.bytes_per_sample > 0
    # the actor merges streamed micro-batches into passes of micro_batch_tokens (8192) over rows of <= 72 tokens
    assert profile.components["actor"].merge_samples >= 8192 // (64 + 8)
    # a collocated plan runs co-hosted: whole steps timed so, against the rows they are made of
    assert profile.cohosted_scale is not None and profile.cohosted_scale > 0
    assert len(json.loads((run / "profile_details.json").read_text())["cohosted_step_seconds"]) == 3
    plan, plans, report = auto_outputs(run, STEPS)
    assert all(len(ranks) == 1 for ranks in plan["placement"].values())  # one process per component
    # every placement the flow can run on 2 devices, at the micro-batch the planner ranks best for it
    assert {parse_placement(c["placement_spec"], 2, COMPONENTS).mode for c in plans} >= {"collocated", "hybrid"}

    def measure(c, i):
        t = time.perf_counter()
        seconds = measure_plan(cfg, c["placement_spec"], c["micro_batch"], tmp_path / f"plan{i}", STEPS, cluster)
        print(f"{c['placement_spec']}: {seconds:.3f} s/step ({time.perf_counter() - t:.0f} s to run)", flush=True)
        return seconds

    measured = [report["measured_step_seconds"]] + [measure(c, i) for i, c in enumerate(plans) if i]
    check_auto_choice(plans, measured, "micro_batch")
