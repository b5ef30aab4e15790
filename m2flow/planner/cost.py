"""Cost model: fits each component's seconds(batch, devices) and memory to a profile table, and predicts one
training step of a layout (who shares which devices) at a granularity, with a breakdown. Pure arithmetic:
it runs nothing and enumerates nothing (`search.py` does that). The rules are stated in docs/planner.md.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from functools import cached_property

from m2flow.planner.profile import ComponentInfo, Profile

__all__ = ["Curve", "ComponentFit", "CostModel", "Layout", "Prediction", "Box", "phases", "predict", "overlapped",
           "schedule"]


# ---------------------------------------------------------------------------------------------- curves


class Curve:
    """y(x) fitted to measured points: piecewise linear through them (so it passes through every point).

    Beyond the largest x it continues the last segment's slope (never decreasing); below the smallest x it
    continues the first segment's slope, kept between proportional (y0 * x / x0) and flat (y0). One point:
    proportional through the origin. Repeated x values are averaged.
    """

    def __init__(self, points: list[tuple[float, float]]):
        if not points:
            raise ValueError("a curve needs at least one point")
        by_x: dict[float, list[float]] = {}
        for x, y in points:
            by_x.setdefault(float(x), []).append(float(y))
        self.xs = sorted(by_x)
        self.ys = [sum(by_x[x]) / len(by_x[x]) for x in self.xs]

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        if x <= xs[0]:
            slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
            return min(ys[0], max(ys[0] + slope * (x - xs[0]), ys[0] * x / xs[0]))
        if x >= xs[-1]:
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            return ys[-1] + slope * (x - xs[-1])
        i = bisect.bisect_right(xs, x)
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + w * (ys[i] - ys[i - 1])


@dataclass
class ComponentFit:
    """One component's fitted costs.

    seconds(b, d): a call of b samples on d devices uses e = min(d, b) devices (one sample is not split), each
    doing x = b / e samples. With r = the largest measured device count <= e (else the smallest measured),
    seconds = curves[r](x) * (e / r) ** gamma: the measured per-device-batch curve at r devices, slowed by the
    fitted data-parallel scaling exponent `gamma` (0 = perfect scaling; assumed when one device count was measured).
    """

    name: str
    info: ComponentInfo
    curves: dict[int, Curve]  # measured device count -> seconds vs per-device batch
    gamma: float
    activation: Curve | None  # activation bytes per device vs per-device batch (peak - state); None = not measured

    def seconds(self, batch: int, devices: int) -> float:
        used = max(1, min(devices, batch))
        counts = sorted(self.curves)
        ref = counts[max(0, bisect.bisect_right(counts, used) - 1)]
        return self.curves[ref](batch / used) * (used / ref) ** self.gamma

    def state_bytes(self, devices: int) -> float:
        """Resident state per device."""
        return self.info.state_bytes / devices if self.info.shard_state else float(self.info.state_bytes)

    def activation_bytes(self, batch: int, devices: int) -> float:
        if self.activation is None:
            return 0.0
        used = max(1, min(devices, batch))
        return max(0.0, self.activation(batch / used))

    @property
    def switch_seconds(self) -> float:
        return self.info.offload_seconds + self.info.onload_seconds

    def measured_per_device_batch(self) -> tuple[float, float]:
        xs = [x for c in self.curves.values() for x in c.xs]
        return min(xs), max(xs)


def fit_component(profile: Profile, name: str) -> ComponentFit:
    """Fit curves (per measured device count) and the scaling exponent from the profile's rows for `name`."""
    info = profile.components[name]
    rows = [m for m in profile.measurements if m.component == name]
    by_devices: dict[int, list] = {}
    for m in rows:
        by_devices.setdefault(m.devices, []).append(m)
    curves = {d: Curve([(m.batch / min(d, m.batch), m.seconds) for m in ms]) for d, ms in by_devices.items()}
    # gamma: at the same per-device batch x, time(d2) / time(d1) = (d2 / d1) ** gamma, averaged over measured x
    logs = []
    counts = sorted(curves)
    for i, d1 in enumerate(counts):
        for d2 in counts[i + 1:]:
            for x in curves[d2].xs:
                logs.append(math.log(curves[d2](x) / curves[d1](x)) / math.log(d2 / d1))
    gamma = min(1.0, max(0.0, sum(logs) / len(logs))) if logs else 0.0
    fit = ComponentFit(name, info, curves, gamma, None)
    peaks = [(m.batch / min(m.devices, m.batch), m.peak_bytes - fit.state_bytes(m.devices)) for m in rows if m.peak_bytes]
    fit.activation = Curve([(x, max(0.0, a)) for x, a in peaks]) if peaks else None
    return fit


class CostModel:
    """All components' fits for one profile, with memoized seconds(component, batch, devices). `batch`: the samples
    per step planned for (default: the profile's); it decides which stages wait for the whole batch (`phases`)."""

    def __init__(self, profile: Profile, batch: int | None = None):
        self.profile = profile
        self.fits = {name: fit_component(profile, name) for name in profile.stages}
        self.head, self.tail = phases(profile, batch)
        self._seconds: dict[tuple, float] = {}  # memo of seconds and activation bytes

    def seconds(self, component: str, batch: int, devices: int) -> float:
        key = (component, batch, devices)
        if key not in self._seconds:
            self._seconds[key] = self.fits[component].seconds(batch, devices)
        return self._seconds[key]

    def activation_bytes(self, component: str, batch: int, devices: int) -> float:
        key = ("act", component, batch, devices)
        if key not in self._seconds:
            self._seconds[key] = self.fits[component].activation_bytes(batch, devices)
        return self._seconds[key]


# ---------------------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """Who runs where. `groups` are contiguous runs of the flow's stages, laid out left to right on disjoint
    device ranges of `sizes` devices (one group: collocated); `shared` components run on every device
    (hybrid: e.g. the last stage trains on all devices after the first two were pipelined on disjoint ones)."""

    groups: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...]
    shared: tuple[str, ...] = ()

    @cached_property
    def num_devices(self) -> int:
        return sum(self.sizes)

    @property
    def mode(self) -> str:
        """As parse_placement names it: collocated (one group), disaggregated (every component on its own
        devices), else hybrid (pipelined groups of collocated components, or components shared over all devices)."""
        if len(self.groups) == 1 and not self.shared:
            return "collocated"
        return "disaggregated" if not self.shared and all(len(g) == 1 for g in self.groups) else "hybrid"

    @cached_property
    def _where(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {c: i for i, g in enumerate(self.groups) for c in g}
        out.update({c: None for c in self.shared})
        return out

    def ranges(self) -> list[tuple[int, int]]:
        out, lo = [], 0
        for size in self.sizes:
            out.append((lo, lo + size - 1))
            lo += size
        return out

    def group_of(self, component: str) -> int | None:
        """The group index of `component`, None if it is shared (on all devices)."""
        try:
            return self._where[component]
        except KeyError:
            raise KeyError(f"layout has no component {component!r}") from None

    def devices(self, component: str) -> int:
        g = self.group_of(component)
        return self.num_devices if g is None else self.sizes[g]

    def spec(self, ranks: dict[str, int] | None = None) -> str:
        """The placement spec string, e.g. `rollout: 0-5; reward,inference,actor: 6-7` (parse_placement reads it).
        `ranks`: components written on their own, with that many processes over their devices: n ranks on devices
        lo-hi -> `c: lo-hi:0-(n-1)` (two per device: `env: 0-1:0-3`), one -> `c: lo-hi:0` (one process over them)."""
        ranks = ranks or {}
        if len(self.groups) == 1 and not self.shared and not ranks:
            return f"{','.join(self.groups[0])}: all"
        groups = [(g, lo, hi, False) for g, (lo, hi) in zip(self.groups, self.ranges())]
        if self.shared:
            groups.append((self.shared, 0, self.num_devices - 1, True))
        parts = []
        for group, lo, hi, shared in groups:
            devices = str(lo) if lo == hi else f"{lo}-{hi}"
            for ranked, run in itertools.groupby(group, key=lambda c: c in ranks):  # in data order
                if not ranked:
                    parts.append(f"{','.join(run)}: {'all' if shared else devices}")
                    continue
                for c in run:
                    n = ranks[c]
                    parts.append(f"{c}: {devices}" + ("" if n == hi - lo + 1 else ":0" if n == 1 else f":0-{n - 1}"))
        return "; ".join(parts)

    def label(self, group: int) -> str:
        lo, hi = self.ranges()[group]
        devs = f"device {lo}" if lo == hi else f"devices {lo}-{hi}"
        return f"{devs}: {','.join(self.groups[group])}"

    @staticmethod
    def collocated(stages: tuple[str, ...], num_devices: int) -> Layout:
        return Layout((tuple(stages),), (num_devices,))


def phases(profile: Profile, batch: int | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(head, tail): the head streams (pipelines over micro-batches) or is the loop (its first two stages alternating); the tail
    starts at the first stage that needs the whole batch (streams=false, or one that merges what is streamed to it
    into passes of `batch` samples or more: it waits for the whole batch too) and runs once on the whole batch."""
    stages, batch = profile.stages, batch or profile.batch
    if profile.loop:
        return stages[:2], stages[2:]
    for i in range(1, len(stages)):
        info = profile.components[stages[i]]
        if not info.streams or (info.merge_samples and info.merge_samples >= batch):
            return stages[:i], stages[i:]
    return stages, ()


# ---------------------------------------------------------------------------------------------- step terms


@dataclass
class _Terms:
    """Everything one step costs, before it is added up (predict) or laid out in time (schedule)."""

    head_groups: list[int | None]  # group of each pipelined head stage, in data order
    head_work: list[list[tuple[str, float, float]]]  # per head group: (component, compute s, switch s) per micro-batch
    link: float  # transfer of one micro-batch between consecutive head groups (a delay: transfers overlap)
    waves: int  # micro-batches per step
    loop: tuple[float, float, float, int] | None  # a split loop: (first s, second s, transfer s, stages)
    fixed: list[tuple[str, float]]  # once-per-step work of head components, after the head
    boundary: dict[int | None, float]  # once-per-step switches of head components, per group (groups overlap)
    tail: list[tuple[str, float, float, float]]  # (component, transfer in, compute + fixed, switch), one after another
    sync: float  # weight sync after the update
    sync_group: int | None
    peak_bytes: list[float] = field(default_factory=list)  # per group: predicted peak bytes per device
    reason: str = ""  # why the plan does not fit in memory ('' when it fits)
    scale: float = 1.0  # the profile's cohosted_scale where it applies (one group), already in the terms above


def _terms(model: CostModel, layout: Layout, batch: int, micro_batch: int, loop_stages: int, offload: bool,
           loop_ranks: int = 1) -> _Terms:
    p, head, tail, fit = model.profile, model.head, model.tail, model.fits
    _check(p, layout, head, tail, batch, micro_batch, loop_stages, loop_ranks)
    ranks = p.loop_latency.ranks_factor(loop_ranks) if p.loop else 1.0  # on the loop's first stage's rows

    def others_on_devices(c: str, turn) -> bool:
        g = layout.group_of(c)
        residents = p.stages if g is None else layout.groups[g] + layout.shared
        return any(r not in turn for r in residents)

    hgroups: list[int | None] = []
    for c in head:
        if layout.group_of(c) not in hgroups:
            hgroups.append(layout.group_of(c))
    pipelined = len(hgroups) > 1
    # one group, no loop: the flow runs every component in one process, measured to take this share of the rows
    cohosted = p.cohosted_scale if p.cohosted_scale and not p.loop and len(layout.groups) == 1 and not layout.shared \
        else 1.0
    boundary: dict[int | None, float] = {}
    head_work: list[list[tuple[str, float, float]]] = []
    loop = None
    if p.loop and pipelined:  # the loop's two stages on different devices: loop_stages sub-batches alternate
        sub = batch // loop_stages
        first, second = p.loop
        loop = (model.seconds(first, sub, layout.devices(first)) * ranks,
                model.seconds(second, sub, layout.devices(second)),
                p.transfer.seconds(sub) + p.loop_latency.split, loop_stages)
        waves, link = 1, 0.0
    else:
        waves = batch // micro_batch if pipelined else 1
        size = micro_batch if pipelined else batch
        link = p.transfer.seconds(size) if pipelined else 0.0
    for g in hgroups:
        members = [c for c in head if layout.group_of(c) == g]
        work = []
        for c in members:
            if loop:
                compute = 0.0
            elif p.loop:  # the loop's two stages on the same devices: the S stages take turns, so they add up
                scale, latency = p.loop_latency.on_shared_devices(loop_stages, loop_ranks)  # one stage: one process
                compute = loop_stages * model.seconds(c, batch // loop_stages, layout.devices(c)) * scale
                if c == p.loop[0]:
                    compute *= ranks
                if c == p.loop[1]:  # and every hand-over's round trip too
                    compute += loop_stages * latency
            elif c == head[0]:  # the source runs the whole batch in one call; its outputs stream out
                compute = model.seconds(c, batch, layout.devices(c)) / waves
            else:  # a component that merges micro-batches into passes of `merged` samples: its share of one pass
                merged = min(batch, max(size, fit[c].info.merge_samples))
                compute = model.seconds(c, merged, layout.devices(c)) * size / merged
            # chain stages that share a pipelined group's devices alternate every micro-batch
            per_turn = offload and not p.loop and len(members) > 1
            work.append((c, compute * cohosted, fit[c].switch_seconds if per_turn else 0.0))
            if offload and not per_turn and others_on_devices(c, p.loop or (c,)):
                boundary[g] = boundary.get(g, 0.0) + fit[c].switch_seconds
        head_work.append(work)
    fixed = [(c, fit[c].info.fixed_seconds * cohosted) for c in head if fit[c].info.fixed_seconds]

    tail_items = []
    prev = head[-1]
    for c in tail:
        moves = layout.group_of(c) != layout.group_of(prev)
        switch = fit[c].switch_seconds if offload and others_on_devices(c, (c,)) else 0.0
        compute = (model.seconds(c, batch, layout.devices(c)) + fit[c].info.fixed_seconds) * cohosted
        tail_items.append((c, p.transfer.seconds(batch) if moves else 0.0, compute, switch))
        prev = c

    w = p.weights
    sync, sync_group = 0.0, None
    if w.bytes and w.to:
        src = layout.group_of(w.source)
        sync_group = src
        if src is not None and any(layout.group_of(c) != src for c in w.to):
            sync = p.transfer.latency_seconds + w.bytes / 1e9 * p.transfer.seconds_per_gb

    terms = _Terms(hgroups, head_work, link, waves, loop, fixed, boundary, tail_items, sync, sync_group, scale=cohosted)
    _memory(model, layout, terms, batch, micro_batch if pipelined else batch, loop_stages, offload)
    return terms


def _check(p: Profile, layout: Layout, head, tail, batch: int, micro_batch: int, loop_stages: int,
           loop_ranks: int = 1) -> None:
    placed = [c for g in layout.groups for c in g] + list(layout.shared)
    if sorted(placed) != sorted(p.stages):
        raise ValueError(f"layout places {placed}, but the flow's stages are {list(p.stages)}")
    if len(layout.sizes) != len(layout.groups) or min(layout.sizes) < 1:
        raise ValueError(f"layout needs one positive device count per group, got {layout.sizes}")
    if any(c in head for c in layout.shared):
        raise ValueError(f"only tail stages {list(tail)} can be shared over all devices, not {list(layout.shared)}")
    if batch % micro_batch or batch % loop_stages:
        raise ValueError(f"micro_batch {micro_batch} and loop_stages {loop_stages} must divide the batch {batch}")
    if loop_stages > 1 and not p.loop:
        raise ValueError("loop_stages > 1 needs a loop (a profile whose first two stages alternate)")
    if loop_ranks != 1 and not p.loop:
        raise ValueError("loop_ranks > 1 needs a loop (a profile whose first two stages alternate)")


def _memory(model: CostModel, layout: Layout, t: _Terms, batch: int, size: int, loop_stages: int, offload: bool) -> None:
    """Peak bytes per device in each group: resident states + the largest activation of a turn. Without offload
    every resident state stays; with offload only the running turn's (the loop is one turn)."""
    p, fit, head = model.profile, model.fits, model.head
    cap = p.machine.memory_bytes
    for g in range(len(layout.groups)):
        members = layout.groups[g] + layout.shared
        state, act = {}, {}
        for c in members:
            d = layout.devices(c)
            if c in head and p.loop:
                n = batch // loop_stages
            elif c in head and c != head[0]:  # the source works on the whole batch at once
                n = size
            else:
                n = batch
            state[c], act[c] = fit[c].state_bytes(d), model.activation_bytes(c, n, d)
        if offload:
            turns = [[c for c in members if c in p.loop]] if p.loop else []
            turns += [[c] for c in members if c not in p.loop]
        else:
            turns = [members]
        peak, worst = 0.0, []
        for turn in (tn for tn in turns if tn):
            need = sum(state[c] for c in turn) + max(act[c] for c in turn)
            if need > peak:
                peak, worst = need, turn
        t.peak_bytes.append(peak)
        if peak > cap and not t.reason:
            label = layout.label(g)
            what = " + ".join(f"{c} {state[c] / 1e9:.3g}" for c in worst)
            t.reason = (f"{label} need {peak / 1e9:.3g} GB per device (states {what} GB + activations "
                        f"{max(act[c] for c in worst) / 1e9:.3g} GB{', offload on' if offload else ''}) "
                        f"> {cap / 1e9:.3g} GB")


# ---------------------------------------------------------------------------------------------- predict


@dataclass
class Prediction:
    """One step of a plan: `seconds` = sum of `parts` (labelled terms); `busy` = compute seconds per component."""

    seconds: float
    parts: list[tuple[str, float]]
    busy: dict[str, float]
    peak_bytes: list[float]  # per device group (Layout.groups order): predicted peak bytes per device
    feasible: bool
    reason: str  # why it does not fit in memory
    bottleneck: str  # the component (or "context switch") that dominates the step


def predict(model: CostModel, layout: Layout, batch: int | None = None, micro_batch: int | None = None,
            loop_stages: int = 1, offload: bool = False, staleness: int = 0, loop_ranks: int = 1) -> Prediction:
    """Predict one training step.

    Head (streaming stages): one group -> its components add up on the whole batch; several groups -> a pipeline
    over batch/micro_batch micro-batches: fill (first micro-batch through every group, plus transfers) + slowest
    group x (micro-batches - 1). A group's time per micro-batch is the sum of its components (+ their switches when
    offloading). A loop (the first two stages alternating, a and b) on different devices with S stages: max(S*a, S*b,
    a+b+transfer+split latency) at batch/S; on the same devices they take turns: S*(a + b + shared latency) at batch/S.
    With `loop_ranks` 2 (two processes of the first stage per device) a is its row x loop_latency.two_ranks_scale.
    Then once-per-step work, switches, the tail stages on the whole batch one after another, weight sync.
    `staleness` (how many steps old the data a step trains on may be) >= 1:
    generation (or the loop's collection) of the next steps overlaps this one wherever the source has
    devices of its own (`overlapped`); the saving is a negative part of the breakdown.
    """
    batch = batch or model.profile.batch
    micro_batch = micro_batch or batch
    t = _terms(model, layout, batch, micro_batch, loop_stages, offload, loop_ranks)
    parts: list[tuple[str, float]] = []
    busy = {c: 0.0 for c in model.profile.stages}
    switch = 0.0
    if t.loop:
        a_s, b_s, x, s = t.loop
        a, b = model.profile.loop
        parts.append((f"{a}<->{b} loop, {s} pipeline stage(s)", max(s * a_s, s * b_s, a_s + b_s + x)))
        busy[a], busy[b] = s * a_s, s * b_s
    else:
        taus = [sum(c + sw for _, c, sw in work) for work in t.head_work]
        for work in t.head_work:
            for c, compute, sw in work:
                busy[c] += compute * t.waves
                switch += sw * t.waves
        if len(taus) == 1:
            how = f" (co-hosted: rows x {t.scale:.2f})" if t.scale != 1.0 else ""
            parts += [(c + how, compute) for c, compute, _ in t.head_work[0]]
            if taus[0] > sum(c for _, c, _ in t.head_work[0]):
                parts.append(("context switches", sum(sw for _, _, sw in t.head_work[0])))
        else:
            k = len(taus)
            slow = max(range(k), key=taus.__getitem__)
            names = "+".join(c for c, _, _ in t.head_work[slow])
            parts.append((f"pipeline fill: micro-batch 1 through {k} groups", sum(taus) + (k - 1) * t.link))
            if t.waves > 1:
                parts.append((f"{names} x {t.waves - 1} more micro-batches", (t.waves - 1) * taus[slow]))
    for c, s in t.fixed:
        parts.append((f"{c} once per step", s))
        busy[c] += s
    if t.boundary:
        parts.append(("context switches (head)", max(t.boundary.values())))
        switch += max(t.boundary.values())
    for c, x, compute, sw in t.tail:
        if x:
            parts.append((f"transfer to {c}", x))
        parts.append((f"{c} (whole batch{', co-hosted' if t.scale != 1.0 else ''})", compute))
        busy[c] += compute
        if sw:
            parts.append((f"{c} context switch", sw))
            switch += sw
    if t.sync:
        parts.append(("weight sync", t.sync))
    seconds = sum(s for _, s in parts)
    if staleness:
        steady = overlapped(len(layout.groups), _boxes(model, layout, t), seconds, staleness)
        if steady < seconds - 1e-12:
            label = ("the next iteration's collection (max_policy_lag" if model.profile.loop
                     else "the next steps' generation (max_staleness")
            parts.append((f"overlap with {label} {staleness})", steady - seconds))
            seconds = steady
    top = max(busy, key=busy.__getitem__)
    bottleneck = "context switch" if switch > busy[top] else top
    return Prediction(seconds, parts, busy, t.peak_bytes, not t.reason, t.reason, bottleneck)


def overlapped(groups: int, boxes: list[Box], seconds: float, staleness: int) -> float:
    """A step in the steady state of bounded off-policy training (max_staleness = `staleness` >= 1), given the
    on-policy step's `seconds` and its `schedule` boxes on `groups` device groups: the source's devices generate the
    next steps' samples while the other devices train on this step's, so a step takes the busiest device group's work
    (a box on every group counting on each), but no less than `seconds / (staleness + 1)`: generating step
    k + staleness + 1 waits for the weights step k trains. One group (collocated) gains nothing: its components take
    turns."""
    busy = [0.0] * groups
    for box in boxes:
        for lane in range(len(busy)) if box.lane is None else (box.lane,):
            busy[lane] += box.end - box.start
    return max(max(busy), seconds / (staleness + 1))


# ---------------------------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Box:
    """One interval of the predicted schedule on a device group's lane (lane None: every lane)."""

    lane: int | None
    component: str
    start: float
    end: float
    kind: str  # "compute" | "switch" | "fixed" | "sync" | "loop"
    micro: int | None = None  # micro-batch index, for pipelined stages


def schedule(model: CostModel, layout: Layout, batch: int | None = None, micro_batch: int | None = None,
             loop_stages: int = 1, offload: bool = False, loop_ranks: int = 1) -> list[Box]:
    """The step laid out in time, consistent with `predict` (the last box ends at its `seconds`): each
    micro-batch starts on a group when the group is free and the previous group has finished it (+ transfer)."""
    batch = batch or model.profile.batch
    micro_batch = micro_batch or batch
    return _boxes(model, layout, _terms(model, layout, batch, micro_batch, loop_stages, offload, loop_ranks))


def _boxes(model: CostModel, layout: Layout, t: _Terms) -> list[Box]:
    """`schedule`'s boxes from a step's terms."""
    boxes: list[Box] = []
    now = 0.0
    if t.loop:
        a_s, b_s, x, s = t.loop
        length = max(s * a_s, s * b_s, a_s + b_s + x)
        a, b = model.profile.loop
        boxes.append(Box(t.head_groups[0], a, 0.0, s * a_s, "loop"))
        boxes.append(Box(t.head_groups[1], b, length - s * b_s, length, "loop"))
        now = length
    else:
        done = [0.0] * len(t.head_work)  # when each group finished its previous micro-batch
        for i in range(t.waves):
            arrive = 0.0
            for j, work in enumerate(t.head_work):
                start = max(done[j], arrive + (t.link if j else 0.0))
                for c, compute, sw in work:
                    boxes.append(Box(t.head_groups[j], c, start, start + compute, "compute", i if t.waves > 1 else None))
                    start += compute
                    if sw:
                        boxes.append(Box(t.head_groups[j], c, start, start + sw, "switch", i))
                        start += sw
                done[j] = arrive = start
        now = max(done)
    for c, s in t.fixed:
        boxes.append(Box(layout.group_of(c), c, now, now + s, "fixed"))
        now += s
    if t.boundary:
        for g, s in t.boundary.items():
            boxes.append(Box(g, "offload/onload", now, now + s, "switch"))
        now += max(t.boundary.values())
    for c, x, compute, sw in t.tail:
        now += x
        boxes.append(Box(layout.group_of(c), c, now, now + compute, "compute"))
        now += compute
        if sw:
            boxes.append(Box(layout.group_of(c), c, now, now + sw, "switch"))
            now += sw
    if t.sync:
        boxes.append(Box(t.sync_group, "weight sync", now, now + t.sync, "sync"))
    return boxes
