"""Every plan a flow can run on this machine's devices, measured with the real flow beside the planner's prediction
from a profile, and the plan that auto mode picks. Prints a table; asserts nothing.

    python benchmarks/plans.py [--steps 5] [--prompts 8] [--n 4] [--tokens 8] [--out runs/bench_plans] [overrides ...]
    python benchmarks/plans.py --flow embodied [--steps 5] [--envs 8] [--horizon 32] [--out runs/bench_plans_embodied]

Auto mode (`cluster.placement=auto`) profiles the flow (or reuses OUT/auto/profile.json; --fresh re-profiles),
searches and trains the chosen plan; then every other plan the flow can run trains as many steps (`--steps`):
reasoning, every placement x micro-batch; embodied, every placement x env pipeline stages. The measured step time
is the median over the steps after the first. The machine may be shared: its load average is printed with the
figures.
"""

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from m2flow import config as C
from m2flow.api import measure_plan, train
from m2flow.embodied.config import EmbodiedConfig
from m2flow.reasoning.config import ReasoningConfig
from m2flow.runtime import Cluster


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flow", choices=["reasoning", "embodied"], default="reasoning")
    p.add_argument("--steps", type=int, default=5, help="training steps (iterations) per plan (the first is left out)")
    p.add_argument("--prompts", type=int, default=8, help="reasoning: rollout.prompts_per_step")
    p.add_argument("--n", type=int, default=4, help="reasoning: rollout.n (samples per prompt)")
    p.add_argument("--tokens", type=int, default=8, help="reasoning: rollout.max_new_tokens")
    p.add_argument("--env-id", default="CartPole-v1", help="embodied: env.id")
    p.add_argument("--envs", type=int, default=8, help="embodied: env.num_envs")
    p.add_argument("--horizon", type=int, default=32, help="embodied: rollout.steps")
    p.add_argument("--devices", type=int, default=2, help="CPU devices (cluster.cpu_devices)")
    p.add_argument("--out", default=None, help="default: runs/bench_plans (embodied: runs/bench_plans_embodied)")
    p.add_argument("--fresh", action="store_true", help="profile again even if OUT/auto/profile.json exists")
    p.add_argument("overrides", nargs="*", help="more config overrides, e.g. model.tiny_hidden=128")
    args = p.parse_args()

    embodied = args.flow == "embodied"
    out = Path(args.out or ("runs/bench_plans_embodied" if embodied else "runs/bench_plans"))
    profile = out / "auto" / "profile.json"
    kept = profile.read_bytes() if profile.exists() and not args.fresh else None
    shutil.rmtree(out / "auto", ignore_errors=True)  # the last benchmark's run, less its profile unless --fresh
    if kept:
        profile.parent.mkdir(parents=True)
        profile.write_bytes(kept)
    common = [f"run.dir={out}", "run.name=auto", "run.progress=false", "run.trace=false", f"run.steps={args.steps}",
              "cluster.placement=auto"]
    if embodied:
        cfg = C.load(EmbodiedConfig, None, [*common, f"env.id={args.env_id}", f"env.num_envs={args.envs}",
                                              f"rollout.steps={args.horizon}", "eval.episodes=0", *args.overrides])
        work = f"{args.env_id}, {args.envs} envs x {args.horizon} steps per iteration"
    else:
        batch = args.prompts * args.n
        cfg = C.load(ReasoningConfig, None, [
            *common, f"rollout.prompts_per_step={args.prompts}", f"rollout.n={args.n}",
            f"rollout.max_new_tokens={args.tokens}", f"actor.micro_batch={batch}", "data.train_size=500",
            "data.eval_size=20", *args.overrides])
        work = f"{batch} samples per step ({args.prompts} prompts x {args.n}, {args.tokens} new tokens)"
    cluster = Cluster(cpu_devices=args.devices)
    load0 = os.getloadavg()[0]
    start = time.perf_counter()
    train(cfg, cluster=cluster)  # auto mode: profile (unless OUT/auto/profile.json exists), plan, train the chosen plan
    planned = time.perf_counter() - start
    report = json.loads((out / "auto" / "plan_report.json").read_text())
    grain = "pipeline_stages" if embodied else "micro_batch"
    print(f"  auto mode ({planned:.0f} s): {report['placement_spec']} ({grain} {report[grain]}): "
          f"{report['measured_step_seconds']:.4f} s/step", flush=True)
    search = json.loads((out / "auto" / "plan_search.json").read_text())
    rows = [{**search["candidates"][0], "measured": report["measured_step_seconds"]}]
    for i, c in enumerate(search["candidates"][1:], 1):
        measured = measure_plan(cfg, c["placement_spec"], c[grain], out / f"plan{i}", args.steps, cluster)
        rows.append({**c, "measured": measured})
        print(f"  measured {c['placement_spec']} ({grain} {c[grain]}): {measured:.4f} s/step", flush=True)
    load1 = os.getloadavg()[0]

    best = min(rows, key=lambda r: r["measured"])
    pick = rows[0]
    print(f"\n{args.flow} flow, {cluster.num_devices} CPU devices, {work}, {args.steps} steps per plan, median of "
          f"steps 2..{args.steps}; load average {load0:.1f} -> {load1:.1f} on {os.cpu_count()} cores")
    print(f"auto mode (profile + search + {args.steps} steps): {planned:.0f} s ({out / 'auto' / 'profile.json'})\n")
    label = "stages" if embodied else "micro"
    head = f"{'':2s} {'placement':46s} {'mode':13s} {label:>6s} {'predicted s':>11s} {'measured s':>10s} {'error':>7s}"
    print(head)
    print("-" * len(head))
    for r in sorted(rows, key=lambda r: r["measured"]):
        mark = "*" if r is pick else " "
        err = (r["predicted_step_seconds"] - r["measured"]) / r["measured"]
        print(f"{mark:2s} {r['placement_spec']:46s} {r['mode']:13s} {r[grain]:6d} "
              f"{r['predicted_step_seconds']:11.4f} {r['measured']:10.4f} {err:+7.1%}")
    print(f"\n* auto chose: {pick['placement_spec']} ({label} {pick[grain]}), measured {pick['measured']:.4f} s; "
          f"best measured: {best['placement_spec']} ({label} {best[grain]}) {best['measured']:.4f} s; "
          f"auto is {pick['measured'] / best['measured'] - 1:+.1%} from the best")
    cluster.shutdown()


if __name__ == "__main__":
    main()
