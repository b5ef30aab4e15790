"""Execution plans: placement + granularity + offload flags, as plain data saved next to a run.

A plan is named by the config (`make_plan`) or chosen from profiles by auto mode (`m2flow/auto.py`); this
module never runs anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from m2flow.runtime.placement import Placement, parse_placement


@dataclass
class ExecutionPlan:
    placement: Placement
    micro_batch: int  # samples per message between stages: the whole batch when collocated
    channel_maxsize: int  # 0 = unbounded (collocated: a producer holding the device must never block)
    offload: bool = False  # collocated components move their state off the device between turns

    @property
    def mode(self) -> str:
        return self.placement.mode

    def __getitem__(self, component: str):
        return self.placement[component]

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "placement": {c: [list(r) for r in p.rank_devices] for c, p in self.placement.components.items()},
            "placement_spec": self.placement.spec,
            "micro_batch": self.micro_batch,
            "channel_maxsize": self.channel_maxsize,
            "offload": self.offload,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def make_plan(placement_spec, num_devices: int, components: list[str], batch_samples: int,
              micro_batch: int, offload: bool = False) -> ExecutionPlan:
    """The plan the config asks for: whole-batch granularity when every component shares the same
    devices (they take turns anyway), micro-batches with bounded channels otherwise."""
    if placement_spec == "auto":
        raise ValueError("cluster.placement: auto is resolved before a flow runs: use m2flow.train(...) or the m2flow "
                         "command, or pass the flow's train() the ExecutionPlan m2flow.auto chose")
    placement = parse_placement(placement_spec, num_devices, components)
    if placement.mode == "collocated":
        return ExecutionPlan(placement, batch_samples, 0, offload)
    return ExecutionPlan(placement, min(micro_batch, batch_samples), 0, offload)
