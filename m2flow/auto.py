"""Auto mode (`cluster.placement: auto`) for the reasoning and embodied flows: profile the flow's components with
the real workers (or reuse `run_dir/profile.json`), search the plans this flow can run on the cluster, write the
candidates, and return the fastest as an ExecutionPlan; after training, `write_plan_report` puts the predicted beside
the measured step time. The API and the `m2flow` command call it before a flow runs and hand the plan to the flow's
`train`; it never imports a flow and never trains (`m2flow.api.measure_plan` times a plan by training it).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from m2flow.config import UserError
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.plans import COMPONENTS as EMBODIED
from m2flow.embodied.plans import embodied_plans
from m2flow.embodied.profiler import profile_embodied
from m2flow.planner.plan import ExecutionPlan, make_plan
from m2flow.planner.profile import Profile
from m2flow.planner.search import Candidate, SearchResult, search
from m2flow.reasoning.profiler import components_of, profile_reasoning
from m2flow.runtime import Cluster
from m2flow.runtime.placement import place_beside

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


def flow_plans(profile: Profile, num_devices: int, group: int, top: int = 10, offload: bool = False,
               staleness: int = 0) -> SearchResult:
    """The plans the reasoning flow can run, fastest first: the search's candidates with micro-batches of whole
    prompt groups (`group` = rollout.n samples), placed one process per component; those that offload only with
    `offload` (`cluster.offload` true or auto: the flow then context-switches the components sharing a device).
    `staleness`: algorithm.max_staleness, whose overlap of generation with training the predictions include."""
    result = search(profile, num_devices, top=1 << 30, components=list(profile.stages), staleness=staleness)
    keep = [FlowCandidate(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}) for c in result.candidates
            if (offload or not c.offload) and (c.micro_batch % group == 0 or c.micro_batch == result.batch)]
    collocated = next((c for c in keep if c.mode == "collocated"), None)
    return dataclasses.replace(result, candidates=keep[:top], collocated=collocated)


def plan_of(candidate: Candidate, result: SearchResult, beside: dict[str, str] | None = None) -> AutoPlan:
    """The ExecutionPlan that launches `candidate` (a FlowCandidate); `beside`: components the search did not place
    (no device work), each placed where the named stage is, {"tool": "reward"}."""
    spec, names = candidate.spec, list(result.profile.stages)
    for name, stage in (beside or {}).items():
        spec, names = place_beside(spec, name, stage), names + [name]
    base = make_plan(spec, result.num_devices, names, result.batch, candidate.micro_batch, candidate.offload)
    return AutoPlan(base.placement, base.micro_batch, base.channel_maxsize, base.offload,
                    candidate.seconds, {label: round(s, 6) for label, s in candidate.prediction.parts})


def auto_plan(cfg, cluster: Cluster, run_dir: str | Path) -> AutoPlan:
    """Profile (or reuse `run_dir/profile.json`), search for `cluster.num_devices`, write `plan_candidates.txt` (the
    top of the table) and `plan_search.json` (every candidate) into `run_dir`, and return the fastest plan the flow
    can run."""
    run_dir = Path(run_dir)
    batch = cfg.rollout.prompts_per_step * cfg.rollout.n
    path, profile = _profile(run_dir, "reasoning", list(components_of(cfg)),
                             lambda path: profile_reasoning(cfg, cluster, out_path=path, run_dir=run_dir))
    offload = cfg.cluster.offload is not False
    result = flow_plans(dataclasses.replace(profile, batch=batch), cluster.num_devices, cfg.rollout.n, top=1 << 30,
                        offload=offload, staleness=cfg.algorithm.max_staleness)
    _write_search(run_dir, path, result, f"{batch} samples per step", f"the reasoning flow can run (offload "
                  f"{'considered' if offload else 'off'}, micro-batches of whole groups of {cfg.rollout.n}, one "
                  f"process per component)")
    # the tool component holds no model and takes no device lock: beside the reward, as in a placement that does
    # not name it (the profile's rollout times include the waits for its answers)
    return plan_of(result.best, result, beside={"tool": "reward"} if cfg.agent.tools else None)


def auto_plan_embodied(cfg, cluster: Cluster, run_dir: str | Path) -> tuple[AutoPlan, int]:
    """Auto mode for the embodied flow: profile (or reuse `run_dir/profile.json`), search every placement of env,
    rollout and actor x env pipeline stages the flow can run on `cluster.num_devices`, write `plan_candidates.txt`
    and `plan_search.json`, and return the fastest plan and its env pipeline stages."""
    run_dir = Path(run_dir)
    num_envs = cfg.env.num_envs
    path, profile = _profile(run_dir, "embodied", list(EMBODIED),
                             lambda path: profile_embodied(cfg, cluster, out_path=path, run_dir=run_dir))
    sac = cfg.algorithm.name == "sac"  # one learner rank; with sac.max_policy_lag 1, collection overlaps updates
    result = embodied_plans(profile, cluster.num_devices, num_envs, staleness=cfg.sac.max_policy_lag if sac else 0,
                            one_learner=sac)
    _write_search(run_dir, path, result, f"{num_envs} envs x {cfg.steps_per_rollout} steps per iteration",
                  "the embodied flow can run (one worker of each component per device, or two env workers where "
                  "measured, equal env stages"
                  + ("; the SAC learner one process over its devices)" if sac else ")"))
    best = result.best
    base = make_plan(best.spec, cluster.num_devices, list(EMBODIED), num_envs, best.micro_batch)
    plan = AutoPlan(base.placement, base.micro_batch, base.channel_maxsize, base.offload, best.seconds,
                    {label: round(s, 6) for label, s in best.prediction.parts})
    return plan, best.loop_stages


def choose_plan(cfg, cluster: Cluster, run_dir: str | Path):
    """Auto mode for either flow: `(cfg, plan)`, the config carrying the env pipeline stages the plan was chosen with
    (embodied; the reasoning config is returned as is). What `m2flow.train` calls before the flow runs."""
    if isinstance(cfg, EmbodiedConfig):
        plan, stages = auto_plan_embodied(cfg, cluster, run_dir)
        return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, pipeline_stages=stages)), plan
    return cfg, auto_plan(cfg, cluster, run_dir)


def _profile(run_dir: Path, flow: str, components: list[str], make) -> tuple[Path, Profile]:
    """`run_dir/profile.json` if it exists (checked to be this flow's), else `make(path)`, which profiles."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "profile.json"
    profile = Profile.load(path) if path.exists() else make(path)
    if profile.flow != flow or list(profile.stages) != components:
        raise UserError(f"{path}: a profile of the {flow} flow {components} is needed, got {profile.flow} "
                         f"{list(profile.stages)} (delete it to profile again)")
    return path, profile


def _write_search(run_dir: Path, path: Path, result: SearchResult, work: str, runnable: str) -> None:
    """plan_candidates.txt (the top of the table and the choice) and plan_search.json (every candidate)."""
    best, p = result.best, result.profile
    shown = dataclasses.replace(result, candidates=result.candidates[:TABLE_ROWS])
    (run_dir / "plan_candidates.txt").write_text(
        f"profile {path}: {p.machine.devices} x {p.machine.kind}; planning {result.num_devices} device(s), {work}, "
        f"{result.evaluated} plans predicted in {result.seconds:.2f} s, {len(result.candidates)} {runnable}"
        f"\n\n{shown.table()}\n\nchosen: {best.describe()}\n")
    (run_dir / "plan_search.json").write_text(json.dumps({
        "profile": str(path), "num_devices": result.num_devices, "batch": result.batch,
        "chosen": _row(best),
        "candidates": [_row(c) for c in result.candidates],
    }, indent=1) + "\n")


def _row(c: Candidate) -> dict:
    return {"placement_spec": c.spec, "mode": c.mode, "micro_batch": c.micro_batch, "pipeline_stages": c.loop_stages,
            **({"loop_ranks": c.loop_ranks} if c.loop_ranks > 1 else {}), "predicted_step_seconds": round(c.seconds, 6), "bottleneck": c.prediction.bottleneck}


def measured_step_seconds(metrics: list[dict], key: str = "time/step") -> float:
    """Median `key` (the step time: `time/step`, embodied `time/iteration`) of a run, leaving out the first step
    (it warms up: allocations, connections) when there are others."""
    times = [r[key] for r in metrics if key in r]
    if not times:
        raise ValueError(f"no {key} in the run's metrics")
    return statistics.median(times[1:] if len(times) > 1 else times)


def write_plan_report(run_dir: str | Path, key: str = "time/step") -> dict:
    """After training in auto mode: `run_dir/plan_report.json` with the chosen plan's predicted and measured
    (median `key`) step time and the relative error. The prediction comes from `plan_search.json`."""
    run_dir = Path(run_dir)
    chosen = json.loads((run_dir / "plan_search.json").read_text())["chosen"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = [r for r in metrics if key in r]  # not the start model's evaluation row (step 0)
    measured = measured_step_seconds(metrics, key)
    predicted = chosen["predicted_step_seconds"]
    report = {**chosen, "measured_step_seconds": round(measured, 6), "steps": len(metrics),
              "steps_measured": max(len(metrics) - 1, 1), "error": round((predicted - measured) / measured, 4)}
    (run_dir / "plan_report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
