"""Spans of who ran what, where and when: recorded in each worker, written as a Chrome trace or a timeline PNG.

Recording is in-process and cheap (a dict per span); gathering spans from workers is `Group.spans()`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Iterable

__all__ = ["Tracer", "busy_seconds", "write_chrome_trace", "plot_timeline"]

_HOST_LANE = 1_000_000  # Chrome-trace pid for spans that have no device (e.g. the driver)


class Tracer:
    """Records spans {phase, component, rank, devices, step, start, end, pid} (times in seconds since the epoch).

    Keeps the newest `max_spans` spans. Thread-safe; `span()` nests.
    """

    def __init__(self, component: str = "driver", rank: int = 0, devices: Iterable[int] = (), max_spans: int = 200_000):
        self.component, self.rank, self.devices = component, rank, list(devices)
        self._spans: deque[dict] = deque(maxlen=max_spans)
        self._lock = threading.Lock()

    def record(self, phase: str, start: float, end: float, step: int | None = None, **extra) -> dict:
        span = dict(phase=phase, component=self.component, rank=self.rank, devices=list(self.devices),
                    step=step, start=start, end=end, pid=os.getpid(), **extra)
        with self._lock:
            self._spans.append(span)
        return span

    @contextmanager
    def span(self, phase: str, step: int | None = None, **extra):
        """Time the block; the span is recorded even if the block raises."""
        start = time.time()
        try:
            yield
        finally:
            self.record(phase, start, time.time(), step, **extra)

    def spans(self, clear: bool = False) -> list[dict]:
        with self._lock:
            out = list(self._spans)
            if clear:
                self._spans.clear()
        return out


def busy_seconds(spans: Iterable[dict], start: float, end: float, devices: Iterable[int]) -> dict[int, float]:
    """Per device: the seconds of [start, end] covered by at least one span on it. Overlapping and nested spans
    count once (the union), a span is clipped to the window. `end - start - busy` is the device's idle time."""
    out = {}
    for d in devices:
        intervals = sorted((max(s["start"], start), min(s["end"], end)) for s in spans if d in (s.get("devices") or ()))
        busy, reach = 0.0, start
        for a, b in intervals:
            if b > reach:
                busy += b - max(a, reach)
                reach = b
        out[d] = busy
    return out


def _lanes(span: dict) -> list[int]:
    return list(span.get("devices") or []) or [_HOST_LANE]


def write_chrome_trace(spans: list[dict], path: str | os.PathLike, device_names: dict[int, str] | None = None,
                       counters: list[dict] | None = None) -> str:
    """Write Chrome trace JSON (open in https://ui.perfetto.dev): a process lane per device, a thread per
    component/rank. A span on several devices appears on each of their lanes. `counters`: {device, time (epoch s),
    name, value} samples drawn as a counter track on the device's lane (e.g. each step's idle fraction). Returns
    `path`."""
    device_names = device_names or {}
    t0 = min((s["start"] for s in spans), default=0.0)
    threads = {key: i + 1 for i, key in enumerate(sorted({(s["component"], s["rank"]) for s in spans}, key=str))}
    events, named = [], set()

    def name_lane(lane: int) -> None:
        if lane not in named:
            named.add(lane)
            name = "host" if lane == _HOST_LANE else device_names.get(lane, f"device {lane}")
            events.append(dict(ph="M", name="process_name", pid=lane, tid=0, args={"name": name}))
            events.append(dict(ph="M", name="process_sort_index", pid=lane, tid=0, args={"sort_index": lane}))

    for s in spans:
        tid = threads[(s["component"], s["rank"])]
        args = {k: v for k, v in s.items() if k not in ("phase", "start", "end")}
        for lane in _lanes(s):
            name_lane(lane)
            if (lane, tid) not in named:
                named.add((lane, tid))
                events.append(dict(ph="M", name="thread_name", pid=lane, tid=tid,
                                   args={"name": f"{s['component']}/{s['rank']}"}))
            events.append(dict(ph="X", name=s["phase"], cat=s["component"], pid=lane, tid=tid,
                               ts=(s["start"] - t0) * 1e6, dur=max(s["end"] - s["start"], 0.0) * 1e6, args=args))
    for c in counters or []:
        name_lane(c["device"])
        events.append(dict(ph="C", name=c["name"], pid=c["device"], ts=(c["time"] - t0) * 1e6,
                           args={c["name"]: c["value"]}))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f, default=str)
    return os.fspath(path)


def plot_timeline(spans: list[dict], path: str | os.PathLike, title: str | None = None) -> str:
    """Save a PNG timeline: one lane per device (a thin row per component/rank inside it), bars colored by
    component, with a legend. Returns `path`."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # no pyplot: no global state, the Agg canvas is used for savefig
    from matplotlib.patches import Rectangle

    t0 = min((s["start"] for s in spans), default=0.0)
    components = sorted({s["component"] for s in spans})
    colors = {c: colormaps["tab10"](i % 10) for i, c in enumerate(components)}
    rows: dict[int, list] = {}  # lane -> [(component, rank)] in order of appearance
    for s in spans:
        for lane in _lanes(s):
            keys = rows.setdefault(lane, [])
            if (s["component"], s["rank"]) not in keys:
                keys.append((s["component"], s["rank"]))

    total = max((s["end"] for s in spans), default=1.0) - t0 or 1.0
    fig = Figure(figsize=(12, 1.0 + 0.8 * max(len(rows), 1)))
    ax = fig.add_subplot()
    ticks, labels = [], []
    for y, lane in enumerate(sorted(rows)):
        keys = rows[lane]
        height = 0.8 / len(keys)
        bars: dict[int, list] = {}  # row -> its bars, drawn in one call (one call per bar is quadratic in matplotlib)
        for s in spans:
            if lane not in _lanes(s):
                continue
            row = keys.index((s["component"], s["rank"]))
            x, width = s["start"] - t0, max(s["end"] - s["start"], 1e-6)
            bars.setdefault(row, []).append((x, width))
            if width > 0.05 * total:  # label the phase where it fits
                ax.text(x + width / 2, y - 0.4 + (row + 0.45) * height, s["phase"], ha="center", va="center",
                        fontsize=7, clip_on=True)
        for row, xs in bars.items():
            ax.broken_barh(xs, (y - 0.4 + row * height, height * 0.9), facecolors=colors[keys[row][0]])
        ticks.append(y)
        labels.append("host" if lane == _HOST_LANE else f"device {lane}")
    ax.set_yticks(ticks, labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    if title:
        ax.set_title(title)
    handles = [Rectangle((0, 0), 1, 1, color=colors[c]) for c in components]
    if handles:
        ax.legend(handles, components, loc="upper right", fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return os.fspath(path)
