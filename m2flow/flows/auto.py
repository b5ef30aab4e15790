"""Auto mode (`cluster.placement: auto`) for the reasoning flow: profile the flow (or reuse `run_dir/profile.json`),
search the plans this flow can run on the cluster, write the candidates, and return the fastest as an ExecutionPlan;
after training, `write_plan_report` puts the predicted beside the measured step time. It does not train.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from m2flow.runtime import Cluster
from m2flow.scheduler.plan import ExecutionPlan, make_plan
from m2flow.scheduler.profile import Profile
from m2flow.scheduler.search import Candidate, SearchResult, search

COMPONENTS = ["rollout", "reward", "inference", "actor"]
TABLE_ROWS = 20  # candidates shown in plan_candidates.txt (plan_search.json lists all)


class FlowCandidate(Candidate):
    """A search candidate placed the way the reasoning flow runs it: one process per component, spanning the
    component's devices (`0-1:0`), because the flow supports one rank per component."""

    @property
    def spec(self) -> str:
        layout = self.layout
        parts = [f"{','.join(g)}: {_devices(lo, hi)}" for g, (lo, hi) in zip(layout.groups, layout.ranges())]
        if layout.shared:
            parts.append(f"{','.join(layout.shared)}: {_devices(0, layout.num_devices - 1)}")
        return "; ".join(parts)


def _devices(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}:0"


@dataclasses.dataclass
class AutoPlan(ExecutionPlan):
    """The chosen plan, with its prediction (saved into plan.yaml by the flow's `plan.save`)."""

    predicted_step_seconds: float = 0.0
    breakdown: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "chosen_by": "auto", "predicted_step_seconds": round(self.predicted_step_seconds, 6),
                "breakdown": self.breakdown}


def flow_plans(profile: Profile, num_devices: int, group: int, top: int = 10) -> SearchResult:
    """The plans the reasoning flow can run, fastest first: the search's candidates restricted to offload off (the
    flow does not context-switch) and micro-batches of whole prompt groups (`group` = rollout.n samples), placed
    one process per component."""
    result = search(profile, num_devices, top=1 << 30, components=COMPONENTS)
    keep = [FlowCandidate(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}) for c in result.candidates
            if not c.offload and (c.micro_batch % group == 0 or c.micro_batch == result.batch)]
    collocated = next((c for c in keep if c.mode == "collocated"), None)
    return dataclasses.replace(result, candidates=keep[:top], collocated=collocated)


def plan_of(candidate: Candidate, result: SearchResult) -> AutoPlan:
    """The ExecutionPlan that launches `candidate` (a FlowCandidate)."""
    base = make_plan(candidate.spec, result.num_devices, COMPONENTS, result.batch, candidate.micro_batch)
    return AutoPlan(base.placement, base.micro_batch, base.channel_maxsize, base.offload,
                    candidate.seconds, {label: round(s, 6) for label, s in candidate.prediction.parts})


def auto_plan(cfg, cluster: Cluster, run_dir: str | Path) -> AutoPlan:
    """Profile (or reuse `run_dir/profile.json`), search for `cluster.num_devices`, write `plan_candidates.txt` (the
    top of the table) and `plan_search.json` (every candidate) into `run_dir`, and return the fastest plan the flow
    can run."""
    from m2flow.flows.profile import profile_reasoning

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "profile.json"
    batch = cfg.rollout.prompts_per_step * cfg.rollout.n
    profile = Profile.load(path) if path.exists() else profile_reasoning(cfg, cluster, out_path=path, run_dir=run_dir)
    if profile.flow != "reasoning" or list(profile.stages) != COMPONENTS:
        raise ValueError(f"{path}: a profile of the reasoning flow {COMPONENTS} is needed, got {profile.flow} "
                         f"{list(profile.stages)}")
    result = flow_plans(dataclasses.replace(profile, batch=batch), cluster.num_devices, cfg.rollout.n, top=1 << 30)
    best = result.best
    shown = dataclasses.replace(result, candidates=result.candidates[:TABLE_ROWS])
    (run_dir / "plan_candidates.txt").write_text(
        f"profile {path}: {profile.machine.devices} x {profile.machine.kind}; planning {cluster.num_devices} "
        f"device(s), {batch} samples per step, {result.evaluated} plans predicted in {result.seconds:.2f} s, "
        f"{len(result.candidates)} the reasoning flow can run (offload off, micro-batches of whole groups of "
        f"{cfg.rollout.n}, one process per component)\n\n{shown.table()}\n\nchosen: {best.describe()}\n")
    (run_dir / "plan_search.json").write_text(json.dumps({
        "profile": str(path), "num_devices": cluster.num_devices, "batch": batch,
        "chosen": _row(best),
        "candidates": [_row(c) for c in result.candidates],
    }, indent=1) + "\n")
    return plan_of(best, result)


def _row(c: Candidate) -> dict:
    return {"placement_spec": c.spec, "mode": c.mode, "micro_batch": c.micro_batch,
            "predicted_step_seconds": round(c.seconds, 6), "bottleneck": c.prediction.bottleneck}


def measured_step_seconds(metrics: list[dict]) -> float:
    """Median `time/step` of a run, leaving out the first step (it warms up: allocations, connections) when
    there are others."""
    times = [r["time/step"] for r in metrics if "time/step" in r]
    if not times:
        raise ValueError("no time/step in the run's metrics")
    return statistics.median(times[1:] if len(times) > 1 else times)


def write_plan_report(run_dir: str | Path) -> dict:
    """After training in auto mode: `run_dir/plan_report.json` with the chosen plan's predicted and measured
    (median) step time and the relative error. The prediction comes from `plan_search.json`."""
    run_dir = Path(run_dir)
    chosen = json.loads((run_dir / "plan_search.json").read_text())["chosen"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    measured = measured_step_seconds(metrics)
    predicted = chosen["predicted_step_seconds"]
    report = {**chosen, "measured_step_seconds": round(measured, 6), "steps": len(metrics),
              "steps_measured": max(len(metrics) - 1, 1), "error": round((predicted - measured) / measured, 4)}
    (run_dir / "plan_report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def measure_plan(cfg, cluster: Cluster, spec: str, micro_batch: int, run_dir: str | Path, steps: int = 3) -> float:
    """Train `steps` steps of the real flow with placement `spec` at `micro_batch` samples per message; returns the
    measured median step time (first step left out). What the test and benchmarks/plans.py time every plan with."""
    from m2flow.flows.reasoning import train

    run_dir = Path(run_dir)
    c = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(run_dir.parent), name=run_dir.name,
                                                         steps=steps, trace=False, progress=False, save_every=0),
                            cluster=dataclasses.replace(cfg.cluster, placement=spec),
                            # the flow streams inference -> actor at actor.micro_batch (what plan.micro_batch is)
                            actor=dataclasses.replace(cfg.actor, micro_batch=micro_batch))
    train(c, cluster)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return measured_step_seconds(rows)
