"""Auto mode for the embodied flow on this machine (issue 6): `cluster.placement: auto` profiles env, policy and
actor, plans placements x env pipeline stages for the 2 CPU devices and trains the chosen plan; then every other
placement the flow can run there trains for as many iterations. Auto must pick the plan its cost model ranks fastest;
measured times are printed, not asserted (see tests/e2e/test_auto_plan.py)."""

import json
import time

import pytest
from auto_check import auto_outputs, check_auto_choice

from m2flow import config as C
from m2flow.api import measure_plan, train
from m2flow.embodied.config import EmbodiedConfig
from m2flow.planner.profile import Profile
from m2flow.planner.search import TWO_RANKS_MIN_GAIN
from m2flow.runtime import parse_placement

COMPONENTS = ["env", "rollout", "actor"]
STEPS = 4  # per plan; the first warms up, the median of the other 3 is the measured iteration time
PROFILE_STEPS = 16  # env steps per profiled rollout: half the horizon, the rows scaled x 2


def make_cfg(tmp_path):
    return C.load(EmbodiedConfig, None, [
        f"run.dir={tmp_path}", "run.name=auto", "run.progress=false", "run.trace=false", f"run.steps={STEPS}",
        "env.id=CartPole-v1", "env.num_envs=8", "rollout.steps=32", "actor.epochs=4", "actor.minibatch_size=64",
        "eval.episodes=0", "cluster.placement=auto", f"cluster.profile_steps={PROFILE_STEPS}"])


@pytest.mark.timeout(900)
def test_embodied_auto_picks_the_plan_it_predicts_fastest_and_every_plan_runs(cluster, tmp_path):
    cfg = make_cfg(tmp_path)
    run = tmp_path / "auto"
    start = time.perf_counter()
    train(cfg, cluster=cluster)  # placement: auto -> profile, plan, train the chosen plan, report
    print(f"\nauto mode (profile + plan + {STEPS} iterations): {time.perf_counter() - start:.0f} s")

    profile = Profile.load(run / "profile.json")
    assert profile.flow == "embodied" and profile.loop == ("env", "rollout") and profile.batch == 8
    for name in COMPONENTS:
        assert {m.devices for m in profile.measurements if m.component == name} == {1, 2}, name
    assert {m.batch for m in profile.measurements if m.component == "env" and m.devices == 1} == {2, 4, 8}
    assert profile.components["actor"].fixed_seconds > 0 and not profile.components["actor"].streams
    # the profiled rollouts ran profile_steps env steps per env, not the horizon's 32
    details = json.loads((run / "profile_details.json").read_text())
    assert details["steps"] == PROFILE_STEPS and details["horizon"] == 32
    env_calls = [c for c in details["calls"] if c["component"] == "env"]
    assert env_calls and all(c["env_steps"] == c["batch"] * PROFILE_STEPS for c in env_calls), env_calls
    # two env workers on one device, timed against one: the planner adds such plans only where they measured faster
    # by more than the probe's noise
    two_ranks = profile.loop_latency.two_ranks_scale
    assert two_ranks is not None and two_ranks > 0
    plan, plans, report = auto_outputs(run, STEPS)
    assert plan["pipeline_stages"] == plans[0]["pipeline_stages"]
    doubled = [c for c in plans if c.get("loop_ranks", 1) == 2]
    assert bool(doubled) == (two_ranks <= 1 - TWO_RANKS_MIN_GAIN), (two_ranks, doubled)
    for c in doubled:
        assert parse_placement(c["placement_spec"], 2, COMPONENTS)["env"].world_size == 4, c
    # every placement the flow can run on 2 devices, at the stage count the planner ranks best for it
    assert len(plans) - len(doubled) == 4 and {parse_placement(c["placement_spec"], 2, COMPONENTS).mode
                                               for c in plans} == {"collocated", "hybrid"}

    def measure(c, i):
        t = time.perf_counter()
        seconds = measure_plan(cfg, c["placement_spec"], c["pipeline_stages"], tmp_path / f"plan{i}", STEPS, cluster)
        print(f"{c['placement_spec']} ({c['pipeline_stages']} stages): {seconds:.3f} s/iteration "
              f"({time.perf_counter() - t:.0f} s to run)", flush=True)
        return seconds

    measured = [report["measured_step_seconds"]] + [measure(c, i) for i, c in enumerate(plans) if i]
    check_auto_choice(plans, measured, "pipeline_stages")
