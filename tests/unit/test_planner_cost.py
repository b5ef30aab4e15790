"""Cost model: fitted curves pass through the measured points and interpolate sensibly; step predictions match
hand-worked values; memory limits make plans infeasible; the drawn schedule ends at the predicted step time."""

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m2flow.planner.cost import CostModel, Curve, Layout, phases, predict, schedule
from m2flow.planner.profile import ComponentInfo, Profile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "profiles"


def load(name: str) -> Profile:
    return Profile.load(FIXTURES / f"{name}.json")


# ---------------------------------------------------------------------------------------------- curves

points = st.lists(st.tuples(st.floats(0.5, 1e4), st.floats(1e-3, 1e4)), min_size=1, max_size=8,
                  unique_by=lambda p: round(p[0], 3))


@settings(max_examples=60, deadline=None)
@given(points, st.floats(0.01, 5e4))
def test_curve_passes_through_points_and_stays_between_them(pts, x):
    c = Curve(pts)
    for px, py in pts:
        assert c(px) == pytest.approx(py, rel=1e-9)
    xs, ys = c.xs, c.ys
    y = c(x)
    if xs[0] <= x <= xs[-1]:  # interpolation: between the two neighbouring measurements
        i = max(k for k in range(len(xs)) if xs[k] <= x)
        j = min(i + 1, len(xs) - 1)
        assert min(ys[i], ys[j]) - 1e-9 <= y <= max(ys[i], ys[j]) + 1e-9
    elif x < xs[0]:  # below: between proportional and flat
        assert ys[0] * x / xs[0] - 1e-9 <= y <= ys[0] + 1e-9
    else:  # above: never below the last measurement
        assert y >= ys[-1] - 1e-9


def test_curve_hand_values():
    c = Curve([(10, 2.0), (20, 3.0), (40, 7.0), (20, 5.0)])  # repeated x averaged: (20, 4.0)
    assert c(15) == pytest.approx(3.0)
    assert c(30) == pytest.approx(5.5)
    assert c(60) == pytest.approx(10.0)  # continues the last slope 3/20
    assert c(5) == pytest.approx(1.0)  # first slope 0.2 gives 1.0, inside [proportional 1.0, flat 2.0]
    assert Curve([(4, 2.0)])(10) == pytest.approx(5.0)  # one point: proportional


def test_fit_reproduces_rows_and_fits_scaling_exponent():
    p = load("embodied_hybrid")
    model = CostModel(p)
    for m in p.measurements:
        assert model.seconds(m.component, m.batch, m.devices) == pytest.approx(m.seconds, rel=1e-9)
    assert model.fits["env"].gamma == pytest.approx(0.5, abs=1e-4)  # rows made with (d2/d1) ** 0.5 slowdown
    assert model.fits["actor"].gamma == 0.0  # one device count measured: perfect scaling assumed
    # 4 devices, 64 envs: 16 per device at the 2-device curve, slowed by (4/2) ** 0.5
    assert model.seconds("env", 64, 4) == pytest.approx((0.2 + 0.05 * 16) * 2 ** 0.5 * 2 ** 0.5, rel=1e-4)
    # actor: perfect data-parallel scaling from the 1-device curve
    assert model.seconds("actor", 64, 4) == pytest.approx(0.2 + 0.1 * 16)
    # a call smaller than the device count uses one device per sample
    assert model.seconds("actor", 2, 4) == model.seconds("actor", 2, 2)


def test_activation_is_peak_minus_state():
    p = load("embodied_hybrid")
    fit = CostModel(p).fits["actor"]
    assert fit.activation_bytes(64, 1) == pytest.approx(1e8 * 64)  # peak = 8e9 state + 1e8 per sample
    assert fit.activation_bytes(64, 4) == pytest.approx(1e8 * 16)
    sharded = dataclasses.replace(p.components["actor"], state_bytes=8_000_000_000, shard_state=True)
    fit2 = CostModel(dataclasses.replace(p, components={**p.components, "actor": sharded})).fits["actor"]
    assert fit2.state_bytes(4) == 2e9


# ---------------------------------------------------------------------------------------------- predictions


def test_collocated_adds_up_and_offload_adds_switches():
    p = load("collocate_wins")
    model = CostModel(p)
    layout = Layout.collocated(p.stages, 4)
    off = predict(model, layout)
    assert off.seconds == pytest.approx(4 * (0.05 + 0.01 * 16))
    assert off.feasible and off.busy["rollout"] == pytest.approx(0.21)
    on = predict(model, layout, offload=True)
    assert on.seconds == pytest.approx(off.seconds + 4 * 0.02)
    assert sum(s for _, s in on.parts) == pytest.approx(on.seconds)


def test_pipeline_is_fill_plus_slowest_times_remaining_micro_batches():
    p = load("pipeline_wins")
    model = CostModel(p)
    layout = Layout((("rollout",), ("actor",)), (2, 2))
    pred = predict(model, layout, 256, 16)
    rollout = (0.5 + 1.5625 * 128) / 16  # the source generates the whole batch once; its outputs stream out
    actor = 0.5 + 1.5625 * 8  # 16 samples over 2 devices, per micro-batch
    assert pred.seconds == pytest.approx(rollout + actor + 15 * max(rollout, actor))
    assert pred.bottleneck == "actor"
    assert [label for label, _ in pred.parts] == ["pipeline fill: micro-batch 1 through 2 groups",
                                                  "actor x 15 more micro-batches"]


def test_pipeline_adds_transfer_latency_once_per_link():
    p = load("collocate_wins")
    model = CostModel(p)
    layout = Layout((("rollout", "reward"), ("inference", "actor")), (2, 2))
    pred = predict(model, layout, 64, 16)
    first = (0.05 + 0.01 * 32) / 4 + (0.05 + 0.01 * 8)  # rollout (whole batch / 4 micro-batches) + reward
    second = 2 * (0.05 + 0.01 * 8)
    link = 0.005 + 16 * 1e5 / 1e9 * 1.0
    assert pred.seconds == pytest.approx(first + second + link + 3 * max(first, second))


def with_actor(p: Profile, **changes) -> Profile:
    return dataclasses.replace(p, components={**p.components,
                                              "actor": dataclasses.replace(p.components["actor"], **changes)})


def test_an_actor_merging_micro_batches_pays_per_pass_and_waits_when_a_pass_is_the_whole_batch():
    p = load("pipeline_wins")
    layout = Layout((("rollout",), ("actor",)), (2, 2))
    rollout = (0.5 + 1.5625 * 128) / 16
    # passes of 64 samples (4 micro-batches of 16): each micro-batch costs a quarter of a 64-sample pass
    merged = predict(CostModel(with_actor(p, merge_samples=64)), layout, 256, 16)
    actor = (0.5 + 1.5625 * 32) / 4
    assert merged.seconds == pytest.approx(rollout + actor + 15 * max(rollout, actor))
    assert merged.seconds < predict(CostModel(p), layout, 256, 16).seconds  # fewer, larger passes
    # a pass of the whole batch: the actor waits for it (a tail stage), then trains it in one pass
    whole = with_actor(p, merge_samples=300)
    assert phases(whole) == (("rollout",), ("actor",)) and CostModel(whole).tail == ("actor",)
    assert phases(whole, batch=512) == (("rollout", "actor"), ())  # a larger step streams again
    pred = predict(CostModel(whole), layout, 256, 256)
    assert pred.seconds == pytest.approx(0.5 + 1.5625 * 128 + 0.5 + 1.5625 * 128)


def test_staleness_overlaps_generation_only_where_the_source_has_its_own_devices():
    p = load("pipeline_wins")
    model = CostModel(p)
    apart = Layout((("rollout",), ("actor",)), (2, 2))
    on = predict(model, apart, 256, 16)
    gen, actor = 0.5 + 1.5625 * 128, 16 * (0.5 + 1.5625 * 8)  # each device group's work in one step
    for n in (1, 2):
        off = predict(model, apart, 256, 16, staleness=n)
        assert off.seconds == pytest.approx(max(gen, actor, on.seconds / (n + 1)))
        assert sum(s for _, s in off.parts) == pytest.approx(off.seconds)
        assert off.parts[-1] == (f"overlap with the next steps' generation (max_staleness {n})",
                                 pytest.approx(off.seconds - on.seconds))
    # the bound: generating step k + N + 1 waits for step k's weights
    slow_actor = with_actor(p, fixed_seconds=300.0)  # the actor's group: 208 + 300 s, the on-policy step 520.5 s
    on_slow = predict(CostModel(slow_actor), apart, 256, 16)
    assert predict(CostModel(slow_actor), apart, 256, 16, staleness=1).seconds == pytest.approx(actor + 300.0)
    assert on_slow.seconds / 2 < actor + 300.0
    # collocated (rollout and actor take turns on the same devices): nothing overlaps
    together = Layout.collocated(p.stages, 4)
    assert (predict(model, together, offload=True, staleness=1).seconds
            == pytest.approx(predict(model, together, offload=True).seconds))


def test_a_measured_cohosted_scale_applies_to_the_collocated_plan_only(tmp_path):
    p = load("collocate_wins")
    scaled = dataclasses.replace(p, cohosted_scale=0.6)
    scaled.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").cohosted_scale == 0.6  # saved and read back
    together = Layout.collocated(p.stages, 4)
    plain, co = predict(CostModel(p), together), predict(CostModel(scaled), together)
    assert co.seconds == pytest.approx(0.6 * plain.seconds)
    assert co.parts[0] == ("rollout (co-hosted: rows x 0.60)", pytest.approx(0.6 * 0.21))
    assert sum(s for _, s in co.parts) == pytest.approx(co.seconds)
    assert schedule(CostModel(scaled), together)[-1].end == pytest.approx(co.seconds)
    apart = Layout((("rollout", "reward"), ("inference", "actor")), (2, 2))  # separate processes: the rows as they are
    assert predict(CostModel(scaled), apart, 64, 16).seconds == pytest.approx(predict(CostModel(p), apart, 64, 16).seconds)


def test_memory_excludes_collocation_without_offload():
    p = load("pipeline_wins")  # rollout and actor each hold 50 GB on 80 GB devices
    model = CostModel(p)
    layout = Layout.collocated(p.stages, 4)
    without = predict(model, layout)
    assert not without.feasible
    assert "devices 0-3: rollout,actor need 101 GB per device (states rollout 50 + actor 50 GB" in without.reason
    assert without.reason.endswith("> 80 GB")
    with_offload = predict(model, layout, offload=True)
    assert with_offload.feasible
    assert with_offload.seconds == pytest.approx(2 * (0.5 + 1.5625 * 64) + 2 * 20)
    assert with_offload.peak_bytes[0] == pytest.approx(50e9 + 1e7 * 64)


def test_sharded_state_needs_enough_devices():
    p = load("pipeline_wins")
    big = dataclasses.replace(p.components["actor"], state_bytes=200_000_000_000, shard_state=True)
    model = CostModel(dataclasses.replace(p, components={**p.components, "actor": big}))
    assert not predict(model, Layout((("rollout",), ("actor",)), (2, 2)), 256, 16).feasible  # 100 GB per device
    assert predict(model, Layout((("rollout",), ("actor",)), (1, 3)), 256, 16).feasible  # 66.7 GB


def test_embodied_loop_with_env_pipeline_stages():
    p = load("embodied_hybrid")
    model = CostModel(p)
    assert phases(p) == (("env", "rollout"), ("actor",))
    hybrid = Layout((("env",), ("rollout",)), (2, 2), ("actor",))
    step = (0.2 + 0.05 * 16) * 2 ** 0.5  # env (and rollout): 32 envs per stage over 2 devices
    loop = max(2 * step, 2 * step, 2 * step + 0.001 + 32 * 1e6 / 1e9 * 0.1)
    actor = 0.2 + 0.1 * 16 + 0.3  # on all 4 devices, plus the optimizer step
    pred = predict(model, hybrid, 64, 32, loop_stages=2)
    assert pred.seconds == pytest.approx(loop + 0.001 + 64 * 1e6 / 1e9 * 0.1 + actor)  # + trajectories to the actor
    one = predict(model, hybrid, 64, 64, loop_stages=1)  # no overlap: env then rollout on half the devices each
    assert one.seconds > pred.seconds
    # env and rollout on the same devices take turns: S stages add up, S x (env + rollout) at batch / S
    together = predict(model, Layout.collocated(p.stages, 4), 64, 32, loop_stages=2)
    assert together.seconds == pytest.approx(2 * 2 * model.seconds("env", 32, 4) + actor)
    with pytest.raises(ValueError, match="loop_stages > 1 needs"):
        predict(CostModel(load("pipeline_wins")), Layout((("rollout",), ("actor",)), (2, 2)), 256, 16, loop_stages=2)


def test_weight_sync_only_when_receivers_are_elsewhere():
    p = load("reasoning_8xh100")
    model = CostModel(p)
    apart = predict(model, Layout((("rollout",), ("reward", "inference", "actor")), (4, 4)), 512, 32)
    assert ("weight sync", pytest.approx(0.002 + 15 * 0.08)) in apart.parts
    together = predict(model, Layout.collocated(p.stages, 8), offload=True)
    assert all(label != "weight sync" for label, _ in together.parts)


def test_bad_layouts_raise():
    p = load("collocate_wins")
    model = CostModel(p)
    with pytest.raises(ValueError, match="flow's stages"):
        predict(model, Layout((("rollout", "actor"),), (4,)))
    with pytest.raises(ValueError, match="must divide the batch"):
        predict(model, Layout((("rollout", "reward"), ("inference", "actor")), (2, 2)), 64, 24)
    with pytest.raises(ValueError, match="only tail stages"):
        predict(model, Layout((("rollout", "reward"), ("inference",)), (2, 2), ("actor",)))


# ---------------------------------------------------------------------------------------------- schedule == predict


def non_streaming_actor(p: Profile) -> Profile:
    actor = dataclasses.replace(p.components["actor"], streams=False, fixed_seconds=0.5)
    return dataclasses.replace(p, components={**p.components, "actor": actor})


@st.composite
def plans(draw):
    name = draw(st.sampled_from(["collocate_wins", "reasoning_8xh100", "embodied_hybrid", "tail", "cohosted"]))
    p = non_streaming_actor(load("reasoning_8xh100")) if name == "tail" else \
        dataclasses.replace(load("collocate_wins"), cohosted_scale=0.6) if name == "cohosted" else load(name)
    _, tail = phases(p)
    stages = list(p.stages)
    shared = tuple(tail) if tail and draw(st.booleans()) else ()
    cut_from = stages[: len(stages) - len(shared)]
    n = len(cut_from)
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    if shared and not cuts:
        shared = ()
        cut_from = stages
    bounds = [0, *cuts, len(cut_from)]
    groups = tuple(tuple(cut_from[a:b]) for a, b in zip(bounds, bounds[1:]))
    sizes = tuple(draw(st.integers(1, 6)) for _ in groups)
    layout = Layout(groups, sizes, shared)
    batch = p.batch
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    split_loop = bool(p.loop) and layout.group_of(p.loop[0]) != layout.group_of(p.loop[1])
    stages_ = draw(st.sampled_from([1, 2, 4])) if split_loop else 1
    return p, layout, draw(st.sampled_from(divisors)), stages_, draw(st.booleans())


@settings(max_examples=50, deadline=None)
@given(plans())
def test_schedule_ends_at_the_predicted_step_time(plan):
    p, layout, micro, loop_stages, offload = plan
    model = CostModel(p)
    pred = predict(model, layout, p.batch, micro, loop_stages, offload)
    boxes = schedule(model, layout, p.batch, micro, loop_stages, offload)
    assert max(b.end for b in boxes) == pytest.approx(pred.seconds, rel=1e-9)
    assert sum(s for _, s in pred.parts) == pytest.approx(pred.seconds, rel=1e-9)
    lanes: dict = {}
    for b in boxes:  # a device group never runs two things at once
        assert b.end >= b.start
        for lane in ([b.lane] if b.lane is not None else range(len(layout.groups))):
            lanes.setdefault(lane, []).append((b.start, b.end))
    for spans in lanes.values():
        spans.sort()
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            assert s1 >= e0 - 1e-9
    # generating a step ahead: never slower, never below half the on-policy step nor below any group's own work
    ahead = predict(model, layout, p.batch, micro, loop_stages, offload, staleness=1)
    assert pred.seconds / 2 - 1e-9 <= ahead.seconds <= pred.seconds + 1e-9
    assert ahead.seconds >= max(sum(e - s for s, e in spans) for spans in lanes.values()) - 1e-9
    assert sum(s for _, s in ahead.parts) == pytest.approx(ahead.seconds, rel=1e-9)


def test_components_info_defaults_are_harmless():
    data = json.loads((FIXTURES / "collocate_wins.json").read_text())
    data["components"] = {c: {} for c in data["stages"]}
    p = Profile.from_dict(data)
    assert p.components["actor"] == ComponentInfo()
    assert predict(CostModel(p), Layout.collocated(p.stages, 4), offload=True).feasible
