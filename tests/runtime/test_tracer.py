"""Tracer spans, the Chrome trace layout (a lane per device, a thread per component/rank) and the timeline PNG."""

import json
import os

import pytest

from m2flow.runtime import Tracer, busy_seconds, plot_timeline, write_chrome_trace


def _spans():
    actor0 = Tracer("actor", 0, devices=[0])
    actor1 = Tracer("actor", 1, devices=[1])
    rollout = Tracer("rollout", 0, devices=[0, 1])
    rollout.record("generate", 100.0, 100.5, step=0)
    actor0.record("train", 100.5, 101.0, step=0)
    actor1.record("train", 100.5, 101.25, step=0)
    return rollout.spans() + actor0.spans() + actor1.spans()


def test_tracer_records_nested_spans_with_identity():
    tracer = Tracer("actor", 3, devices=[2])
    with tracer.span("outer", step=5):
        with tracer.span("inner"):
            pass
    with pytest.raises(KeyError):
        with tracer.span("failing"):
            raise KeyError("x")
    spans = tracer.spans()
    assert [s["phase"] for s in spans] == ["inner", "outer", "failing"]
    outer = spans[1]
    assert outer["component"] == "actor" and outer["rank"] == 3 and outer["devices"] == [2]
    assert outer["step"] == 5 and outer["pid"] == os.getpid()
    assert outer["start"] <= spans[0]["start"] <= spans[0]["end"] <= outer["end"]
    assert len(tracer.spans(clear=True)) == 3 and tracer.spans() == []


def test_tracer_keeps_the_newest_spans():
    tracer = Tracer(max_spans=3)
    for i in range(5):
        tracer.record("p", i, i + 1, step=i)
    assert [s["step"] for s in tracer.spans()] == [2, 3, 4]


def test_chrome_trace_has_a_lane_per_device_and_a_thread_per_component_rank(tmp_path):
    path = write_chrome_trace(_spans(), str(tmp_path / "trace.json"), device_names={0: "cpu 0"})
    events = json.load(open(path))["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert lanes == {0: "cpu 0", 1: "device 1"}
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert threads == {(0, "rollout/0"), (1, "rollout/0"), (0, "actor/0"), (1, "actor/1")}
    spans = [e for e in events if e["ph"] == "X"]
    assert sorted((e["pid"], e["name"]) for e in spans) == [
        (0, "generate"), (0, "train"), (1, "generate"), (1, "train")]
    train1 = next(e for e in spans if e["pid"] == 1 and e["name"] == "train")
    assert train1["ts"] == pytest.approx(0.5e6) and train1["dur"] == pytest.approx(0.75e6)
    assert train1["args"]["component"] == "actor" and train1["args"]["step"] == 0


def test_counters_are_tracks_on_their_devices_lanes(tmp_path):
    spans = _spans()
    t0 = min(s["start"] for s in spans)
    counters = [{"device": 1, "time": t0 + 0.5, "name": "idle_fraction", "value": 0.25},
                {"device": 2, "time": t0 + 1.0, "name": "idle_fraction", "value": 1.0}]  # a device with no span
    events = json.load(open(write_chrome_trace(spans, str(tmp_path / "t.json"), counters=counters)))["traceEvents"]
    got = [(e["pid"], e["ts"], e["args"]) for e in events if e["ph"] == "C"]
    assert got == [(1, pytest.approx(0.5e6), {"idle_fraction": 0.25}), (2, pytest.approx(1e6), {"idle_fraction": 1.0})]
    assert {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}[2] == "device 2"


def test_spans_without_devices_go_to_a_host_lane(tmp_path):
    driver = Tracer("driver")
    driver.record("step", 1.0, 2.0)
    events = json.load(open(write_chrome_trace(driver.spans(), str(tmp_path / "t.json"))))["traceEvents"]
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == ["host"]


def test_timeline_png(tmp_path):
    path = plot_timeline(_spans(), tmp_path / "plots" / "timeline.png", title="step 0")  # a Path works too
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 5000


def test_busy_seconds_is_the_union_of_a_devices_spans_clipped_to_the_window():
    def span(start, end, devices):
        return dict(start=start, end=end, devices=devices)

    spans = [span(10.0, 11.0, [0]), span(10.5, 10.8, [0]),  # nested: counts once
             span(10.9, 11.5, [0, 1]),  # overlaps the first, on both devices
             span(9.0, 10.2, [1]), span(11.8, 13.0, [1]),  # clipped at both ends of the window
             span(10.0, 12.0, [])]  # no device (the driver): counts for none
    busy = busy_seconds(spans, 10.0, 12.0, [0, 1, 2])
    assert busy == pytest.approx({0: 1.5, 1: 0.2 + 0.6 + 0.2, 2: 0.0})
    from m2flow.run_dir import idle_metrics

    idle = idle_metrics(spans, 10.0, 12.0, [0, 1])
    assert idle == pytest.approx({"time/idle/device0": 0.5, "time/idle/device1": 1.0, "time/idle_fraction": 1.5 / 4})
