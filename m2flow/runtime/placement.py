"""Placement specs: which devices (and how many processes) each component gets, parsed from `actor,rollout: 0-1`.

Pure parsing and validation; it launches nothing and knows nothing about Ray (see `group.py` for that).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

__all__ = ["PlacementError", "ComponentPlacement", "Placement", "parse_placement"]


class PlacementError(ValueError):
    """A placement spec is malformed or cannot be honoured; the message quotes the spec."""


@dataclass(frozen=True)
class ComponentPlacement:
    """The processes of one component: `rank_devices[r]` are the device indices of rank r."""

    component: str
    rank_devices: tuple[tuple[int, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.rank_devices)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(sorted({d for devs in self.rank_devices for d in devs}))


@dataclass(frozen=True)
class Placement:
    """A parsed spec: component -> ComponentPlacement, and the execution mode it implies."""

    spec: str
    components: dict[str, ComponentPlacement]
    mode: str  # "collocated" | "disaggregated" | "hybrid"

    def __getitem__(self, component: str) -> ComponentPlacement:
        if component not in self.components:
            raise PlacementError(
                f"placement {self.spec!r} has no component {component!r}; known: {', '.join(self.components)}"
            )
        return self.components[component]

    def __contains__(self, component: str) -> bool:
        return component in self.components

    def shares_device(self, a: str, b: str) -> bool:
        return bool(set(self[a].devices) & set(self[b].devices))


_NAME = r"[A-Za-z_][\w\-]*"
_ITEM = r"[^\s:,;]+"
_ENTRY = re.compile(rf"\s*({_NAME}(?:\s*,\s*{_NAME})*)\s*:\s*({_ITEM})\s*(?::\s*({_ITEM})\s*)?")


def _range(text: str, spec: str, what: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    if not m:
        raise PlacementError(f"placement {spec!r}: bad {what} {text!r}; expected N or N-M (or 'all' for devices)")
    lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
    if hi < lo:
        raise PlacementError(f"placement {spec!r}: bad {what} range {text!r}; the end is below the start")
    return lo, hi


def _split(spec: str) -> list[tuple[list[str], str, str | None]]:
    """`a,b: 0-1; c: 2, d: 3:0-1` -> [(['a','b'], '0-1', None), (['c'], '2', None), (['d'], '3', '0-1')]."""
    entries, pos = [], 0
    while True:
        m = _ENTRY.match(spec, pos)
        if not m:
            raise PlacementError(
                f"placement {spec!r}: cannot parse at position {pos} ({spec[pos:]!r}); "
                "expected 'NAMES: DEVICES[:RANKS]' entries, e.g. 'actor,rollout: 0-1' or 'rollout: 0; actor: 1'"
            )
        names = [n.strip() for n in m[1].split(",")]
        entries.append((names, m[2], m[3]))
        pos = m.end()
        if pos == len(spec):
            return entries
        if spec[pos] not in ",;":
            raise PlacementError(f"placement {spec!r}: expected ',' or ';' at position {pos}, got {spec[pos:]!r}")
        pos += 1
        if not spec[pos:].strip():  # a trailing separator is fine
            return entries


def _assign(devs: list[int], ranks: int, name: str, spec: str) -> tuple[tuple[int, ...], ...]:
    """Spread `ranks` processes evenly over `devs`: several ranks per device, or several devices per rank."""
    n = len(devs)
    if ranks >= n and ranks % n == 0:
        per = ranks // n
        return tuple((devs[r // per],) for r in range(ranks))
    if ranks < n and n % ranks == 0:
        span = n // ranks
        return tuple(tuple(devs[r * span:(r + 1) * span]) for r in range(ranks))
    raise PlacementError(
        f"placement {spec!r}: component {name!r} has {ranks} ranks on {n} devices; "
        "the rank count must be a multiple or a divisor of the device count"
    )


def parse_placement(spec: str | dict, num_devices: int, components: Sequence[str] | None = None) -> Placement:
    """Parse a spec string (`actor,rollout: 0-1`, `rollout: 0; actor: 1`) or dict (`{"actor,rollout": "0-1"}`).

    DEVICES is `all`, `N` or `N-M`; the optional `:RANKS` (`0-3`, i.e. ranks 0..3) sets the number of processes,
    else one rank per device. If `components` is given, the spec must name exactly those components.
    """
    if isinstance(spec, dict):
        spec = "; ".join(f"{k}: {v}" for k, v in spec.items())
    if not isinstance(spec, str):
        raise PlacementError(f"placement must be a string or dict, got {type(spec).__name__}: {spec!r}")
    spec = spec.strip()
    if not spec:
        raise PlacementError("placement '' is empty; expected e.g. 'actor,rollout: 0-1'")
    if num_devices < 1:
        raise PlacementError(f"placement {spec!r}: the cluster has no devices")

    placed: dict[str, ComponentPlacement] = {}
    for names, dev_text, rank_text in _split(spec):
        if dev_text == "all":
            lo, hi = 0, num_devices - 1
        else:
            lo, hi = _range(dev_text, spec, "devices")
            if hi >= num_devices:
                raise PlacementError(
                    f"placement {spec!r}: device {hi} does not exist; the cluster has {num_devices} "
                    f"device(s), numbered 0-{num_devices - 1}"
                )
        devs = list(range(lo, hi + 1))
        ranks = len(devs)
        if rank_text is not None:
            r_lo, r_hi = _range(rank_text, spec, "ranks")
            if r_lo != 0:
                raise PlacementError(f"placement {spec!r}: ranks {rank_text!r} must start at 0 (ranks are 0..N-1)")
            ranks = r_hi + 1
        for name in names:
            if name == "all":
                raise PlacementError(f"placement {spec!r}: 'all' is a device keyword, not a component name")
            if name in placed:
                raise PlacementError(f"placement {spec!r}: component {name!r} is listed twice")
            placed[name] = ComponentPlacement(name, _assign(devs, ranks, name, spec))

    if components is not None:
        unknown = [c for c in placed if c not in components]
        if unknown:
            raise PlacementError(
                f"placement {spec!r}: unknown component(s) {', '.join(unknown)}; expected {', '.join(components)}"
            )
        missing = [c for c in components if c not in placed]
        if missing:
            raise PlacementError(f"placement {spec!r}: component(s) {', '.join(missing)} have no devices")

    sets = [set(p.devices) for p in placed.values()]
    if all(s == sets[0] for s in sets):
        mode = "collocated"
    elif all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1:]):
        mode = "disaggregated"
    else:
        mode = "hybrid"
    return Placement(spec, placed, mode)


def place_beside(placement, name: str, beside: str):
    """A placement with component `name` placed: as given where it names `name`, else beside `beside` (its entry
    gains `name`: `d` beside `c` turns `a: 0; b,c: 1` into `a: 0; b,c,d: 1`)."""
    spec = "; ".join(f"{k}: {v}" for k, v in placement.items()) if isinstance(placement, dict) else placement
    entries = [e.strip() for e in str(spec).split(";") if e.strip()]
    named = [[n.strip() for n in e.partition(":")[0].split(",")] for e in entries]
    if any(name in names for names in named) or not any(beside in names for names in named):
        return placement  # placed already; or no `beside`: the placement check names what is missing
    return "; ".join(",".join(names + [name] if beside in names else names) + ":" + e.partition(":")[2]
                     for names, e in zip(named, entries))
