"""The VLA from pixels on ManiSkill3 (issue 70): the rollout's env steps per second in each plan, with the simulator's
and renderer's time beside the VLA's inference time, measured with the real flow; and (--success) its success, the
clone's against PPO's from it. Prints tables; asserts nothing.

    python benchmarks/vla.py [--envs 12] [--horizon 20] [--iterations 5] [--reps 3] [overrides ...]
    python benchmarks/vla.py --plans 'env,rollout,actor: all@2|env: 0; rollout: 1; actor: all@2'
    python benchmarks/vla.py --success [--clone 60] [--seeds 0,1] [overrides of the PPO runs ...]

--success runs the CLI a user would, printing each command: `m2flow demos TASK --pixels --wrist-camera` (once per
task), behaviour cloning of the first `--clone` demonstrations (`m2flow sft vla_pickcube`), then PPO from the clone
(`m2flow train vla_pickcube policy.init=...`) once per RL seed; each scored by the same deterministic evaluation
(`--episodes` held-out reset seeds). It writes OUT/success_TASK/row.json (the clone's success, each seed's success,
env steps, wall time, env steps/s and load) and prints the table. `--task PickCube-v1,PushCube-v1,StackCube-v1`
does the same for one policy on the three tasks (`vla_maniskill3`; OUT/success_TASK+TASK+TASK/), the success the
mean of the tasks', each task's beside it.

Each plan (`placement@pipeline_stages`) trains `--iterations` PPO iterations of ppo_pickcube with `env.pixels=true
policy.kind=vla` (the vla section's default sizes, 64x64 frames; `--preset vla_pickcube`: its both cameras and PPO
settings); the plans run interleaved, `--reps` rounds of each. Per plan the medians over rounds of the iterations after the first: the rollout's env steps/s
(`throughput/rollout_env_steps_per_s`), the whole iteration's (with the update), and per iteration the env
workers' stepping and rendering time (`time/env_time`, the mean over env workers) against the policy workers'
inference time (`time/policy_time`). The 1-minute load average is printed beside each round: figures taken above 1.0 beside
other work are "under load". `cluster.placement=auto` (the default first plan, `auto`) profiles and picks.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
from pathlib import Path

from m2flow import config as C
from m2flow.api import train
from m2flow.embodied.config import EmbodiedConfig

PLANS = ("auto", "env,rollout,actor: all@1", "env,rollout,actor: all@2", "env: 0; rollout: 1; actor: all@2",
         "env,rollout: 0; actor: 1@1", "env: 0; rollout,actor: 1@2")
PIXELS = ["env.id=PickCube-v1", "env.pixels=true", "policy.kind=vla"]
KEYS = {"rollout": "throughput/rollout_env_steps_per_s", "iteration": "throughput/env_steps_per_s",
        "env_s": "time/env_time", "policy_s": "time/policy_time"}


def run_plan(plan: str, args, out: Path, rep: int) -> dict:
    """One round of `plan`: train, then the medians of KEYS over the iterations after the first."""
    spec, _, stages = plan.partition("@")
    name = f"{spec.replace(' ', '').replace(';', '_').replace(':', '').replace(',', '')}_{stages or 'auto'}_{rep}"
    overrides = [*PIXELS, f"env.num_envs={args.envs}", f"rollout.steps={args.horizon}", f"run.steps={args.iterations}",
                 "run.save_every=0", "eval.episodes=0", "run.progress=false", "run.overwrite=true",
                 f"run.dir={out}", f"run.name={name}", f"cluster.placement={spec}", *args.overrides]
    if stages:
        overrides.append(f"env.pipeline_stages={stages}")
    if spec == "auto" and rep:  # profile once: the later rounds reuse the first round's profile
        first = out / name.replace(f"_{rep}", "_0") / "profile.json"
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "profile.json").write_bytes(first.read_bytes())
        overrides.remove("run.overwrite=true")
    train(C.load(EmbodiedConfig, args.preset or "ppo_pickcube", overrides))
    rows = [json.loads(line) for line in open(out / name / "metrics.jsonl")][1:]
    got = {k: statistics.median(r[key] for r in rows) for k, key in KEYS.items()}
    plan_yaml = C.read_yaml(out / name / "plan.yaml")
    return {**got, "placement": plan_yaml["placement_spec"], "stages": plan_yaml.get("pipeline_stages"),
            "load": os.getloadavg()[0]}


def success(args) -> None:
    """--success: the clone's deterministic success against PPO's from it, per RL seed (module docstring); with
    several tasks (comma-separated), one policy on all of them (vla_maniskill3) and the success per task."""
    from manipulation import M2FLOW, LoadSampler, rl_figures, sh  # benchmarks/: the manipulation table's helpers

    tasks = args.task.split(",")
    preset = args.preset or ("vla_pickcube" if len(tasks) == 1 else "vla_maniskill3")
    out = Path(args.out) / f"success_{'+'.join(tasks)}"
    out.mkdir(parents=True, exist_ok=True)
    demos = []
    for task in tasks:  # recorded once per task, shared by the single- and the multi-task rows
        where = Path(args.out) / f"success_{task}" / "demos"
        if not (where / "demos.json").exists():
            where.parent.mkdir(parents=True, exist_ok=True)
            sh([M2FLOW, "demos", task, "-n", str(args.demos), "--pixels", "--wrist-camera", "--out", str(where)],
               where.parent / "demos.log")
        demos.append(str(where))
    common = [f"env.id={args.task}"] + ([f"eval.episodes={args.episodes}"] if args.episodes else [])
    bc = out / f"bc{args.clone}"
    if not (bc / "eval.json").exists():
        sh([M2FLOW, "sft", preset, str(bc), "--demos", ",".join(demos), "--demo-episodes", str(args.clone),
            "--steps", str(args.bc_steps), "--batch-size", "128", *common], out / f"bc{args.clone}.log")
    row = {"tasks": tasks, "demo_episodes": args.clone, "bc": per_task(bc / "eval.json", tasks), "ppo": {}}
    if (out / "row.json").exists():  # the seeds run before, from the same clone: kept beside this call's
        row["ppo"] = json.loads((out / "row.json").read_text())["ppo"]
    for seed in args.seeds.split(","):
        name = f"ppo_bc{args.clone}_seed{seed}" + (f"_{args.tag}" if args.tag else "")
        cmd = [M2FLOW, "train", preset, *common, f"policy.init={bc}", f"run.seed={seed}", f"run.dir={out}",
               f"run.name={name}", "run.overwrite=true", *args.overrides]
        with LoadSampler() as load:
            seconds = sh(cmd, out / f"{name}.log")
        key = seed + (f" {args.tag}" if args.tag else "")
        row["ppo"][key] = {**rl_figures(out / name), **per_task(out / name / "eval.json", tasks),
                            "wall_s": round(seconds), "load": load.summary(),
                            "command": shlex.join(["m2flow", *cmd[1:]])}
    (out / "row.json").write_text(json.dumps(row, indent=1) + "\n")
    clone = row["bc"]
    print(f"\n{args.task}: clone of {args.clone} demonstrations per task, deterministic success {clone['success']:.0%}"
          + "".join(f", {t} {clone[t]:.0%}" for t in tasks if len(tasks) > 1) + " on the held-out episodes\n")
    each = [t for t in tasks if len(tasks) > 1]
    print("| RL seed | after PPO | lift |" + "".join(f" {t} |" for t in each)
          + " env steps | wall s | env steps/s | load |")
    print("| --- | --- | --- |" + " --- |" * len(each) + " --- | --- | --- | --- |")
    for seed, r in row["ppo"].items():
        print(f"| {seed} | {r['success']:.0%} | {100 * (r['success'] - clone['success']):+.0f} points |"
              + "".join(f" {clone[t]:.0%} -> {r[t]:.0%} |" for t in each)
              + f" {r['env_steps']:,} | {r['wall_s']} | {r['env_steps_per_s']:.0f} | {r['load']} |")
    for seed, r in row["ppo"].items():
        print(f"seed {seed}: {r['command']}")


def per_task(path: Path, tasks: list[str]) -> dict:
    """An evaluation's success: `success` over all its episodes; with several tasks, the mean of the tasks' success
    (the figure the issue asks for) and each task's."""
    evaluation = json.loads(path.read_text())
    if len(tasks) == 1:
        return {"success": evaluation["success_rate"]}
    each = {t: evaluation[f"success_rate/{t}"] for t in tasks}
    return {"success": statistics.mean(each.values()), **each}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", type=int, default=12)
    p.add_argument("--horizon", type=int, default=20, help="rollout.steps")
    p.add_argument("--iterations", type=int, default=5, help="per plan and round; the first is left out")
    p.add_argument("--reps", type=int, default=3, help="interleaved rounds of every plan")
    p.add_argument("--plans", default="|".join(PLANS), help="'placement@stages|...', auto: cluster.placement=auto")
    p.add_argument("--out", default="runs/bench_vla")
    p.add_argument("--success", action="store_true", help="instead: the clone's success against PPO's from it")
    p.add_argument("--task", default="PickCube-v1", help="--success: the ManiSkill3 task, or several, comma-separated "
                                                         "(one policy on all: vla_maniskill3)")
    p.add_argument("--preset", default=None, help="the plans' config (default ppo_pickcube with the VLA on pixels); "
                                                  "--success: default vla_pickcube (one task), vla_maniskill3")
    p.add_argument("--demos", type=int, default=300, help="--success: demonstrations recorded per task")
    p.add_argument("--clone", type=int, default=60, help="--success: the first N demonstrations of each task cloned")
    p.add_argument("--bc-steps", type=int, default=1500, help="--success: behaviour cloning's Adam steps (of 128)")
    p.add_argument("--seeds", default="0,1", help="--success: the RL runs' seeds (run.seed)")
    p.add_argument("--tag", default="", help="--success: a name for these PPO runs' variant (the overrides), kept "
                                             "apart from the preset's in row.json")
    p.add_argument("--episodes", type=int, default=None, help="--success: deterministic held-out episodes (default: "
                                                               "the preset's eval.episodes, 100 and 120)")
    p.add_argument("overrides", nargs="*", help="config overrides for every run (vla.*, env.image_size, ...; "
                                                "--success: of the PPO runs)")
    args = p.parse_args()
    if args.success:
        success(args)
        return
    out = Path(args.out)
    plans = args.plans.split("|")
    got: dict[str, list[dict]] = {plan: [] for plan in plans}
    for rep in range(args.reps):
        for plan in plans:
            r = run_plan(plan, args, out, rep)
            got[plan].append(r)
            print(f"round {rep + 1}  {plan:36s} rollout {r['rollout']:6.1f} env steps/s  iteration "
                  f"{r['iteration']:6.1f}  env {r['env_s']:.2f} s  policy {r['policy_s']:.2f} s  load {r['load']:.1f}",
                  flush=True)
    print(f"\n{args.envs} envs x {args.horizon} steps an iteration, {' '.join(PIXELS + args.overrides)}; medians of "
          f"{args.reps} rounds\n")
    print("| plan | placement (stages) | rollout env steps/s | iteration env steps/s | env + render s "
          "| VLA inference s | load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for plan, rs in got.items():
        med = {k: statistics.median(r[k] for r in rs) for k in (*KEYS, "load")}
        print(f"| {plan} | `{rs[0]['placement']}` ({rs[0]['stages']}) | {med['rollout']:.1f} | {med['iteration']:.1f} "
              f"| {med['env_s']:.2f} | {med['policy_s']:.2f} | {min(r['load'] for r in rs):.1f}-"
              f"{max(r['load'] for r in rs):.1f} |")


if __name__ == "__main__":
    main()
