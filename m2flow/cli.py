"""The `m2flow` command: demo | train | eval | sft | init-model | demos | profile | plan. Parses arguments and calls
flows."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="m2flow", description="RL training with macro-to-micro flow transformation")
    p.add_argument("--debug", action="store_true", help="on an error, show the whole Python traceback (also: "
                                                         "M2FLOW_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="the main job: tiny model, SFT warm start, GRPO, held-out accuracy before -> after")
    d.add_argument("overrides", nargs="*", help="config overrides, e.g. run.steps=10")

    t = sub.add_parser("train", help="train from a YAML config or preset, with dotted overrides")
    t.add_argument("config", help="YAML file or preset name in configs/")
    t.add_argument("overrides", nargs="*", help="e.g. run.steps=50 cluster.placement='rollout: 0; actor,inference,reward: 1'")
    t.add_argument("--help-config", action="store_true", help="list every config field with its default and meaning")

    e = sub.add_parser("eval", help="reasoning: held-out greedy pass@1 and pass@k; embodied: mean return and success rate")
    e.add_argument("model", help="HF model directory, or a checkpoint directory holding model/")
    e.add_argument("overrides", nargs="*", help="overrides of the checkpoint's run config (the defaults for a bare model "
                                                "directory), e.g. data.eval_size=50")
    e.add_argument("--k", type=int, default=8)
    e.add_argument("--limit", type=int, default=None, help="evaluate only the first N held-out problems")
    e.add_argument("--episodes", type=int, default=10, help="embodied checkpoints: deterministic episodes to run")
    e.add_argument("--video", default=None, help="embodied checkpoints: folder for a video of one episode")

    s = sub.add_parser("sft", help="supervised warm start: reasoning, on prompt -> answer pairs; embodied (--demos), "
                                   "behaviour cloning of demonstrations")
    s.add_argument("model", help="HF model directory to start from; with --demos, the embodied config or preset "
                                 "whose policy is cloned")
    s.add_argument("out", help="where to write the fine-tuned model directory (--demos: the policy checkpoint that "
                               "policy.init=OUT starts RL from)")
    s.add_argument("overrides", nargs="*", help="data.* overrides choosing the task (--demos: config overrides)")
    s.add_argument("--demos", default=None, help="a demonstration dataset (m2flow demos): behaviour cloning")
    s.add_argument("--demo-episodes", type=int, default=None, help="--demos: clone from the first N episodes only")
    s.add_argument("--steps", type=int, default=None, help="optimizer steps (default 600; --demos: 2000)")
    s.add_argument("--batch-size", type=int, default=None, help="default 64; --demos: 256")
    s.add_argument("--lr", type=float, default=None, help="default 3e-3; --demos: 1e-3")
    s.add_argument("--shift", type=int, default=0, help="--demos from pixels: move each training frame by up to N "
                                                        "pixels at random (augmentation; default 0: off)")

    i = sub.add_parser("init-model", help="write a tiny HF model directory (random weights, character tokenizer)")
    i.add_argument("out")
    i.add_argument("--arch", default="qwen2", choices=["qwen2", "llama", "qwen2_moe"])
    i.add_argument("--hidden", type=int, default=64)
    i.add_argument("--layers", type=int, default=2)
    i.add_argument("--seed", type=int, default=0)

    dm = sub.add_parser("demos", help="record expert demonstrations of a ManiSkill3 task (PickCube-v1, PushCube-v1, "
                                      "StackCube-v1) or a Meta-World one (metaworld/reach-v3, ...) as a dataset for "
                                      "behaviour cloning")
    dm.add_argument("task")
    dm.add_argument("-n", "--episodes", type=int, default=100, help="episodes, from reset seeds SEED, SEED + 1, ...")
    dm.add_argument("--out", default=None, help="dataset directory (default: runs/demos/TASK, with --pixels "
                    "runs/demos/TASK-pixelsSIZE, with --wrist-camera TASK-pixelsSIZE-wrist)")
    dm.add_argument("--seed", type=int, default=0, help="the first reset seed")
    dm.add_argument("--pixels", action="store_true", help="ManiSkill3: record what env.pixels=true shows a policy "
                                                          "(the task camera's frames, the proprioception, the "
                                                          "instruction) instead of the state")
    dm.add_argument("--image-size", type=int, default=64, help="--pixels: the frames' side (env.image_size)")
    dm.add_argument("--render-triangles", type=int, default=1000,  # maniskill.RENDER_TRIANGLES (a light CLI)
                    help="--pixels: visual triangles per body (env.render_triangles; 0: the meshes as shipped)")
    dm.add_argument("--wrist-camera", action="store_true",
                    help="--pixels: the hand camera's frames too, after the task camera's (env.wrist_camera)")

    pr = sub.add_parser("profile", help="time each component of a flow (reasoning or embodied) alone at several batch sizes")
    pr.add_argument("config", help="YAML file or preset name in configs/")
    pr.add_argument("overrides", nargs="*")
    pr.add_argument("--out", default=None, help="profile JSON path (default: in the run directory)")
    pr.add_argument("--batches", default=None, help="comma-separated samples per call (embodied: envs), e.g. 8,16,32")
    pr.add_argument("--repeats", type=int, default=3)

    pl = sub.add_parser("plan", help="search execution plans for N devices from a profile table (no cluster needed)")
    pl.add_argument("--profile", required=True, help="profile JSON (m2flow profile output, or hand-made)")
    pl.add_argument("--devices", type=int, required=True, help="devices of the cluster to plan for")
    pl.add_argument("--batch", type=int, default=None, help="samples per step (default: the profile's)")
    pl.add_argument("--max-staleness", type=int, default=0, metavar="N",
                    help="the run's algorithm.max_staleness: with N >= 1 generation overlaps training where the "
                         "rollout has devices of its own (default 0: on-policy)")
    pl.add_argument("--out", default=None, help="folder for plan_<N>dev.yaml and the predicted timeline PNG")
    pl.add_argument("--top", type=int, default=10, help="candidates to list")

    args = parse(p, argv)
    import torch

    from m2flow.config import ConfigError, UserError
    from m2flow.runtime.group import WorkerError

    # The driver's own compute (SFT, eval) is on tiny models: one thread avoids OpenMP spin contention with
    # the worker processes, which pin their own cores and threads.
    torch.set_num_threads(1)
    debug = args.debug or os.environ.get("M2FLOW_DEBUG", "") not in ("", "0")

    try:
        return COMMANDS[args.command](args)
    except UserError as err:  # config fields, run directories: one line naming what to change
        if debug:
            raise
        print(f"m2flow: {'config error' if isinstance(err, ConfigError) else 'error'}: {err}", file=sys.stderr)
        return 2
    except WorkerError as err:  # a worker failed: which one, what it said, where in its code
        if debug:
            raise
        print(worker_failure(err), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the flow has killed its workers on the way out (runtime.running)
        if debug:
            raise
        print("m2flow: interrupted" + (RESUME_HINT if args.command == "train" else ""), file=sys.stderr)
        return 130


RESUME_HINT = ("; the run's workers are stopped and its checkpoints kept: run the same command with run.resume=true "
               "to continue from the newest one")


def worker_failure(err, lines: int = 6) -> str:
    """A WorkerError for a person: component and rank, what the worker raised (or how its process died), the last
    `lines` lines of its own traceback, and how to see all of it."""
    out = [f"m2flow: {err.component} rank {err.rank} failed: {err.message}"]
    if err.remote_traceback:
        tail = err.remote_traceback.rstrip().splitlines()[-lines:]
        out += ["  the worker's traceback ends:", *(f"    {line}" for line in tail)]
    out.append("  (the whole traceback: m2flow --debug ..., or M2FLOW_DEBUG=1)")
    return "\n".join(out)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv`, taking config overrides (`key=value`) before or after options: `m2flow eval CKPT --k 1
    data.eval_size=50` as `m2flow eval CKPT data.eval_size=50 --k 1` (argparse stops a positional list at the first
    option and would reject what follows)."""
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "overrides") and not any(x.startswith("-") or "=" not in x for x in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def cmd_demo(args) -> int:
    from m2flow.demo import run_demo

    run_demo(args.overrides)
    return 0


def cmd_train(args) -> int:
    from m2flow import api
    from m2flow import config as C

    if args.help_config:
        for name, default, text in C.describe(type(api.load_config(args.config))):
            print(f"{name:32s} {default!s:18s} {text}")
        return 0
    result = api.train(args.config, args.overrides)
    print(f"run directory: {result.run_dir}")
    return 0


def cmd_eval(args) -> int:
    from m2flow import api

    result = api.evaluate(args.model, args.overrides, k=args.k, limit=args.limit, episodes=args.episodes,
                          video_dir=args.video)
    if "model" in result:  # reasoning: what was evaluated, then the scores
        print(f"model: {result.pop('model')}\nconfig: {result.pop('config')}\ndata: {result.pop('data')}; "
              f"reward {result.pop('reward')}, at most {result.pop('max_new_tokens')} new tokens")
    for key, value in result.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    return 0


def cmd_sft(args) -> int:
    from m2flow import config as C
    from m2flow.reasoning.config import ReasoningConfig
    from m2flow.reasoning.warm_start import sft_model

    if args.demos is not None:
        return behaviour_clone(args)
    steps, batch_size, lr = args.steps or 600, args.batch_size or 64, args.lr or 3e-3
    cfg = C.load(ReasoningConfig, None, args.overrides + [f"sft.steps={steps}", f"sft.batch_size={batch_size}",
                                                            f"sft.lr={lr}"])
    sft_model(args.model, args.out, cfg)
    print(f"fine-tuned model: {args.out}")
    return 0


def behaviour_clone(args) -> int:
    from m2flow import api
    from m2flow import config as C
    from m2flow.embodied.config import EmbodiedConfig
    from m2flow.embodied.cloning import behaviour_clone

    cfg = api.load_config(args.model, args.overrides)
    if not isinstance(cfg, EmbodiedConfig):
        raise C.UserError(f"sft --demos: '{args.model}' is not an embodied config (flow: embodied)")
    if args.demo_episodes is not None and args.demo_episodes < 1:
        raise C.UserError(f"sft --demo-episodes must be >= 1, got {args.demo_episodes}")
    try:
        result = behaviour_clone(cfg, args.demos, args.out, steps=args.steps or 2000, episodes=args.demo_episodes,
                                 batch_size=args.batch_size or 256, lr=args.lr or 1e-3, shift=args.shift)
    except (ValueError, FileNotFoundError) as e:
        raise C.UserError(f"sft --demos: {e}") from None
    print(f"cloned from {result['demo_episodes']} demonstrations ({result['demo_steps']} steps): nll "
          f"{result['bc/nll']:.3f}; policy: {args.out} (policy.init={args.out})")
    if "eval" in result:
        e = result["eval"]
        print(f"deterministic evaluation, {e['episodes']} episodes: return {e['return_mean']:.2f}"
              + (f", success {e['success_rate']:.0%}" if "success_rate" in e else ""))
    return 0


def cmd_init_model(args) -> int:
    from m2flow.engines.hf import init_tiny_model

    path = init_tiny_model(args.out, arch=args.arch, hidden_size=args.hidden, num_layers=args.layers, seed=args.seed)
    print(f"tiny model: {path}")
    return 0


def cmd_demos(args) -> int:
    from m2flow.config import UserError
    from m2flow.embodied.envs import experts, maniskill
    from m2flow.run_dir import progress

    try:
        experts.check_task(args.task)
    except (ImportError, ValueError) as e:
        raise UserError(f"demos: {e}") from None
    if args.episodes < 1:
        raise UserError(f"demos: -n must be >= 1, got {args.episodes}")
    if args.pixels and args.task not in experts.EXPERTS:
        raise UserError(f"demos: --pixels records the ManiSkill3 tasks' camera frames ({', '.join(experts.EXPERTS)}), "
                        f"not {args.task}'s")
    if args.pixels and not 36 <= args.image_size <= 2048:
        raise UserError(f"demos: --image-size must be in [36, 2048] (env.image_size's range), got {args.image_size}")
    if args.wrist_camera and not args.pixels:
        raise UserError("demos: --wrist-camera records the hand camera's frames: it needs --pixels")
    if args.render_triangles < 0:
        raise UserError(f"demos: --render-triangles must be >= 0 (env.render_triangles), got {args.render_triangles}")
    try:
        if args.task in experts.EXPERTS:
            maniskill.check_available()
    except (ImportError, RuntimeError) as e:
        raise UserError(f"demos: {e}") from None
    task_dir = os.path.join(*args.task.split("/")) + (f"-pixels{args.image_size}" if args.pixels else "") \
        + ("-wrist" if args.wrist_camera else "")
    out = args.out or os.path.join("runs", "demos", task_dir)
    with progress() as bar:
        task = bar.add_task(f"{args.task} expert", total=args.episodes, info="")
        summary = experts.write_demos(args.task, args.episodes, out, seed=args.seed,
                                      progress=lambda done: bar.update(task, completed=done), pixels=args.pixels,
                                      image_size=args.image_size, render_triangles=args.render_triangles,
                                      wrist_camera=args.wrist_camera)
    episodes = summary["episodes"]
    print(f"{len(episodes)} episodes of {args.task}: {summary['success_rate']:.0%} successful, "
          f"{sum(e['length'] for e in episodes)} steps; dataset: {out}")
    return 0


def cmd_profile(args) -> int:
    from m2flow.profiling import profile_command

    print(profile_command(args.config, args.overrides, args.out, args.batches, args.repeats))
    return 0


def cmd_plan(args) -> int:
    from m2flow.config import UserError
    from m2flow.planner.search import plan_command

    if args.max_staleness < 0:
        raise UserError(f"--max-staleness must be >= 0 (0: on-policy), got {args.max_staleness}")
    print(plan_command(args.profile, args.devices, args.out, batch=args.batch, top=args.top,
                       staleness=args.max_staleness))
    return 0


COMMANDS = {"plan": cmd_plan, "profile": cmd_profile, "demo": cmd_demo, "train": cmd_train, "eval": cmd_eval,
            "sft": cmd_sft, "init-model": cmd_init_model, "demos": cmd_demos}

if __name__ == "__main__":
    sys.exit(main())
