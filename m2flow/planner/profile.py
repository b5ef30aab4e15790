"""Profile tables: what each component of a flow costs (seconds, memory) at a few measured sizes, as JSON.

Dataclasses with load/save and validation whose errors name the file and the field. It measures nothing
(the profiler fills these tables) and predicts nothing (`cost.py` fits curves to them).
"""

from __future__ import annotations

import difflib
import json
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from m2flow.errors import UserError

__all__ = ["ProfileError", "Measurement", "ComponentInfo", "Machine", "Transfer", "Weights", "Profile", "load_profile", "median_rows"]


class ProfileError(UserError):
    """A profile table is malformed; the message names the file and the field, e.g. `p.json: measurements[3].seconds`."""


@dataclass(frozen=True)
class Measurement:
    """One timed call: `component` processed `batch` samples on `devices` devices (one data-parallel rank each)."""

    component: str
    batch: int  # samples in the call, in the flow's unit (e.g. responses, or environments)
    devices: int  # devices the component ran on
    seconds: float  # wall time of the call (excluding once-per-step work, see ComponentInfo.fixed_seconds)
    peak_bytes: int = 0  # peak memory per device during the call, the component's own state included; 0 = not measured


@dataclass(frozen=True)
class ComponentInfo:
    """What a component keeps on a device and what a context switch costs it."""

    state_bytes: int = 0  # resident state per device (weights, optimizer, KV-cache pool); the total if shard_state
    shard_state: bool = False  # state is split over the component's devices (FSDP): per device = state_bytes / devices
    offload_seconds: float = 0.0  # moving the state off one device (per device; devices offload in parallel)
    onload_seconds: float = 0.0  # moving it back
    streams: bool = True  # can start on a micro-batch before the whole batch arrived (actor: 1 mini-batch, 1 epoch)
    fixed_seconds: float = 0.0  # once-per-step work not tied to samples, e.g. the actor's optimizer step
    # samples per pass when the component merges the micro-batches streamed to it into larger passes (the actor:
    # `actor.micro_batch_tokens` over the padded row width); 0: each micro-batch is its own pass. A merge of the
    # whole batch or more makes the component wait for the whole batch (a tail stage)
    merge_samples: int = 0


@dataclass(frozen=True)
class Machine:
    """The profiled machine; target clusters are assumed to be made of the same kind of device."""

    kind: str  # e.g. "H100-80GB" or "cpu-slot"
    devices: int  # devices on the profiled machine
    memory_bytes: int  # usable memory per device


@dataclass(frozen=True)
class Transfer:
    """The cost of moving samples through a channel between components on different devices."""

    bytes_per_sample: int = 0  # bytes one sample carries over one channel in one step
    seconds_per_gb: float = 0.0  # inverse bandwidth between devices (1e9 bytes)
    latency_seconds: float = 0.0  # per message

    def seconds(self, samples: float) -> float:
        if samples <= 0:
            return 0.0
        return self.latency_seconds + samples * self.bytes_per_sample / 1e9 * self.seconds_per_gb


@dataclass(frozen=True)
class Weights:
    """Weight sync after each update: `source` sends `bytes` to each component in `to`."""

    bytes: int = 0
    source: str = "actor"
    to: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoopLatency:
    """A loop's hand-overs: seconds per stage and step that its first stage waits on its second beyond the second's
    own compute (its rows), the round trips, with the two on the same devices (`shared`) or on different ones."""

    shared: float = 0.0
    split: float = 0.0
    # one lockstep stage with the second stage in the first's process, as a flow may run it on shared devices,
    # takes this share of the two stages' rows (timed in two processes, the requests' sends included) and pays no
    # round trips. None (not measured, or the flow does not co-host): the rows + shared
    cohosted_scale: float | None = None
    # the loop's first stage as two processes per device, each with half of that device's share of the batch: the
    # factor on its rows that explains the loop's measured time so (< 1 where a process waits on something other
    # than its core, a renderer's latency, say; ~1 or more where the core bounds it). None: not measured
    two_ranks_scale: float | None = None

    def on_shared_devices(self, loop_stages: int, loop_ranks: int = 1) -> tuple[float, float]:
        """The loop on the same devices in `loop_stages` stages (its first stage `loop_ranks` processes per device):
        (the factor on its two stages' rows, the round trips' seconds per stage). Co-hosted (one stage, one
        process per device: the second stage runs in the first's process) it pays no round trips."""
        if loop_stages == 1 and loop_ranks == 1 and self.cohosted_scale is not None:
            return self.cohosted_scale, 0.0
        return 1.0, self.shared

    def ranks_factor(self, loop_ranks: int) -> float:
        """The factor on the loop's first stage's rows with `loop_ranks` processes per device (1 or 2)."""
        if loop_ranks == 1:
            return 1.0
        if loop_ranks != 2 or self.two_ranks_scale is None:
            raise ValueError(f"{loop_ranks} processes per device of the loop's first stage were not measured "
                             "(loop_latency.two_ranks_scale gives 2)")
        return self.two_ranks_scale


@dataclass
class Profile:
    """A flow's measured costs. `stages` is the order data moves in; `loop` names the first two stages when they
    alternate every step (an env and its policy, say) instead of passing data once."""

    flow: str
    stages: tuple[str, ...]
    batch: int  # samples per training step
    machine: Machine
    components: dict[str, ComponentInfo]
    measurements: list[Measurement]
    transfer: Transfer = field(default_factory=Transfer)
    weights: Weights = field(default_factory=Weights)
    loop: tuple[str, ...] = ()
    loop_latency: LoopLatency = field(default_factory=lambda: LoopLatency())
    source: str = "<profile>"  # where it was read from, for error messages
    # a collocated plan runs every component in one process (where the flow co-hosts them): its step takes
    # this share of the rows it is made of (+ once-per-step work). None: not measured, the rows as they are
    cohosted_scale: float | None = None

    # -- reading and writing -------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ProfileError(f"{path}: no such profile file") from None
        except json.JSONDecodeError as err:
            raise ProfileError(f"{path}: not valid JSON: {err}") from None
        return cls.from_dict(data, source=str(path))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def to_dict(self) -> dict:
        weights = {"bytes": self.weights.bytes, "from": self.weights.source, "to": list(self.weights.to)}
        return {
            "flow": self.flow, "stages": list(self.stages), "loop": list(self.loop),
            "loop_latency": {k: v for k, v in asdict(self.loop_latency).items() if v is not None}, "batch": self.batch,
            "machine": asdict(self.machine), "transfer": asdict(self.transfer), "weights": weights,
            "components": {name: asdict(info) for name, info in self.components.items()},
            "measurements": [asdict(m) for m in self.measurements],
            **({"cohosted_scale": self.cohosted_scale} if self.cohosted_scale is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<profile>") -> Profile:
        r = _Reader(source)
        required = {"flow", "stages", "batch", "machine", "components", "measurements"}
        r.mapping(data, "", required | {"loop", "loop_latency", "transfer", "weights", "cohosted_scale"}, required)
        flow = r.string(data, "flow")
        stages = tuple(r.names(data, "stages"))
        if not stages:
            r.fail("stages", "is empty; expected the flow's components in data order, e.g. [\"rollout\", \"actor\"]")
        if len(set(stages)) != len(stages):
            r.fail("stages", f"lists a component twice: {list(stages)}")
        for name in stages:
            if not re.fullmatch(r"[A-Za-z_][\w\-]*", name) or name == "all":
                r.fail("stages", f"has {name!r}, which cannot name a component in a placement (letters, digits, _, -)")
        loop = tuple(r.names(data, "loop")) if "loop" in data else ()
        if loop and loop != stages[:2]:
            r.fail("loop", f"must be the first two stages {list(stages[:2])} (they alternate every step), "
                           f"got {list(loop)}")
        lat = data.get("loop_latency", {})
        r.mapping(lat, "loop_latency", {"shared", "split", "cohosted_scale", "two_ranks_scale"})
        scales = {k: r.number(lat, k, "loop_latency") if k in lat else None for k in ("cohosted_scale",
                                                                                     "two_ranks_scale")}
        loop_latency = LoopLatency(r.number(lat, "shared", "loop_latency", default=0.0),
                                   r.number(lat, "split", "loop_latency", default=0.0), **scales)
        if (loop_latency.shared or loop_latency.split or any(v is not None for v in scales.values())) and not loop:
            r.fail("loop_latency", "is set, but the profile has no loop")
        if scales["two_ranks_scale"] is not None and scales["two_ranks_scale"] <= 0:
            r.fail("loop_latency.two_ranks_scale", f"must be > 0, got {scales['two_ranks_scale']}")
        batch = r.integer(data, "batch", minimum=1)
        cohosted = r.number(data, "cohosted_scale") if "cohosted_scale" in data else None
        if cohosted is not None and (cohosted <= 0 or loop):
            r.fail("cohosted_scale", f"must be > 0 and only in a profile without a loop (profiles with "
                                     f"one use loop_latency.cohosted_scale), got {cohosted}")

        m = data["machine"]
        r.mapping(m, "machine", {"kind", "devices", "memory_bytes"}, required={"kind", "devices", "memory_bytes"})
        machine = Machine(r.string(m, "kind", "machine"), r.integer(m, "devices", "machine", minimum=1),
                          r.integer(m, "memory_bytes", "machine", minimum=1))

        t = data.get("transfer", {})
        r.mapping(t, "transfer", {"bytes_per_sample", "seconds_per_gb", "latency_seconds"})
        transfer = Transfer(r.integer(t, "bytes_per_sample", "transfer", default=0),
                            r.number(t, "seconds_per_gb", "transfer", default=0.0),
                            r.number(t, "latency_seconds", "transfer", default=0.0))

        w = data.get("weights", {})
        r.mapping(w, "weights", {"bytes", "from", "to"})
        weights = Weights(r.integer(w, "bytes", "weights", default=0), r.string(w, "from", "weights", default="actor"),
                          tuple(r.names(w, "to", "weights", default=[])))
        for i, name in enumerate((weights.source, *weights.to)):
            if weights.bytes and name not in stages:
                r.fail("weights.from" if i == 0 else "weights.to",
                       f"names {name!r}, which is not a stage; stages: {list(stages)}")

        comps = data["components"]
        r.mapping(comps, "components", set(stages), required=set(stages))
        components = {}
        for name in stages:
            c, where = comps[name], f"components.{name}"
            r.mapping(c, where, {f for f in ComponentInfo.__dataclass_fields__})
            components[name] = ComponentInfo(
                state_bytes=r.integer(c, "state_bytes", where, default=0),
                shard_state=r.boolean(c, "shard_state", where, default=False),
                offload_seconds=r.number(c, "offload_seconds", where, default=0.0),
                onload_seconds=r.number(c, "onload_seconds", where, default=0.0),
                streams=r.boolean(c, "streams", where, default=True),
                fixed_seconds=r.number(c, "fixed_seconds", where, default=0.0),
                merge_samples=r.integer(c, "merge_samples", where, default=0))

        rows = data["measurements"]
        if not isinstance(rows, list):
            r.fail("measurements", f"must be a list of rows, got {type(rows).__name__}")
        measurements = []
        for i, row in enumerate(rows):
            where = f"measurements[{i}]"
            r.mapping(row, where, {"component", "batch", "devices", "seconds", "peak_bytes"},
                      required={"component", "batch", "devices", "seconds"})
            comp = r.string(row, "component", where)
            if comp not in stages:
                close = difflib.get_close_matches(comp, stages, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                r.fail(f"{where}.component", f"is {comp!r}, not one of the stages {list(stages)}{hint}")
            devices = r.integer(row, "devices", where, minimum=1)
            if devices > machine.devices:
                r.fail(f"{where}.devices", f"is {devices}, but the profiled machine has {machine.devices} "
                                           "(machine.devices)")
            seconds = r.number(row, "seconds", where)
            if seconds <= 0:
                r.fail(f"{where}.seconds", f"must be > 0, got {seconds}")
            measurements.append(Measurement(comp, r.integer(row, "batch", where, minimum=1), devices, seconds,
                                            r.integer(row, "peak_bytes", where, 0, 0)))
        for name in stages:
            if not any(m.component == name for m in measurements):
                r.fail("measurements", f"has no row for component {name!r}; every stage needs at least one")
        return cls(flow, stages, batch, machine, components, measurements, transfer, weights, loop, loop_latency, source,
                   cohosted)


def load_profile(path: str | Path) -> Profile:
    """`Profile.load(path)`."""
    return Profile.load(path)


class _Reader:
    """Typed field access whose errors read `FILE: FIELD must be ..., got ...`."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, field_name: str, message: str):
        raise ProfileError(f"{self.source}: {field_name} {message}")

    @staticmethod
    def _path(where: str, key: str) -> str:
        return f"{where}.{key}" if where else key

    def mapping(self, value: Any, where: str, allowed: set, required: set = frozenset()) -> None:
        if not isinstance(value, dict):
            self.fail(where or "the top level", f"must be a JSON object, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.fail(self._path(where, key), f"is not a known field{hint}; known: {', '.join(sorted(allowed))}")
        for key in sorted(required):
            if key not in value:
                self.fail(self._path(where, key), "is missing")

    def _get(self, d: dict, key: str, where: str, default: Any):
        if key not in d:
            if default is _REQUIRED:
                self.fail(self._path(where, key), "is missing")
            return default, True
        return d[key], False

    def number(self, d: dict, key: str, where: str = "", default: Any = None, minimum: float = 0.0) -> float:
        value, missing = self._get(d, key, where, _REQUIRED if default is None else default)
        if missing:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            self.fail(self._path(where, key), f"must be a number, got {value!r}")
        if value < minimum:
            self.fail(self._path(where, key), f"must be >= {minimum}, got {value!r}")
        return float(value)

    def integer(self, d: dict, key: str, where: str = "", default: Any = None, minimum: int = 0) -> int:
        value, missing = self._get(d, key, where, _REQUIRED if default is None else default)
        if missing:
            return value
        ok = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not ok:
            self.fail(self._path(where, key), f"must be a whole number, got {value!r}")
        if value < minimum:
            self.fail(self._path(where, key), f"must be >= {minimum}, got {value!r}")
        return int(value)

    def boolean(self, d: dict, key: str, where: str, default: bool) -> bool:
        value, missing = self._get(d, key, where, default)
        if not missing and not isinstance(value, bool):
            self.fail(self._path(where, key), f"must be true or false, got {value!r}")
        return value

    def string(self, d: dict, key: str, where: str = "", default: Any = None) -> str:
        value, missing = self._get(d, key, where, _REQUIRED if default is None else default)
        if not missing and (not isinstance(value, str) or not value):
            self.fail(self._path(where, key), f"must be a non-empty string, got {value!r}")
        return value

    def names(self, d: dict, key: str, where: str = "", default: Any = None) -> list[str]:
        value, missing = self._get(d, key, where, _REQUIRED if default is None else default)
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            self.fail(self._path(where, key), f"must be a list of component names, got {value!r}")
        return value


_REQUIRED = object()


def median_rows(rows: dict[tuple[str, int, int], list[dict]], components) -> list[Measurement]:
    """{(component, batch, devices): [{seconds, peak_bytes}, ...]} -> one Measurement per cell: the medians, with
    seconds made non-decreasing in batch per (component, devices)."""
    measurements = []
    for name in components:
        for d in sorted({d for c, _, d in rows if c == name}):
            cells = sorted((n, rs) for (c, n, dd), rs in rows.items() if c == name and dd == d)
            seconds = _non_decreasing([statistics.median(r["seconds"] for r in rs) for _, rs in cells],
                                      [len(rs) for _, rs in cells])
            measurements += [Measurement(name, n, d, max(s, 1e-9), int(statistics.median(r["peak_bytes"] for r in rs)))
                             for (n, rs), s in zip(cells, seconds)]
    return measurements


def _non_decreasing(values: list[float], weights: list[int]) -> list[float]:
    """The closest non-decreasing sequence (weighted least squares, pool adjacent violators): on a busy machine a
    bigger batch can time faster than a smaller one by chance, never by nature."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (v2, w2, c2), (v1, w1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return [v for v, _, c in blocks for _ in range(c)]
