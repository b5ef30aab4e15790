"""Plan search: enumerates layouts (collocated, disaggregated, hybrid), device splits, micro-batch sizes, the
loop's pipeline stages (and two processes per device of its first stage, where measured) and offload; prunes
plans that do not fit in memory; ranks the rest by predicted step time.

Pure: it reads a profile and returns candidates (with placement specs that `parse_placement` accepts); it
launches nothing. Also `plan_command`, the logic of `m2flow plan --profile P.json --devices N`.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from m2flow.planner.cost import CostModel, Layout, Prediction, predict
from m2flow.planner.profile import Profile

__all__ = ["Candidate", "SearchResult", "search", "device_splits", "micro_batch_sizes", "plan_command"]

EXHAUSTIVE_SPLITS = 1000  # enumerate every device split when there are at most this many, else the sensible ones
MAX_MICRO_BATCHES = 256  # fewest samples per micro-batch: batch / 256
ENV_STAGES = (1, 2, 4)
# A second process of the loop's first stage per device is offered only where the profile measured it at least this
# much faster (loop_latency.two_ranks_scale at most 1 - TWO_RANKS_MIN_GAIN): one probe rollout decides it, the
# profiler's repeated rows spread by about 10% here, and the probe does not see what four env processes beside the
# policy and actor cost in a run (measured: a scale of 0.98 picked two per device, which then ran 25-40% slower).
TWO_RANKS_MIN_GAIN = 0.1


@dataclass
class Candidate:
    """One plan with its predicted step."""

    layout: Layout
    batch: int
    micro_batch: int  # samples per message between stages (the whole batch when nothing is pipelined)
    loop_stages: int  # pipeline stages of the loop (a profile whose first two stages alternate); 1 otherwise
    offload: bool
    prediction: Prediction
    loop_ranks: int = 1  # processes per device of the loop's first stage (`ranked`); 1 otherwise
    ranked: str = ""  # the component loop_ranks counts (the loop's first stage), "" when loop_ranks is 1

    @property
    def seconds(self) -> float:
        return self.prediction.seconds

    def ranks(self) -> dict[str, int]:
        """Components with more than one process per device: name -> processes over its devices."""
        if self.loop_ranks == 1:
            return {}
        return {self.ranked: self.loop_ranks * self.layout.devices(self.ranked)}

    @property
    def spec(self) -> str:
        return self.layout.spec(self.ranks())

    @property
    def mode(self) -> str:
        return self.layout.mode

    @property
    def num_devices(self) -> int:
        return self.layout.num_devices

    def describe(self) -> str:
        stages = f", {self.loop_stages} loop pipeline stage(s)" if self.loop_stages > 1 else ""
        stages += f", {self.loop_ranks} {self.ranked} processes per device" if self.loop_ranks > 1 else ""
        return (f"{self.mode}  {self.spec}\n  micro-batch {self.micro_batch}{stages}, "
                f"offload {'on' if self.offload else 'off'}, predicted step {self.seconds:.3g} s, bottleneck {self.prediction.bottleneck}")


@dataclass
class SearchResult:
    profile: Profile
    num_devices: int
    batch: int
    candidates: list[Candidate]  # the top feasible plans, fastest first, one per structure (its best device split)
    collocated: Candidate | None  # the fastest feasible collocated plan (for comparison), None if none fits
    evaluated: int  # plans predicted
    infeasible: int  # of which did not fit in memory
    seconds: float = 0.0  # time the search took
    infeasible_examples: list[str] = field(default_factory=list)  # a few reasons, for the report

    @property
    def best(self) -> Candidate:
        if not self.candidates:
            why = "; ".join(self.infeasible_examples[:3])
            raise ValueError(f"no plan fits in memory on {self.num_devices} device(s) of "
                             f"{self.profile.machine.memory_bytes / 1e9:.3g} GB: {why}")
        return self.candidates[0]

    def table(self) -> str:
        """The top candidates as a text table."""
        base = self.collocated.seconds if self.collocated else None
        loop = bool(self.profile.loop)
        head = ["#", "mode", "placement", "micro", *(["loop"] if loop else []), "offload", "step s",
                "vs colloc", "bottleneck"]
        rows = []
        for i, c in enumerate(self.candidates, 1):
            rows.append([str(i), c.mode, c.spec, str(c.micro_batch), *([str(c.loop_stages)] if loop else []),
                         "on" if c.offload else "off", f"{c.seconds:.4g}",
                         f"{base / c.seconds:.2f}x" if base else "-", c.prediction.bottleneck])
        widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
        right = {0, 3, 4, 6, 7} if loop else {0, 3, 5, 6}
        fmt = lambda r: "  ".join(v.rjust(w) if k in right else v.ljust(w) for k, (v, w) in enumerate(zip(r, widths)))
        return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)])

    def plan(self):
        """The best candidate as an ExecutionPlan (what a flow launches)."""
        from m2flow.planner.plan import make_plan  # imports the runtime package (and Ray): only when asked

        b = self.best
        return make_plan(b.spec, self.num_devices, list(self.profile.stages), self.batch, b.micro_batch, b.offload)

    def to_plan_dict(self) -> dict:
        """The best plan as plain data, e.g. for plan.yaml: the keys of ExecutionPlan.to_dict (one rank per device,
        or loop_ranks for the loop's first stage, as parse_placement makes them) + the loop's stages + the prediction."""
        b = self.best
        ranges = b.layout.ranges()
        placement = {}
        for comp in self.profile.stages:
            g = b.layout.group_of(comp)
            lo, hi = (0, self.num_devices - 1) if g is None else ranges[g]
            per_device = b.loop_ranks if comp == b.ranked else 1
            placement[comp] = [[d] for d in range(lo, hi + 1) for _ in range(per_device)]
        return {
            "mode": b.mode,
            "placement": placement,
            "placement_spec": b.spec,
            "micro_batch": self.batch if b.mode == "collocated" else b.micro_batch,
            "channel_maxsize": 0,
            "offload": b.offload,
            "loop_stages": b.loop_stages,
            **({"loop_ranks": b.loop_ranks} if b.loop_ranks > 1 else {}),
            "predicted_step_seconds": round(b.seconds, 6),
            "predicted_collocated_seconds": round(self.collocated.seconds, 6) if self.collocated else None,
            "breakdown": {label: round(s, 6) for label, s in b.prediction.parts},
            "profile": {"source": self.profile.source, "flow": self.profile.flow, "batch": self.batch,
                        "profiled_devices": self.profile.machine.devices, "device_kind": self.profile.machine.kind},
        }


# ---------------------------------------------------------------------------------------------- enumeration


def contiguous_groupings(stages: tuple[str, ...]) -> list[tuple[tuple[str, ...], ...]]:
    """Every way to cut the ordered stages into contiguous runs: (a,b,c) -> (abc), (a|bc), (ab|c), (a|b|c)."""
    out = []
    n = len(stages)
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = (0, *cuts, n)
            out.append(tuple(tuple(stages[bounds[i]:bounds[i + 1]]) for i in range(len(bounds) - 1)))
    return out


def device_splits(num_devices: int, work: list[float]) -> list[tuple[int, ...]]:
    """Device counts for len(work) groups summing to num_devices (each >= 1).

    Every split when there are at most EXHAUSTIVE_SPLITS of them. Else the sensible ones: the split proportional
    to the groups' predicted work, and splits where each group but the last takes its proportional share (rounded)
    or a power of two or three times a power of two within a factor of 4 of it, the last group the rest.
    """
    k = len(work)
    if k > num_devices:
        return []
    if k == 1:
        return [(num_devices,)]
    if math.comb(num_devices - 1, k - 1) <= EXHAUSTIVE_SPLITS:
        return [tuple(b - a for a, b in zip((0, *cuts), (*cuts, num_devices)))
                for cuts in itertools.combinations(range(1, num_devices), k - 1)]
    total = sum(work) or 1.0
    shares = [num_devices * w / total for w in work]
    options = []
    for share in shares[:-1]:
        sizes = {round(share)}
        for base in (1, 3):
            for j in range(int(math.log2(num_devices)) + 1):
                if share / 4 <= base << j <= share * 4:
                    sizes.add(base << j)
        options.append(sorted({min(max(1, s), num_devices - (k - 1)) for s in sizes}))
    out = {_proportional(num_devices, shares)}
    for head in itertools.product(*options):
        rest = num_devices - sum(head)
        if rest >= 1:
            out.add((*head, rest))
    return sorted(out)


def _proportional(num_devices: int, shares: list[float]) -> tuple[int, ...]:
    """Round shares (summing to num_devices) to whole devices, each >= 1, keeping the sum (largest remainder)."""
    sizes = [max(1, int(s)) for s in shares]
    while sum(sizes) > num_devices:
        sizes[max(range(len(sizes)), key=lambda i: sizes[i])] -= 1
    while sum(sizes) < num_devices:
        sizes[max(range(len(sizes)), key=lambda i: shares[i] - sizes[i])] += 1
    return tuple(sizes)


def micro_batch_sizes(batch: int) -> list[int]:
    """Divisors of the batch between batch / MAX_MICRO_BATCHES and batch: for each power of two in that range,
    the divisor closest to it (all of them when the batch is a power of two)."""
    lo = math.ceil(batch / MAX_MICRO_BATCHES)
    divisors = [d for d in range(lo, batch + 1) if batch % d == 0] if batch <= 1 << 16 else \
        [batch // n for n in range(1, MAX_MICRO_BATCHES + 1) if batch % n == 0]
    out = {batch}
    p = 1
    while p <= batch:
        if p >= lo / 2:
            out.add(min(divisors, key=lambda d: (abs(math.log(d / p)), d)))
        p *= 2
    return sorted(out)


def _layouts(profile: Profile, num_devices: int, model: CostModel, batch: int):
    """Yield every layout to evaluate: contiguous groupings of all stages on disjoint devices, and hybrids that
    pipeline the head on disjoint devices and run the tail stages on all devices."""
    head, tail = model.head, model.tail

    def work(group):
        return sum(model.seconds(c, batch, num_devices) * num_devices for c in group)

    for groups in contiguous_groupings(profile.stages):
        for sizes in device_splits(num_devices, [work(g) for g in groups]):
            yield Layout(groups, sizes)
    if tail:
        for groups in contiguous_groupings(head):
            if len(groups) > 1:
                for sizes in device_splits(num_devices, [work(g) for g in groups]):
                    yield Layout(groups, sizes, tuple(tail))


def search(profile: Profile, num_devices: int, top: int = 10, components: list[str] | None = None,
           batch: int | None = None, staleness: int = 0) -> SearchResult:
    """Find the fastest plans for `num_devices` devices (any number: planning beyond the profiled machine uses the
    scaling rules of the cost model). `components`: the names the flow places (default: the profile's stages);
    `batch`: samples per step (default: the profile's); `staleness`: the flow's algorithm.max_staleness (>= 1:
    generation overlaps training where the source has devices of its own, see cost.overlapped)."""
    start = time.perf_counter()
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if components is not None and set(components) != set(profile.stages):
        raise ValueError(f"components {sorted(components)} differ from the profile's stages {list(profile.stages)} "
                         f"({profile.source})")
    batch = batch or profile.batch
    model = CostModel(profile, batch)
    head = model.head
    micro = micro_batch_sizes(batch)
    # the loop's first stage as two processes per device too, where the profile measured that clearly faster: a
    # second process on a device helps only a stage that waits on something other than its core (a renderer's latency)
    two = profile.loop_latency.two_ranks_scale if profile.loop else None
    loop_ranks = (1, 2) if two is not None and two <= 1 - TWO_RANKS_MIN_GAIN else (1,)
    feasible: list[Candidate] = []
    evaluated = infeasible = 0
    examples: list[str] = []
    for layout in _layouts(profile, num_devices, model, batch):
        head_groups = {layout.group_of(c) for c in head}
        pipelined = len(head_groups) > 1
        shares = layout.shared or any(len(g) > 1 for g in layout.groups)
        if profile.loop:
            grains = [(batch // s, s, k) for s in ENV_STAGES if batch % s == 0 for k in loop_ranks]
        else:
            grains = [(m, 1, 1) for m in micro] if pipelined else [(batch, 1, 1)]
        for (m, s, k), offload in itertools.product(grains, (False, True) if shares else (False,)):
            pred = predict(model, layout, batch, m, s, offload, staleness, k)
            evaluated += 1
            if not pred.feasible:
                infeasible += 1
                if len(examples) < 5:
                    examples.append(f"{layout.spec()} (offload {'on' if offload else 'off'}): {pred.reason}")
                continue
            feasible.append(Candidate(layout, batch, m, s, offload, pred, k, profile.loop[0] if k > 1 else ""))
    feasible.sort(key=lambda c: (round(c.seconds, 9), len(c.layout.groups) + len(c.layout.shared), c.offload, c.spec))
    best, seen = [], set()
    for c in feasible:  # one row per structure (grouping, granularity, offload), with its best device split
        key = (c.layout.groups, c.layout.shared, c.micro_batch, c.loop_stages, c.loop_ranks, c.offload)
        if key not in seen and len(best) < top:
            seen.add(key)
            best.append(c)
    collocated = next((c for c in feasible if c.mode == "collocated"), None)
    return SearchResult(profile, num_devices, batch, best, collocated, evaluated, infeasible,
                        time.perf_counter() - start, examples)


# ---------------------------------------------------------------------------------------------- the command


def plan_command(profile_path: str | Path, devices: int, out_dir: str | Path | None = None, batch: int | None = None,
                 top: int = 10, staleness: int = 0) -> str:
    """`m2flow plan --profile P.json --devices N`: search, write plan YAML + timeline PNG (to `out_dir`, default
    the profile's folder), and return the text to print."""
    from m2flow.planner.timeline import plot_predicted

    profile = Profile.load(profile_path)
    if staleness < 0:
        raise ValueError(f"--max-staleness must be >= 0, got {staleness}")
    result = search(profile, devices, top=top, batch=batch, staleness=staleness)
    best = result.best
    out = Path(out_dir) if out_dir is not None else Path(profile_path).parent
    out.mkdir(parents=True, exist_ok=True)
    stem = f"plan_{devices}dev"
    plan_path, png_path = out / f"{stem}.yaml", out / f"{stem}.png"
    plan_path.write_text(yaml.safe_dump(result.to_plan_dict(), sort_keys=False))
    plot_predicted(profile, best, png_path, compare=None if result.collocated is best else result.collocated)

    m = profile.machine
    lines = [
        f"profile {profile_path}: {profile.flow} flow, stages {' -> '.join(profile.stages)}, "
        f"profiled on {m.devices} x {m.kind} ({m.memory_bytes / 1e9:.3g} GB each)",
        f"planning for {devices} device(s), {result.batch} samples per step"
        + (f", generation up to {staleness} step(s) ahead (max_staleness)" if staleness else "")
        + f": {result.evaluated} plans predicted, "
        f"{result.infeasible} did not fit in memory, in {result.seconds:.2f} s",
        "",
        result.table(),
        "",
        f"chosen: {best.describe()}",
    ]
    if result.collocated and best is not result.collocated:
        slower = result.collocated.seconds / best.seconds
        lines.append(f"  collocated: {result.collocated.seconds:.4g} s ({slower:.2f}x slower)")
    lines.append("  breakdown: " + "; ".join(f"{label} {s:.3g} s" for label, s in best.prediction.parts))
    notes = _extrapolation_notes(profile, best)
    if devices > m.devices:
        notes.insert(0, f"{devices} devices > the {m.devices} profiled: times scale by the rules in docs/planner.md")
    lines += [f"  note: {n}" for n in notes]
    lines += [f"plan:     {plan_path}", f"timeline: {png_path}"]
    return "\n".join(lines)


def _extrapolation_notes(profile: Profile, c: Candidate) -> list[str]:
    """Components whose per-device batch in the chosen plan lies outside the measured range."""
    model = CostModel(profile, c.batch)
    head = model.head
    notes = []
    for name in profile.stages:
        d = c.layout.devices(name)
        if name in head and profile.loop:
            n = c.batch // c.loop_stages
        elif name in head and name != head[0]:
            n = c.micro_batch
        else:
            n = c.batch  # the source and the tail stages work on the whole batch
        x = n / max(1, min(d, n))
        lo, hi = model.fits[name].measured_per_device_batch()
        if x < lo or x > hi:
            notes.append(f"{name}: {x:.3g} samples per device, outside the measured {lo:.3g}-{hi:.3g} (extrapolated)")
    return notes
