"""Plan search on hand-made profiles whose optimum is known; every returned placement parses; 1024 devices plan fast."""

import dataclasses
import time
from pathlib import Path

import pytest

from m2flow.planner.profile import Profile
from m2flow.planner.search import contiguous_groupings, device_splits, micro_batch_sizes, search
from m2flow.runtime.placement import parse_placement

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "profiles"


def load(name: str) -> Profile:
    return Profile.load(FIXTURES / f"{name}.json")


def test_collocation_wins_when_stages_are_short_and_switches_cheap():
    r = search(load("collocate_wins"), 4)
    assert r.best.mode == "collocated" and not r.best.offload
    assert r.best.spec == "rollout,reward,inference,actor: all" and r.best.micro_batch == 64
    assert r.best.seconds == pytest.approx(4 * (0.05 + 0.01 * 16))
    assert r.collocated is r.best
    assert all(c.seconds >= r.best.seconds for c in r.candidates)


def test_pipelining_wins_when_stages_are_balanced_and_large():
    r = search(load("pipeline_wins"), 4)
    best = r.best
    assert best.mode == "disaggregated" and best.spec == "rollout: 0-1; actor: 2-3" and best.micro_batch == 16
    rollout, actor = (0.5 + 1.5625 * 128) / 16, 0.5 + 1.5625 * 8
    assert best.seconds == pytest.approx(rollout + actor + 15 * actor)
    # the collocated plan must offload (the two 50 GB states do not fit together) and pays 4 x 10 s of switches
    assert r.collocated.offload and r.collocated.seconds == pytest.approx(2 * 100.5 + 40)
    assert best.seconds < r.collocated.seconds


def test_staleness_overlaps_generation_and_can_change_the_plan():
    p = load("collocate_wins")
    on, off = search(p, 4), search(p, 4, staleness=1)
    assert on.best.mode == "collocated"
    assert off.best.mode != "collocated" and off.best.seconds < on.best.seconds
    assert off.collocated.seconds == pytest.approx(on.collocated.seconds)  # components taking turns overlap nothing
    assert any("max_staleness 1" in label for label, _ in off.best.prediction.parts)
    # with overlap, a pipeline no longer needs small micro-batches to hide its fill: one message per step wins here
    big = search(load("pipeline_wins"), 4, staleness=1).best
    assert big.spec == "rollout: 0-1; actor: 2-3" and big.micro_batch == 256
    assert big.seconds == pytest.approx(0.5 + 1.5625 * 128)  # each group's work, side by side


def test_memory_limits_exclude_plans():
    p = load("pipeline_wins")
    r = search(p, 4, top=100)
    assert not any(c.mode == "collocated" and not c.offload for c in r.candidates)  # too big to collocate as is
    assert r.infeasible >= 1 and any("need 101 GB" in e for e in r.infeasible_examples)
    big = dataclasses.replace(p.components["actor"], state_bytes=200_000_000_000, shard_state=True)
    r = search(dataclasses.replace(p, components={**p.components, "actor": big}), 4, top=100)
    assert r.candidates and all(c.layout.devices("actor") >= 3 for c in r.candidates if c.mode != "collocated")
    tiny = dataclasses.replace(p, machine=dataclasses.replace(p.machine, memory_bytes=10_000_000_000))
    with pytest.raises(ValueError, match=r"no plan fits in memory on 4 device\(s\) of 10 GB: .*need"):
        search(tiny, 4).best


def test_embodied_hybrid_pipelines_env_and_rollout_then_trains_on_all_devices():
    r = search(load("embodied_hybrid"), 4)
    best = r.best
    assert best.mode == "hybrid" and best.spec == "env: 0-1; rollout: 2-3; actor: all"
    assert best.loop_stages == 2 and best.micro_batch == 32
    assert best.seconds == pytest.approx(2 * (0.2 + 0.05 * 16) * 2 ** 0.5 + 0.0042 + 0.0074 + 2.1)
    assert best.seconds < r.collocated.seconds


def test_non_streaming_actor_gets_hybrid_candidates():
    p = load("reasoning_8xh100")
    actor = dataclasses.replace(p.components["actor"], streams=False)
    r = search(dataclasses.replace(p, components={**p.components, "actor": actor}), 8, top=200)
    assert any(c.layout.shared == ("actor",) and c.spec.endswith("actor: all") for c in r.candidates)


@pytest.mark.parametrize("name, devices", [("collocate_wins", 1), ("collocate_wins", 3), ("pipeline_wins", 4),
                                           ("embodied_hybrid", 4), ("embodied_hybrid", 8), ("reasoning_8xh100", 8),
                                           ("reasoning_8xh100", 64), ("reasoning_8xh100", 1024)])
def test_every_returned_placement_parses(name, devices):
    p = load(name)
    r = search(p, devices, top=40)
    assert r.candidates
    for c in r.candidates:
        placement = parse_placement(c.spec, devices, list(p.stages))
        assert placement.mode == c.mode, c.spec
        ranges = c.layout.ranges()
        for comp in p.stages:
            g = c.layout.group_of(comp)
            want = tuple(range(devices)) if g is None else tuple(range(ranges[g][0], ranges[g][1] + 1))
            assert placement[comp].devices == want
        assert c.layout.num_devices == devices


def test_1024_devices_plan_in_under_5_seconds():
    p = load("reasoning_8xh100")
    for devices, batch in ((64, 4096), (1024, 65536)):
        start = time.perf_counter()
        r = search(p, devices, batch=batch)
        took = time.perf_counter() - start
        print(f"\nplanning {devices} devices, batch {batch}: {took:.2f} s, {r.evaluated} plans predicted")
        assert took < 5.0
        assert r.best.seconds < r.collocated.seconds


def test_result_table_and_plan_dict():
    r = search(load("pipeline_wins"), 4, top=5)
    lines = r.table().splitlines()
    assert lines[0].split()[:4] == ["#", "mode", "placement", "micro"] and len(lines) == 2 + len(r.candidates)
    assert "rollout: 0-1; actor: 2-3" in lines[2] and "1.09x" in lines[2]
    d = r.to_plan_dict()
    assert d["mode"] == "disaggregated" and d["placement_spec"] == "rollout: 0-1; actor: 2-3"
    assert d["micro_batch"] == 16 and d["offload"] is False and d["loop_stages"] == 1
    assert d["placement"] == {"rollout": [[0], [1]], "actor": [[2], [3]]}
    assert d["predicted_step_seconds"] == pytest.approx(r.best.seconds, rel=1e-6)
    assert sum(d["breakdown"].values()) == pytest.approx(r.best.seconds, rel=1e-6)
    plan = r.plan().to_dict()  # the same keys and values as the ExecutionPlan the flow would launch
    assert {k: d[k] for k in plan} == plan
    hybrid = search(load("embodied_hybrid"), 4)
    assert {k: hybrid.to_plan_dict()[k] for k in hybrid.plan().to_dict()} == hybrid.plan().to_dict()


def test_components_must_match_the_profile():
    with pytest.raises(ValueError, match="differ from the profile's stages"):
        search(load("pipeline_wins"), 4, components=["rollout", "actor", "critic"])
    assert search(load("pipeline_wins"), 4, components=["actor", "rollout"]).best


def test_enumeration_helpers():
    assert contiguous_groupings(("a", "b", "c")) == [(("a", "b", "c"),), (("a",), ("b", "c")), (("a", "b"), ("c",)),
                                                      (("a",), ("b",), ("c",))]
    assert sorted(device_splits(4, [1, 1])) == [(1, 3), (2, 2), (3, 1)]
    assert device_splits(2, [1, 1, 1]) == []
    big = device_splits(1024, [3.0, 1.0])  # sensible splits: proportional (768) and powers of two nearby
    assert (768, 256) in big and (512, 512) in big and all(sum(s) == 1024 and min(s) >= 1 for s in big)
    assert len(device_splits(1024, [1.0, 1.0, 1.0, 1.0])) < 1000
    assert micro_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert micro_batch_sizes(96) == [1, 2, 4, 8, 16, 32, 48, 96]  # the divisor nearest each power of two
    assert micro_batch_sizes(65536)[0] == 256  # at most 256 micro-batches
