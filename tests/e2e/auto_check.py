"""The check the auto-mode tests share: the plan auto mode picked (plans[0]) measures within 10% of the best measured
plan, allowing for a shared, noisy machine the way docs/planner.md states it (a retry, and ties the model predicts)."""

import json
import math
from pathlib import Path

import yaml

TOLERANCE = 0.10


def auto_outputs(run: Path, steps: int) -> tuple[dict, list[dict], dict]:
    """Check what auto mode wrote into `run` after `steps` steps; -> (plan.yaml, the search's best-ranked row per
    placement with auto's choice first, plan_report.json)."""
    search = json.loads((run / "plan_search.json").read_text())
    chosen = search["chosen"]
    plan = yaml.safe_load((run / "plan.yaml").read_text())
    assert plan["chosen_by"] == "auto" and plan["placement_spec"] == chosen["placement_spec"]
    assert abs(plan["predicted_step_seconds"] - chosen["predicted_step_seconds"]) < 1e-5
    assert chosen["placement_spec"] in (run / "plan_candidates.txt").read_text()
    report = json.loads((run / "plan_report.json").read_text())
    assert report["placement_spec"] == chosen["placement_spec"] and report["steps"] == steps
    assert report["measured_step_seconds"] > 0 and math.isfinite(report["error"])
    plans, seen = [], set()
    for c in search["candidates"]:
        if c["placement_spec"] not in seen:
            seen.add(c["placement_spec"])
            plans.append(c)
    assert plans[0] == chosen
    return plan, plans, report


def assert_auto_near_best(plans: list[dict], measured: list[float], measure, grain: str) -> None:
    """plans: plan_search.json rows, auto's choice first; measured: their seconds per step; measure(plan, i) times
    plan i again; grain: the row's granularity field (micro_batch, pipeline_stages). Prints the table."""
    chosen = plans[0]
    lines = [f"{c['placement_spec']:42s} {grain} {c[grain]:3d}  predicted {c['predicted_step_seconds']:.3f} s  "
             f"measured {m:.3f} s  error {(c['predicted_step_seconds'] - m) / m:+.0%}" + ("  <- auto" if i == 0 else "")
             for i, (c, m) in enumerate(zip(plans, measured))]
    print("\n".join(lines))
    best = min(range(len(plans)), key=measured.__getitem__)
    tolerance = TOLERANCE
    if measured[0] > (1 + tolerance) * measured[best]:
        # A shared machine: load that comes and goes between runs (a minute apart) can reorder plans of nearly equal
        # speed. Time the two again, back to back; keep each one's faster run, and widen the tolerance to the
        # run-to-run spread just seen, up to 50% (a plan twice as slow still fails).
        again = [measure(plans[0], 0), measure(plans[best], best)]
        spread = max(abs(a - b) / min(a, b) for a, b in zip(again, (measured[0], measured[best])))
        measured[0], measured[best] = min(measured[0], again[0]), min(measured[best], again[1])
        tolerance = min(max(TOLERANCE, spread), 0.5)
        print(f"again: auto {again[0]:.3f} s, best {again[1]:.3f} s; run-to-run spread {spread:.0%}, "
              f"tolerance {tolerance:.0%}")
    predicted = chosen["predicted_step_seconds"]
    tied = abs(plans[best]["predicted_step_seconds"] - predicted) <= 0.05 * predicted
    if tied:
        # The cost model predicts these two plans equal (same bottleneck stage), so which one auto lists first is a
        # tie-break; on this shared machine tied plans differ by up to ~25% from run to run. The check that still
        # bites: auto must not pick a plan the model separates and the machine confirms slower.
        tolerance = 0.5
    assert measured[0] <= (1 + tolerance) * measured[best], "\n".join(lines)
