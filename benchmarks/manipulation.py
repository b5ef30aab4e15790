"""The manipulation table: per task, behaviour cloning from a few expert demonstrations, then PPO and embodied GRPO
from that clone, RLPD-style SAC with those demonstrations in its minibatches (no clone), and the same SAC started
from its own actor cloned on them (`rlpd_bc`: SFT, then RL, as RLinf runs them), each scored by the same
deterministic evaluation (`eval.episodes` held-out seeds, the same seeds for all). Runs the CLI a user would
(`m2flow demos`, `m2flow sft`, `m2flow train`) and prints every command, so a row is reproduced by pasting them.
Asserts nothing.

Per task it writes OUT/<task>/row.json: the success rates, env steps, wall time and env steps/s of each RL
run (the median of its iterations' `throughput/env_steps_per_s`, with the 1-minute load average sampled while it
ran) and the sampled success curve (`rollout/success_once` by blocks of 10 iterations). `--summarize` prints the
table of every row.json under OUT as markdown.

    python benchmarks/manipulation.py --tasks metaworld/push-v3                  # one row, ~10 minutes
    python benchmarks/manipulation.py --tasks PushCube-v1 --ppo 'run.steps=40'   # extra overrides per RL run
    python benchmarks/manipulation.py --tasks PushCube-v1 --algos rlpd            # the RLPD column only
    python benchmarks/manipulation.py --tasks PickCube-v1 --algos rlpd_bc         # RLPD from SAC's own clone
    python benchmarks/manipulation.py --summarize
    python benchmarks/manipulation.py --tasks PickCube-v1 --plans 60               # RLPD's env steps/s per plan

The recipes (RECIPES below) are the ones measured in the README; `--demo-episodes`, `--ppo`, `--grpo`, `--rlpd` and
`--rlpd_bc` add to or override them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import shutil
import threading
import time
from pathlib import Path

# the CLI beside this interpreter (a virtual environment's bin/), else the one on PATH
_BESIDE = Path(sys.executable).with_name("m2flow")
M2FLOW = str(_BESIDE) if _BESIDE.exists() else shutil.which("m2flow") or "m2flow"

# RLPD-style SAC from the same demonstrations as the clone, with no clone: they fill half of every minibatch, and the
# actor's loss gains a behaviour-cloning term on them (sac.bc_coef). ManiSkill's sparse reward (success), gamma 0.9.
_SAC = ("algorithm.name=sac policy.hidden=[256,256] policy.activation=relu env.num_envs=8 sac.train_freq=8 "
        "sac.learning_starts=0 sac.max_policy_lag=1 sac.ent_coef=auto_0.01 sac.bc_coef=1")
RLPD = f"{_SAC} env.kwargs.reward_mode=sparse algorithm.gamma=0.9 sac.gradient_steps=-1 run.save_every=50"
# The same on ManiSkill's dense reward, as ManiSkill's own SAC baseline trains: episodes run on past success
# (ignore_terminations, so the reward keeps paying for holding the cube at the goal), gamma 0.8, update-to-data 0.5,
# and RLPD's LayerNorm in the critics (the rlpd_pickcube preset). PickCube: 98% at 134k env steps, 45 minutes, where
# the sparse recipe plateaued near 40%; PushCube from 2 demonstrations: 82% at 70k, where the sparse one fell to 11%.
RLPD_DENSE = (f"{_SAC} env.kwargs.ignore_terminations=true algorithm.gamma=0.8 sac.utd=0.5 sac.critic_layernorm=true "
              "run.save_every=100")
ALGOS = ("ppo", "grpo", "rlpd", "rlpd_bc")

# task -> preset, demonstrations recorded, demonstrations cloned (few: room for RL), `m2flow sft`'s options, PPO's,
# GRPO's and RLPD's overrides. PickCube's PPO learns from ManiSkill's sparse reward (success): on the dense one it fell
# to 10%.
RECIPES = {
    "metaworld/push-v3": dict(
        preset="ppo_metaworld", demos=20, clone=3, sft="--steps 1000",
        ppo="actor.lr=3e-4 actor.critic_warmup=3 algorithm.target_kl=0.05 run.steps=80",
        grpo="algorithm.name=grpo env.seed_groups=4 env.num_envs=16 algorithm.vf_coef=0 actor.lr=3e-4 "
             "algorithm.target_kl=0.05 run.steps=40"),
    "PushCube-v1": dict(
        preset="ppo_pickcube", demos=20, clone=2,
        ppo="env.kwargs.ignore_terminations=true rollout.steps=100 env.num_envs=16 policy.init_std_scale=0.5 "
            "actor.lr=1e-4 actor.critic_warmup=3 actor.minibatch_size=400 algorithm.target_kl=0.05 run.steps=30",
        grpo="env.kwargs.ignore_terminations=true rollout.steps=100 env.num_envs=16 policy.init_std_scale=0.5 "
             "algorithm.name=grpo env.seed_groups=4 algorithm.vf_coef=0 actor.lr=1e-4 actor.minibatch_size=400 "
             "algorithm.target_kl=0.05 run.steps=30",
        rlpd=f"{RLPD_DENSE} run.steps=1100", rlpd_bc=f"{RLPD_DENSE} run.steps=1100"),
    "PickCube-v1": dict(
        preset="ppo_pickcube", demos=100, clone=100,
        ppo="env.kwargs.ignore_terminations=true env.kwargs.reward_mode=sparse algorithm.gamma=0.99 "
            "algorithm.lam=0.95 rollout.steps=100 env.num_envs=64 policy.init_std_scale=0.25 "
            "cluster.placement='env,rollout,actor: 0-1' actor.lr=3e-5 actor.epochs=4 actor.minibatch_size=1600 "
            "algorithm.target_kl=0.02 actor.critic_warmup=3 run.steps=25",
        grpo="env.kwargs.ignore_terminations=true rollout.steps=100 env.num_envs=64 policy.init_std_scale=0.25 "
             "cluster.placement='env,rollout,actor: 0-1' algorithm.name=grpo env.seed_groups=8 algorithm.vf_coef=0 "
             "actor.lr=3e-5 actor.epochs=4 actor.minibatch_size=1600 algorithm.target_kl=0.02 run.steps=20",
        rlpd=f"{RLPD_DENSE} run.steps=2100", rlpd_bc=f"{RLPD_DENSE} run.steps=1500"),
    # 79% of the expert's episodes succeed: 150 recorded, 119 cloned; the clone (3%) leaves PPO and GRPO nothing to
    # start from, so the row runs RLPD alone, from scratch and from SAC's clone (the sparse recipe: the dense one fell
    # to 11% here)
    "StackCube-v1": dict(preset="ppo_pickcube", demos=150, clone=150, rlpd=f"{RLPD} run.steps=800",
                         rlpd_bc=f"{RLPD} run.steps=800"),
}


# RLPD's plans (--plans): the env and its policy on device 0 with the learner beside them on device 1, collecting
# while it learns (the presets'); everything on device 0, taking turns; the learner over both devices' cores,
# taking turns with the collection.
PLANS = {"pipelined": ["cluster.placement=env,rollout: 0; actor: 1", "sac.max_policy_lag=1"],
         "collocated": ["cluster.placement=env,rollout,actor: 0", "sac.max_policy_lag=0"],
         "wide": ["cluster.placement=env,rollout: 0; actor: 0-1:0", "sac.max_policy_lag=0"]}


def sh(cmd: list[str], log: Path) -> float:
    """Run `cmd` (printed first), its output to `log`; the wall seconds it took. A failure stops the benchmark with
    the log's tail."""
    print("$", shlex.join(cmd), flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc:
        sys.exit(f"{shlex.join(cmd)} exited {rc}; the end of {log}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - start


class LoadSampler:
    """The 1-minute load average every `every` seconds while a command runs (`with LoadSampler() as load: ...`)."""

    def __init__(self, every: float = 10.0):
        self.every, self.samples, self._stop = every, [], threading.Event()

    def __enter__(self):
        def sample():
            while not self._stop.wait(self.every):
                self.samples.append(os.getloadavg()[0])
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self) -> str:
        s = self.samples or [os.getloadavg()[0]]
        return f"{min(s):.1f}-{max(s):.1f}"


def rl_figures(run_dir: Path) -> dict:
    """From a finished run: deterministic success (eval.json), env steps, env steps/s (median over iterations) and
    the sampled success by blocks of 10 iterations."""
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    evaluation = json.loads((run_dir / "eval.json").read_text())
    curve = [r.get("rollout/success_once") for r in rows]
    blocks = [[x for x in curve[i:i + 10] if x is not None] for i in range(0, len(curve), 10)]
    return {"success": evaluation["success_rate"], "episodes": evaluation["episodes"],
            "env_steps": rows[-1]["env_steps"], "iterations": len(rows),
            "env_steps_per_s": statistics.median(r["throughput/env_steps_per_s"] for r in rows),
            "sampled_success_by_10": [round(statistics.mean(b), 3) for b in blocks if b]}


def demonstrations(task: str, args) -> tuple[dict, str, int, Path, Path]:
    """The task's recipe, preset, demonstrations cloned, output folder and demonstrations (recorded once)."""
    recipe = dict(RECIPES.get(task, {}))
    if not recipe and not args.preset:
        sys.exit(f"no recipe for {task!r} (have {', '.join(RECIPES)}): give --preset and the overrides")
    preset = args.preset or recipe["preset"]
    clone = args.demo_episodes or recipe.get("clone", 5)
    out = Path(args.out) / task.replace("/", "_")
    out.mkdir(parents=True, exist_ok=True)
    demos = out / "demos"
    if not (demos / "demos.json").exists():
        sh([M2FLOW, "demos", task, "-n", str(max(recipe.get("demos", clone), clone)), "--out", str(demos)],
           out / "demos.log")
    return recipe, preset, clone, out, demos


def rlpd_plans(task: str, args) -> dict:
    """--plans N: the task's RLPD recipe for N iterations in each of PLANS (no evaluation) -> env steps/s per plan
    (the median over its iterations after the first), written to OUT/<task>/plans.json."""
    recipe, preset, clone, out, demos = demonstrations(task, args)
    if "rlpd" not in recipe:
        sys.exit(f"{task}: no rlpd recipe to measure the plans of")
    overrides = [o for o in shlex.split(recipe["rlpd"]) if not o.startswith("run.steps=")]
    result = {"task": task, "iterations": args.plans, "plans": {}}
    for plan, settings in PLANS.items():
        cmd = [M2FLOW, "train", preset, f"env.id={task}", "eval.episodes=0", f"sac.demos={demos}",
               f"sac.demo_episodes={clone}", f"run.dir={out / 'plans'}", f"run.name={plan}", "run.overwrite=true",
               *overrides, "run.save_every=0", f"run.steps={args.plans}", *settings]
        with LoadSampler() as load:
            sh(cmd, out / f"plan_{plan}.log")
        rows = [json.loads(line) for line in open(out / "plans" / plan / "metrics.jsonl")][1:]
        result["plans"][plan] = {"env_steps_per_s": round(statistics.median(
            r["throughput/env_steps_per_s"] for r in rows), 1), "load": load.summary(),
            "command": shlex.join(["m2flow", *cmd[1:]])}
        print(f"{task} {plan}: {result['plans'][plan]['env_steps_per_s']} env steps/s (load "
              f"{result['plans'][plan]['load']})", flush=True)
    (out / "plans.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def run_task(task: str, args) -> dict:
    recipe, preset, clone, out, demos = demonstrations(task, args)
    common = [f"env.id={task}", f"eval.episodes={args.episodes}"]
    before = json.loads((out / "row.json").read_text()) if (out / "row.json").exists() else {}
    if before.get("demo_episodes") != clone:
        before = {}  # a row run before with the same demonstrations keeps its other columns (and its clones)
    row = {"task": task, "preset": preset, "demo_episodes": clone, "commands": {**before.get("commands", {})}}

    def cloned(name: str, overrides: list[str]) -> Path:
        """`m2flow sft` into OUT/<task>/<name>, trained again only when its command changed; row[name]: success."""
        sft = [M2FLOW, "sft", preset, str(out / name), "--demos", str(demos), "--demo-episodes", str(clone),
               *overrides, *common]
        cmd = shlex.join(["m2flow", *sft[1:]])
        if before.get("commands", {}).get(name) != cmd or not (out / name / "eval.json").exists():
            sh(sft, out / f"{name}.log")
        row[name] = {"success": json.loads((out / name / "eval.json").read_text())["success_rate"]}
        row["commands"][name] = cmd
        return out / name

    bc = cloned("bc", shlex.split(recipe.get("sft", "")))
    row.update({k: before[k] for k in (*ALGOS, "bc_sac") if k in before})
    for name in args.algos.split(","):
        if recipe and name not in recipe and not getattr(args, name):
            print(f"{task}: no {name} recipe (give --{name} to run one)", flush=True)
            continue
        overrides = shlex.split(recipe.get(name, "")) + shlex.split(getattr(args, name))
        # PPO and GRPO start from the clone; RLPD from scratch, with the clone's demonstrations in its minibatches;
        # rlpd_bc from SAC's own actor cloned on them (the clone's command: the run's policy and algorithm)
        start = [f"sac.demos={demos}", f"sac.demo_episodes={clone}"] if name.startswith("rlpd") else []
        if name == "rlpd_bc":
            sac_policy = [o for o in overrides if o.startswith(("policy.", "algorithm."))]
            start.append(f"policy.init={cloned('bc_sac', sac_policy)}")
        elif name != "rlpd":
            start.append(f"policy.init={bc}")
        cmd = [M2FLOW, "train", preset, *common, *start, f"run.dir={out}", f"run.name={name}", "run.overwrite=true",
               *overrides]
        with LoadSampler() as load:
            seconds = sh(cmd, out / f"{name}.log")
        row[name] = {**rl_figures(out / name), "wall_s": round(seconds), "load": load.summary()}
        row["commands"][name] = shlex.join(["m2flow", *cmd[1:]])
    (out / "row.json").write_text(json.dumps(row, indent=1) + "\n")
    return row


def table(rows: list[dict]) -> str:
    names = {"ppo": "PPO", "grpo": "GRPO", "rlpd": "RLPD", "rlpd_bc": "RLPD from SAC's clone"}
    lines = ["| task | demos | BC | " + " | ".join(f"+ {n}" for n in names.values()) + " | "
             + " | ".join(f"{n} env steps (s, steps/s, load)" for n in names.values()) + " |",
             "| --- " * (3 + 2 * len(names)) + "|"]
    for r in rows:
        success = [f"{r[k]['success']:.0%}" if k in r else "–" for k in names]
        if "rlpd_bc" in r:  # beside the clone it started from
            success[-1] += f" (clone {r['bc_sac']['success']:.0%})"
        cells = [f"{r[k]['env_steps']:,} ({r[k]['wall_s']} s, {r[k]['env_steps_per_s']:.0f}/s, load {r[k]['load']})"
                 if k in r else "–" for k in names]
        lines.append(f"| {r['task']} | {r['demo_episodes']} | {r['bc']['success']:.0%} | {' | '.join(success)} | "
                     f"{' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default=",".join(RECIPES), help="comma-separated env ids")
    p.add_argument("--out", default="runs/bench/manipulation")
    p.add_argument("--episodes", type=int, default=100, help="deterministic held-out episodes per evaluation")
    p.add_argument("--demo-episodes", type=int, default=None, help="demonstrations cloned (the recipe's if unset)")
    p.add_argument("--preset", default=None, help="the preset of a task without a recipe")
    p.add_argument("--ppo", default="", help="overrides added to PPO's")
    p.add_argument("--grpo", default="", help="overrides added to GRPO's")
    p.add_argument("--rlpd", default="", help="overrides added to RLPD's")
    p.add_argument("--rlpd_bc", default="", help="overrides added to RLPD's from SAC's clone")
    p.add_argument("--algos", default=",".join(ALGOS), help=f"the RL runs of a row, from {', '.join(ALGOS)}")
    p.add_argument("--summarize", action="store_true", help="print the table of the rows under --out")
    p.add_argument("--plans", type=int, default=0, metavar="N",
                   help=f"instead: env steps/s of the RLPD recipe in each plan ({', '.join(PLANS)}), N iterations")
    args = p.parse_args()
    if args.plans:
        for t in args.tasks.split(","):
            rlpd_plans(t.strip(), args)
        return
    if unknown := set(args.algos.split(",")) - set(ALGOS):
        p.error(f"--algos: {', '.join(sorted(unknown))} is not one of {', '.join(ALGOS)}")
    if args.summarize:
        rows = [json.loads(f.read_text()) for f in sorted(Path(args.out).glob("*/row.json"))]
        if not rows:
            sys.exit(f"no row.json under {args.out}")
    else:
        rows = [run_task(t.strip(), args) for t in args.tasks.split(",")]
    print(table(rows))
    for r in rows:
        for name, cmd in r["commands"].items():
            print(f"{r['task']} {name}: {cmd}")


if __name__ == "__main__":
    main()
