"""The main job (`make demo`) over several seeds: held-out greedy pass@1 after the warm start and after GRPO, the gain,
the warm start's length and each run's wall time, then the medians. `run.seed` changes the model's initialisation,
the warm start's batches, the problems and the GRPO samples: a fair stand-in for another CPU's float rounding.

    python benchmarks/demo_seeds.py                       # seeds 0-4, the demo preset as it is (3 to 5 min a seed)
    python benchmarks/demo_seeds.py --seeds 5,6 run.steps=100    # other seeds, overrides on top of the preset

Each seed runs the demo in a fresh process (`m2flow demo`, its own Ray instance), one after another, into
runs/demo_seeds/seed_N (its output in demo.log); the 1-minute load average at its end is printed beside each, and
the rows go to results.jsonl. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAST_LINE = re.compile(r"held-out accuracy: ([\d.]+)% -> ([\d.]+)%")
SFT_LINE = re.compile(r"\[m2flow sft\] (?:stopped after|ran all) (\d+) of")


def run_seed(seed: int, out: Path, overrides: list[str]) -> dict:
    """One demo run: before, after (percent), the warm start's steps, the wall seconds, the load average at the end."""
    cmd = [sys.executable, "-m", "m2flow.cli", "demo", f"run.seed={seed}", f"run.dir={out}", f"run.name=seed_{seed}",
           "run.progress=false", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: m2flow demo failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}")
    (out / f"seed_{seed}" / "demo.log").write_text(proc.stdout)
    last, sft = LAST_LINE.search(proc.stdout), SFT_LINE.search(proc.stdout)
    before, after = float(last.group(1)), float(last.group(2))
    return {"seed": seed, "before": before, "after": after, "gain": round(after - before, 1),
            "sft_steps": int(sft.group(1)) if sft else None, "wall_s": round(wall), "load": os.getloadavg()[0]}


def table(rows: list[dict]) -> str:
    lines = ["| seed | after SFT | after GRPO | gain | SFT steps | wall s | load |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['seed']} | {r['before']:.1f}% | {r['after']:.1f}% | {r['gain']:+.1f} | {r['sft_steps']} | "
              f"{r['wall_s']} | {r['load']:.2f} |" for r in rows]
    med = {k: statistics.median(r[k] for r in rows) for k in ("before", "after", "gain", "wall_s")}
    lines.append(f"| **median** | **{med['before']:.1f}%** | **{med['after']:.1f}%** | **{med['gain']:+.1f}** | | "
                 f"**{med['wall_s']:.0f}** | |")
    lines.append(f"smallest gain {min(r['gain'] for r in rows):+.1f} points (seed "
                 f"{min(rows, key=lambda r: r['gain'])['seed']})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated run.seed values")
    ap.add_argument("--out", default="runs/demo_seeds", help="where the runs and results.jsonl go")
    ap.add_argument("overrides", nargs="*", help="dotted overrides on top of the demo preset")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        row = run_seed(seed, out, args.overrides)
        rows.append(row)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps({**row, "overrides": args.overrides}) + "\n")
        print(f"seed {seed}: {row['before']:.1f}% -> {row['after']:.1f}% ({row['gain']:+.1f}), warm start "
              f"{row['sft_steps']} steps, {row['wall_s']} s, load {row['load']:.2f}", flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
