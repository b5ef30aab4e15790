"""The embodied flow's plans (placements of env, rollout, actor x env pipeline stages) on hand-made profiles whose
optimum is known: balanced env and policy times -> the 2-stage hybrid wins; a tiny policy -> lockstep collocated."""

import pytest

from m2flow.embodied.plans import COMPONENTS, embodied_plans
from m2flow.planner.profile import Profile
from m2flow.planner.search import TWO_RANKS_MIN_GAIN
from m2flow.runtime.placement import parse_placement


def profile(env: float, policy: float, actor: float = 0.1, slowdown: float = 1.0, envs: int = 32) -> Profile:
    """Rows on 1 and 2 devices: env/rollout take 0.02 s + `env`/`policy` s per `envs` envs over the horizon on one
    device; on two, each device's share costs `slowdown` x its one-device time (1.0: perfect scaling). The actor
    updates all envs in `actor` s on one device, half that on two; 0.01 s once per iteration."""
    rows = []
    for name, per in (("env", env), ("rollout", policy)):
        for n in (envs // 4, envs // 2, envs):
            rows.append({"component": name, "batch": n, "devices": 1, "seconds": 0.02 + per * n / envs})
            rows.append({"component": name, "batch": n, "devices": 2,
                         "seconds": (0.02 + per * n / 2 / envs) * slowdown})
    rows += [{"component": "actor", "batch": envs, "devices": 1, "seconds": actor},
             {"component": "actor", "batch": envs, "devices": 2, "seconds": actor / 2}]
    return Profile.from_dict({
        "flow": "embodied", "stages": list(COMPONENTS), "loop": ["env", "rollout"], "batch": envs,
        "machine": {"kind": "cpu-slot-1core", "devices": 2, "memory_bytes": 8_000_000_000},
        "components": {"env": {}, "rollout": {"state_bytes": 1000},
                       "actor": {"state_bytes": 3000, "streams": False, "fixed_seconds": 0.01}},
        "measurements": rows}, source="<hand-made>")


def test_balanced_env_and_policy_pipeline_in_two_stages_on_two_devices():
    # two workers per device contend (slowdown 1.6): the 2-device collocated plan gains little from its second device
    r = embodied_plans(profile(env=1.0, policy=1.0, slowdown=1.6), 2)
    best = r.best
    assert (best.spec, best.loop_stages, best.mode) == ("env: 0; rollout: 1; actor: all", 2, "hybrid")
    # the loop: each side busy 2 x (0.02 + 0.5); then the update on both devices and the once-per-iteration work
    assert best.seconds == pytest.approx(2 * 0.52 + 0.05 + 0.01)
    lockstep = next(c for c in r.candidates if c.spec == best.spec and c.loop_stages == 1)
    assert lockstep.seconds == pytest.approx(1.02 + 1.02 + 0.06)  # env, then policy: nothing overlaps
    assert r.collocated.seconds == pytest.approx(2 * (0.02 + 0.5) * 1.6 + 0.06)
    assert r.collocated.seconds > best.seconds


def test_tiny_policy_runs_lockstep_collocated():
    r = embodied_plans(profile(env=1.0, policy=0.001), 2)
    best = r.best
    assert (best.spec, best.loop_stages, best.mode) == ("env,rollout,actor: all", 1, "collocated")
    assert best.seconds == pytest.approx((0.02 + 0.5) + (0.02 + 0.0005) + 0.05 + 0.01)
    assert r.collocated is best
    # more stages on one device only add per-call costs
    staged = [c for c in r.candidates if c.mode == "collocated" and c.loop_stages > 1]
    assert staged and all(c.seconds > best.seconds for c in staged)


def test_every_plan_launches_as_the_flow_runs_it():
    p = profile(env=1.0, policy=1.0)
    r = embodied_plans(p, 2)
    # on 2 devices: 4 placements x 3 stage counts, every one with whole env stages
    assert {(c.spec, c.loop_stages) for c in r.candidates} == {
        (s, k) for s in ("env,rollout,actor: all", "env: 0; rollout,actor: 1", "env,rollout: 0; actor: 1",
                         "env: 0; rollout: 1; actor: all") for k in (1, 2, 4)}
    for c in r.candidates:
        placement = parse_placement(c.spec, 2, list(COMPONENTS))
        assert placement.mode == c.mode and not c.offload and c.micro_batch * c.loop_stages == 32
    assert [c.seconds for c in r.candidates] == sorted(c.seconds for c in r.candidates)
    # 12 envs on 4 devices: env workers on 3 devices get 4 envs each; on 4 devices 3 each, so 1 stage only
    r4 = embodied_plans(p, 4, num_envs=12)
    for c in r4.candidates:
        per_worker = 12 // c.layout.devices("env")
        assert 12 % c.layout.devices("env") == 0 and per_worker % c.loop_stages == 0
        assert c.layout.devices("env") % c.layout.devices("rollout") == 0
    assert not any(c.layout.devices("env") == 4 and c.loop_stages > 1 for c in r4.candidates)


def test_needs_an_embodied_profile():
    p = profile(env=1.0, policy=1.0)
    bad = Profile.from_dict({**p.to_dict(), "loop": []}, source="x.json")
    with pytest.raises(ValueError, match="x.json: an embodied profile"):
        embodied_plans(bad, 2)


def test_hand_over_latency_shared_and_split():
    """loop_latency: 0.3 s of round trips per stage and rollout when env and policy share a device, 0.05 s between
    devices. Lockstep on one device pays the shared one per stage; split over two devices the split one, and with
    2 stages that hides behind the other stage's work."""
    base = profile(env=1.0, policy=0.5, actor=0.05, slowdown=1.6)
    tied = {(c.spec, c.loop_stages): c.seconds for c in embodied_plans(base, 2).candidates}
    assert tied[("env: 0; rollout,actor: 1", 1)] == pytest.approx(tied[("env,rollout: 0; actor: 1", 1)])
    p = Profile.from_dict({**base.to_dict(), "loop_latency": {"shared": 0.3, "split": 0.05}}, source="<hand-made>")
    r = embodied_plans(p, 2)
    got = {(c.spec, c.loop_stages): c.seconds for c in r.candidates}
    assert got[("env,rollout: 0; actor: 1", 1)] == pytest.approx(tied[("env,rollout: 0; actor: 1", 1)] + 0.3)
    assert got[("env,rollout: 0; actor: 1", 2)] == pytest.approx(tied[("env,rollout: 0; actor: 1", 2)] + 2 * 0.3)
    assert got[("env: 0; rollout,actor: 1", 1)] == pytest.approx(tied[("env: 0; rollout,actor: 1", 1)] + 0.05)
    # 2 stages: max(2 x env, 2 x policy, env + policy + latency) at 16 envs = 2 x 0.52, latency hidden
    assert got[("env: 0; rollout,actor: 1", 2)] == pytest.approx(tied[("env: 0; rollout,actor: 1", 2)])
    assert p.to_dict()["loop_latency"] == {"shared": 0.3, "split": 0.05}
    with pytest.raises(Exception, match="loop_latency.*no loop"):
        Profile.from_dict({**base.to_dict(), "loop": [], "loop_latency": {"shared": 0.1}}, source="x.json")


def test_one_stage_on_shared_devices_is_charged_as_the_flow_runs_it_in_one_process():
    """The flow runs one lockstep stage on shared devices with the policy in the env's process (`rollout.cohost`):
    such a plan's env and rollout take `loop_latency.cohosted_scale` of their rows (timed in two processes) and pay
    no `shared` round trips; with 2 stages env and policy are separate processes again (rows + shared). Unmeasured
    (older profiles): rows + shared."""
    base = profile(env=1.0, policy=0.5, actor=0.05, slowdown=1.6)
    tied = {(c.spec, c.loop_stages): c for c in embodied_plans(base, 2).candidates}
    p = Profile.from_dict({**base.to_dict(), "loop_latency": {"shared": 0.3, "split": 0.05, "cohosted_scale": 0.5}},
                          source="<hand-made>")
    got = {(c.spec, c.loop_stages): c for c in embodied_plans(p, 2).candidates}
    one, two = ("env,rollout: 0; actor: 1", 1), ("env,rollout: 0; actor: 1", 2)
    rows = tied[one].prediction.busy["env"] + tied[one].prediction.busy["rollout"]  # the base has no latencies
    assert got[one].seconds == pytest.approx(tied[one].seconds - 0.5 * rows)
    assert got[two].seconds == pytest.approx(tied[two].seconds + 2 * 0.3)
    assert got[("env: 0; rollout,actor: 1", 1)].seconds == pytest.approx(tied[("env: 0; rollout,actor: 1", 1)].seconds
                                                                         + 0.05)
    assert p.to_dict()["loop_latency"] == {"shared": 0.3, "split": 0.05, "cohosted_scale": 0.5}
    assert p.loop_latency.on_shared_devices(1) == (0.5, 0.0) and p.loop_latency.on_shared_devices(2) == (1.0, 0.3)
    old = Profile.from_dict({**base.to_dict(), "loop_latency": {"shared": 0.3}}, source="<old>")
    assert old.loop_latency.cohosted_scale is None and old.loop_latency.on_shared_devices(1) == (1.0, 0.3)
    with pytest.raises(Exception, match=r"x.json: loop_latency.cohosted_scale must be >= 0.0, got -1"):
        Profile.from_dict({**base.to_dict(), "loop_latency": {"cohosted_scale": -1}}, source="x.json")

def test_sac_lag_1_overlaps_collection_with_the_update_on_its_own_device_and_keeps_one_learner():
    """SAC (one learner rank, sac.max_policy_lag 1): where the actor has a device of its own the next iteration's
    collection runs beside its update, so the step is the busier device's work; collocated, nothing overlaps."""
    p = profile(env=1.0, policy=0.001, actor=2.0)  # the update on one device outweighs collection
    lag0 = {(c.spec, c.loop_stages): c for c in embodied_plans(p, 2, one_learner=True).candidates}
    lag1 = {(c.spec, c.loop_stages): c for c in embodied_plans(p, 2, staleness=1, one_learner=True).candidates}
    assert set(lag0) == set(lag1)
    apart = ("env,rollout: 0; actor: 1", 1)
    loop = (0.02 + 1.0) + (0.02 + 0.001)  # env then policy on device 0, taking turns
    assert lag0[apart].seconds == pytest.approx(loop + 2.0 + 0.01)
    assert lag1[apart].seconds == pytest.approx(2.0 + 0.01)  # device 1's update; device 0 collects meanwhile
    assert lag1[apart].prediction.parts[-1][0].startswith("overlap with the next iteration's collection")
    together = ("env,rollout: 0-1; actor: 0-1:0", 1)  # collocated: the learner one process over both devices
    assert lag1[together].seconds == pytest.approx(lag0[together].seconds)
    for spec, _ in lag1:  # every candidate launches the learner as one rank
        assert parse_placement(spec, 2, COMPONENTS)["actor"].world_size == 1, spec
    assert embodied_plans(p, 2, one_learner=True).best.spec == together[0]  # lag 0: the update on both devices wins


def test_the_planner_plans_the_components_the_embodied_config_places():
    """The pure planner names the embodied flow's components itself (it imports no config); they are the config's."""
    from m2flow.embodied import plans as planner
    from m2flow.embodied.config import EmbodiedClusterConfig

    assert planner.COMPONENTS == EmbodiedClusterConfig.COMPONENTS


def test_two_env_workers_per_device_where_the_profile_measured_them_faster():
    """`loop_latency.two_ranks_scale` (the profiler's rollout with two env workers on one device): below 1 (an env
    that waits on its renderer, not its core) the search adds plans with two env workers per device, their env rows
    scaled by it, and the flow can launch them; at 1 or more (a core-bound env, as on this machine's CPU devices),
    within the probe's noise of 1 (less than TWO_RANKS_MIN_GAIN faster), or unmeasured, it offers one env worker per
    device only."""
    base = profile(env=1.0, policy=0.1, actor=0.05)
    fast = Profile.from_dict({**base.to_dict(), "loop_latency": {"two_ranks_scale": 0.5}}, source="<hand-made>")
    r = embodied_plans(fast, 2)
    best = r.best
    assert (best.spec, best.loop_stages, best.loop_ranks) == ("env: 0-1:0-3; rollout,actor: 0-1", 1, 2)
    one = next(c for c in r.candidates if c.mode == "collocated" and c.loop_stages == 1 and c.loop_ranks == 1)
    assert one.spec == "env,rollout,actor: all" and one.seconds == pytest.approx(0.52 + 0.07 + 0.035)
    # the env's rows (0.02 + 0.5 at 16 envs per device) halve; the policy, the update and the fixed work do not
    assert best.prediction.busy["env"] == pytest.approx(0.5 * one.prediction.busy["env"])
    assert best.seconds == pytest.approx(0.26 + 0.07 + 0.035)
    for c in r.candidates:  # every plan launches: 4 env workers on 2 devices, each asking policy worker r % R
        placement = parse_placement(c.spec, 2, list(COMPONENTS))
        assert placement["env"].world_size == c.layout.devices("env") * c.loop_ranks, c.spec
        assert placement["env"].world_size % placement["rollout"].world_size == 0, c.spec
        assert (32 // placement["env"].world_size) % c.loop_stages == 0, c.spec
    assert {c.loop_ranks for c in r.candidates} == {1, 2}
    assert r.to_plan_dict()["placement"]["env"] == [[0], [0], [1], [1]] and r.to_plan_dict()["loop_ranks"] == 2
    # SAC's learner stays one process over its devices beside them
    assert embodied_plans(fast, 2, one_learner=True).best.spec == "env: 0-1:0-3; rollout: 0-1; actor: 0-1:0"
    assert fast.to_dict()["loop_latency"] == {"shared": 0.0, "split": 0.0, "two_ranks_scale": 0.5}
    assert TWO_RANKS_MIN_GAIN == 0.1
    edge = Profile.from_dict({**base.to_dict(), "loop_latency": {"two_ranks_scale": 0.9}}, source="<hand-made>")
    assert {c.loop_ranks for c in embodied_plans(edge, 2).candidates} == {1, 2}  # 10% faster: offered
    for scale in (None, 0.98, 1.0, 1.4):  # unmeasured, faster by less than the noise, or no faster: one per device
        p = base if scale is None else Profile.from_dict({**base.to_dict(), "loop_latency": {"two_ranks_scale": scale}},
                                                          source="<hand-made>")
        got = embodied_plans(p, 2).candidates
        assert len(got) == 12 and {c.loop_ranks for c in got} == {1}, scale
    with pytest.raises(Exception, match=r"x.json: loop_latency.two_ranks_scale must be > 0, got 0"):
        Profile.from_dict({**base.to_dict(), "loop_latency": {"two_ranks_scale": 0}}, source="x.json")
    with pytest.raises(ValueError, match="2 processes per device of the loop's first stage were not measured"):
        base.loop_latency.ranks_factor(2)
