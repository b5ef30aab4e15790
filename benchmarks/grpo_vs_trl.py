"""GRPO step time and learning, m2flow vs TRL's GRPOTrainer, on identical work on this machine's CPU cores.

Both systems start from one model directory (a tiny Qwen2 with a character tokenizer, SFT-warm-started once on
the task), see the same prompts in the same order (synthetic 2-digit addition, `--prompts` prompts x `--n`
samples per step), sample at temperature 1 with the same max completion length, and take one AdamW step per
batch with the same learning rate (constant), gradient clip, clip range and KL coefficient, the loss a token
mean over the whole batch. m2flow runs in each plan of `--plans` (each worker pinned to its device's cores);
TRL runs in this process (transformers generate, no vLLM) with torch using both cores. Held-out greedy accuracy
is measured with the same evaluator for every system (on the first round's models). The systems run interleaved,
`--rounds` times (m2flow plans, TRL, m2flow plans, TRL, ...; Ray is shut down while TRL runs), with the 1-minute
load average printed before and after each run; a round in which a run started above load 1.0 prints "machine busy"
instead of its ratio, and the summary ratios are medians over the quiet rounds. Prints the machine's matmul limit.

    python benchmarks/grpo_vs_trl.py                      # 3 rounds of 20 steps each after an 800-step SFT warm start
    python benchmarks/grpo_vs_trl.py --hidden 128 --layers 4 --max-new-tokens 8   # the ~1M-parameter workload
    python benchmarks/grpo_vs_trl.py --hidden 512 --layers 6 --sft-steps 300      # the ~20M-parameter workload
    python benchmarks/grpo_vs_trl.py --quick              # CI-sized smoke: tiny batch, few steps, 1 round
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers

from m2flow import config as C
from m2flow.engines.hf import init_tiny_model, load_model, load_tokenizer
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.evaluation import evaluate_model
from m2flow.reasoning.flow import train
from m2flow.reasoning.tasks.datasets import build_datasets
from m2flow.reasoning.tasks.rewards import exact_match
from m2flow.reasoning.warm_start import sft_model

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
PLANS = {  # name -> cluster.placement over D CPU devices of equal core slices (D = --cpu-devices, default 2)
    "pipelined": "rollout: 0; reward,inference,actor: {rest}",  # {rest}: devices 1..D-1
    "collocated": "rollout,reward,inference,actor: 0-{last}:0",  # all D devices, one process (rollout.cohost)
    "pipelined_async": "rollout: 0; reward,inference,actor: {rest}",
    "collocated_async": "rollout,reward,inference,actor: 0-{last}:0",
    "collocated_unshared": "rollout,reward,inference,actor: 0-{last}:0",
}


def device_sizes(text: str) -> int | list[int]:
    """--cpu-devices: '2' (a count) or '1,3' (each device's cores)."""
    sizes = [int(x) for x in text.split(",")]
    return sizes if len(sizes) > 1 else sizes[0]


def device_count(cpu_devices: int | list[int]) -> int:
    return len(cpu_devices) if isinstance(cpu_devices, list) else cpu_devices


def placement(plan: str, cpu_devices: int | list[int]) -> str:
    """The plan's cluster.placement on these CPU devices (on 2: rollout alone on device 0 when pipelined)."""
    devices = device_count(cpu_devices)
    return PLANS[plan].format(last=devices - 1, rest="1" if devices == 2 else f"1-{devices - 1}")


STALENESS = {"pipelined_async": 1, "collocated_async": 1}  # algorithm.max_staleness per plan (0 when absent)
EXTRA = {"collocated_unshared": ["actor.share_prompts=false"]}  # every prompt forwarded once per sample, as TRL does


# ---------------------------------------------------------------------------------------------- setup


def matmul_gflops(threads: int, n: int = 1024, repeats: int = 5) -> float:
    """fp32 GFLOP/s of an n x n torch.matmul on `threads` threads (best of `repeats`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        return 2 * n**3 / best / 1e9
    finally:
        torch.set_num_threads(before)


# The benchmark's own settings (not a preset, so that edits to configs/ cannot change what it measures).
BASE = {
    "model": {"tiny_hidden": 64, "tiny_layers": 2},
    "data": {"task": "arithmetic", "digits": 2, "ops": "+", "train_size": 5000, "eval_size": 500},
    "sft": {"batch_size": 64, "lr": 3e-3},
    "rollout": {"engine": "native", "temperature": 1.0, "top_p": 1.0, "top_k": 0},
    "algorithm": {"name": "grpo", "advantage": "grpo", "clip_low": 0.2, "clip_high": 0.28, "loss_agg": "token-mean"},
    "actor": {"lr_schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0, "grad_clip": 1.0,
              "mini_batches": 1, "epochs": 1, "micro_batch": 32},
}


def make_cfg(args, out: Path, name: str, extra: list[str] = ()) -> ReasoningConfig:
    """The shared config: BASE with this run's sizes (every system reads its settings from it)."""
    overrides = [f"model.tiny_hidden={args.hidden}", f"model.tiny_layers={args.layers}",
        f"run.dir={out}", f"run.name={name}", "run.overwrite=true", f"run.steps={args.steps}", f"run.seed={args.seed}",
        "run.save_every=0",
        "run.progress=false", "run.trace=false", f"sft.steps={args.sft_steps}",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"actor.lr={args.lr}", f"actor.micro_batch={args.micro_batch}", f"algorithm.kl_coef={args.kl_coef}",
        f"data.eval_size={args.eval_size}", *extra,
    ]
    return C.load(ReasoningConfig, BASE, overrides)


def start_model(args, out: Path) -> str:
    """A tiny model, SFT-warm-started (once per output folder and settings): the model every system starts from."""
    cfg = make_cfg(args, out, "start")
    tag = f"h{cfg.model.tiny_hidden}_l{cfg.model.tiny_layers}_sft{cfg.sft.steps}_seed{cfg.run.seed}"
    init, sft = out / f"init_{tag}", out / f"sft_{tag}"
    if not (init / "config.json").exists():
        init_tiny_model(init, hidden_size=cfg.model.tiny_hidden, num_layers=cfg.model.tiny_layers, seed=cfg.run.seed)
    if cfg.sft.steps <= 0:
        return str(init)
    if not (sft / "config.json").exists():
        t = time.perf_counter()
        tmp = out / f"{sft.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        sft_model(str(init), str(tmp), cfg, progress=False)
        tmp.rename(sft)
        print(f"  SFT warm start: {cfg.sft.steps} steps in {time.perf_counter() - t:.0f} s -> {sft}", flush=True)
    return str(sft)


def step_prompts(cfg: ReasoningConfig, model_path: str) -> list[dict]:
    """The prompts m2flow's flow draws for steps 0..steps-1, in order (what TRL is fed, unshuffled)."""
    train_set, _ = build_datasets(cfg.data, load_tokenizer(model_path), cfg.run.seed)
    return train_set.next_batch(cfg.run.steps * cfg.rollout.prompts_per_step)


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load avg {one:.1f} (1 min) {five:.1f} (5 min)"


# ---------------------------------------------------------------------------------------------- systems


def run_m2flow(args, out: Path, model_path: str, plan: str, cluster) -> dict:
    cfg = make_cfg(args, out, f"m2flow_{plan}", [f"model.path={model_path}", "sft.steps=0",
                                                 f"algorithm.max_staleness={STALENESS.get(plan, 0)}",
                                                 *EXTRA.get(plan, [])])
    cfg.cluster.placement = placement(plan, args.cpu_devices)
    shutil.rmtree(cfg.run.path, ignore_errors=True)
    t = time.perf_counter()
    result = train(cfg, cluster)
    wall = time.perf_counter() - t
    rows = [json.loads(line) for line in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines() if line]
    if len(rows) != cfg.run.steps:
        raise RuntimeError(f"m2flow {plan}: metrics.jsonl has {len(rows)} steps, expected {cfg.run.steps}")
    ranks = len(result["plan"]["placement"]["rollout"])  # rollout metrics are averaged over ranks
    return {"seconds": [r["time/step"] for r in rows], "tokens": [r["rollout/tokens"] * ranks for r in rows],
            "reward": [r["reward/mean"] for r in rows], "idle": [r["time/idle_fraction"] for r in rows], "wall": wall,
            "model": result["final_model"], "cfg": cfg}


def run_trl(args, out: Path, model_path: str) -> dict:
    try:
        import datasets
        import trl
        from transformers import PrinterCallback, TrainerCallback
    except ImportError as e:
        raise RuntimeError(f"TRL is not installed ({e}); `pip install trl datasets`") from None

    cfg = make_cfg(args, out, "trl")
    prompts = step_prompts(cfg, model_path)
    dataset = datasets.Dataset.from_list([{"prompt": p["prompt"], "answer": str(p["answer"])} for p in prompts])
    run_dir = cfg.run.path
    shutil.rmtree(run_dir, ignore_errors=True)
    stats = {"tokens": [], "reward": [], "seconds": []}

    def exact_match_reward(prompts, completions, completion_ids, answer, **_):
        """TRL decodes with skip_special_tokens (eos gone); completion_ids include the eos, as m2flow counts."""
        scores = [exact_match(c, a) for c, a in zip(completions, answer)]
        stats["tokens"].append(sum(len(ids) for ids in completion_ids))
        stats["reward"].append(sum(scores) / len(scores))
        return scores

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step: generation, reward, loss, backward and the AdamW step."""

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            stats["seconds"].append(time.perf_counter() - self.start)

    batch = cfg.rollout.prompts_per_step * cfg.rollout.n
    alg, actor = cfg.algorithm, cfg.actor
    names = {f.name for f in dataclasses.fields(trl.GRPOConfig)}  # transformers 5 renamed gradient checkpointing
    no_ckpt = {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": False}
    grpo = trl.GRPOConfig(
        output_dir=str(run_dir), use_cpu=True, bf16=False, fp16=False, **no_ckpt,
        seed=cfg.run.seed, max_steps=cfg.run.steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=cfg.rollout.n, max_completion_length=cfg.rollout.max_new_tokens, shuffle_dataset=False,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        learning_rate=actor.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=actor.weight_decay,
        max_grad_norm=actor.grad_clip, optim="adamw_torch_fused",
        loss_type="dapo", scale_rewards="group", num_iterations=1, epsilon=alg.clip_low, epsilon_high=alg.clip_high,
        beta=alg.kl_coef, use_bias_correction_kl=False,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    model = load_model(model_path).train()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=exact_match_reward, args=grpo, train_dataset=dataset,
                              processing_class=load_tokenizer(model_path), callbacks=[StepTimer()])
    trainer.remove_callback(PrinterCallback)  # no per-step log dicts on stdout
    t = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t
    if len(stats["seconds"]) != cfg.run.steps or len(stats["tokens"]) != cfg.run.steps:
        raise RuntimeError(f"TRL ran {len(stats['seconds'])} optimizer steps and {len(stats['tokens'])} generation "
                           f"rounds, expected {cfg.run.steps} of each")
    final = run_dir / "final_model"
    trainer.save_model(str(final))
    return {**stats, "wall": wall, "model": str(final), "cfg": cfg}


# ---------------------------------------------------------------------------------------------- report

BUSY = 1.0  # a run that starts above this 1-minute load average was disturbed by other jobs


def wait_quiet(limit: float) -> float:
    """Wait (at most `limit` s) until the 1-minute load average is at or below BUSY; returns the seconds waited. On 2
    cores a run that used both leaves the average near 2, and it decays with a 1-minute time constant (~45 s)."""
    start = time.monotonic()
    while os.getloadavg()[0] > BUSY and time.monotonic() - start < limit:
        time.sleep(2)
    return time.monotonic() - start


def median_step(r: dict, warmup: int) -> float:
    return statistics.median(r["seconds"][warmup:] or r["seconds"])


def print_rounds(runs: dict[str, list[dict]], warmup: int) -> dict[str, list[float]]:
    """One line per round: each system's median s/step with the load before -> after its run, and each m2flow plan's
    speedup over TRL in that round ("machine busy" where a run started above BUSY). Returns the quiet rounds' ratios."""
    ratios: dict[str, list[float]] = {}
    rounds = max(len(v) for v in runs.values())
    for i in range(rounds):
        cells, trl = [], runs.get("TRL GRPOTrainer", [None] * rounds)[i]
        for name, per_round in runs.items():
            r = per_round[i] if i < len(per_round) else None
            if r is None:
                continue
            cell = f"{name} {median_step(r, warmup):.3f} s (load {r['load_before']:.2f} -> {r['load_after']:.2f})"
            if trl is not None and name != "TRL GRPOTrainer":
                if max(r["load_before"], trl["load_before"]) > BUSY:
                    cell += " machine busy"
                else:
                    ratio = median_step(trl, warmup) / median_step(r, warmup)
                    ratios.setdefault(name, []).append(ratio)
                    cell += f" = {ratio:.2f}x TRL"
            cells.append(cell)
        print(f"round {i + 1}: " + "; ".join(cells))
    return ratios


def print_table(runs: dict[str, list[dict]], ratios: dict[str, list[float]], steps: int, warmup: int,
                failed: dict[str, str]) -> None:
    k = max(1, min(5, steps // 2))  # steps averaged for the train reward at the start and at the end
    header = (f"{'system / plan':<20} | {'median s/step':>13} | {'speedup vs TRL':>14} | {'idle':>5} | {'gen tok/s':>9} | "
              f"{f'train reward first{k}->last{k}':>26} | {f'held-out pass@1 after {steps}':>25} | {'pass@8':>6}")
    print(header)
    print("-" * len(header))
    for name, per_round in runs.items():
        first = per_round[0]
        medians = [median_step(r, warmup) for r in per_round]
        seconds = [x for r in per_round for x in r["seconds"][warmup:] or r["seconds"]]
        tokens = [x for r in per_round for x in r["tokens"][warmup:] or r["tokens"]]
        if name == "TRL GRPOTrainer":
            speed = "1.00x"
        elif ratios.get(name):
            speed = f"{statistics.median(ratios[name]):.2f}x"
        else:
            speed = "machine busy"
        idle = [x for r in per_round for x in r.get("idle", [])[warmup:]]
        reward = f"{statistics.mean(first['reward'][:k]):.3f} -> {statistics.mean(first['reward'][-k:]):.3f}"
        print(f"{name:<20} | {statistics.median(medians):>13.3f} | {speed:>14} | "
              f"{f'{statistics.median(idle):.0%}' if idle else 'n/a':>5} | {sum(tokens) / sum(seconds):>9.0f} | "
              f"{reward:>26} | {first['pass@1']:>25.1%} | {first['pass@8']:>6.1%}")
    for name, err in failed.items():
        print(f"{name:<20} | FAILED: {err}")


def main() -> int:
    global BUSY  # --busy-load
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="GRPO steps per run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds: every system runs once per round")
    ap.add_argument("--settle", type=float, default=120, help="before each run, wait up to this many seconds for the "
                    "1-minute load average to fall to 1.0 (the previous run's own load lingers in it)")
    ap.add_argument("--busy-load", type=float, default=BUSY, help="the 1-minute load average above which a run counts "
                    "as disturbed (1.0 suits a dedicated 2-core machine; on a dedicated machine with more cores, where "
                    "the previous run's own load lingers, raise it)")
    ap.add_argument("--sft-steps", type=int, default=800, help="SFT warm-start steps of the shared start model")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny Qwen2")
    ap.add_argument("--layers", type=int, default=2, help="layers of the tiny Qwen2")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (GRPO group size)")
    ap.add_argument("--max-new-tokens", type=int, default=5, help="max completion length, in tokens")
    ap.add_argument("--lr", type=float, default=1e-4, help="learning rate (constant; 5e-4 lowers the 800-step SFT "
                    "model's held-out accuracy in both systems)")
    ap.add_argument("--micro-batch", type=int, default=32, help="m2flow actor.micro_batch: samples per message when "
                    "pipelined (forward/backward parts follow actor.micro_batch_tokens, default 8192 padded tokens; TRL "
                    "runs the whole batch at once, per_device_train_batch_size = prompts x n)")
    ap.add_argument("--kl-coef", type=float, default=0.0, help="KL coefficient (m2flow algorithm.kl_coef = TRL beta)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the median (warm-up)")
    ap.add_argument("--plans", nargs="+", default=[p for p in PLANS if p not in EXTRA], choices=list(PLANS),
                    help="m2flow plans to run (*_async: algorithm.max_staleness=1; collocated_unshared: "
                         "actor.share_prompts=false)")
    ap.add_argument("--cpu-devices", type=device_sizes, default=2, help="CPU devices m2flow splits the cores into: "
                    "a count (equal slices) or each device's cores, e.g. 1,3 (cluster.cpu_devices); pipelined plans "
                    "put the rollout on device 0 and the other stages on the rest")
    ap.add_argument("--no-trl", action="store_true", help="run m2flow only")
    ap.add_argument("--trl-threads", type=int, default=CORES, help="torch threads of the TRL process (default: all cores)")
    ap.add_argument("--eval-size", type=int, default=500, help="held-out problems (greedy pass@1, pass@8)")
    ap.add_argument("--out", default="runs/bench_grpo_vs_trl", help="folder for models and runs")
    ap.add_argument("--quick", action="store_true", help="CI-sized smoke: 1 round of 3 steps, 8 prompts x 4, "
                    "20 SFT steps, 32 held-out problems")
    args = ap.parse_args()
    BUSY = args.busy_load
    if args.quick:
        args.steps, args.sft_steps, args.prompts, args.n, args.rounds = 3, 20, 8, 4, 1
        args.eval_size = 32
    if min(args.steps, args.prompts, args.max_new_tokens, args.trl_threads, args.eval_size, args.rounds) < 1 \
            or args.n < 2 or device_count(args.cpu_devices) < 2:
        ap.error("need --steps, --rounds, --prompts, --max-new-tokens, --trl-threads, --eval-size >= 1, "
                 "--n >= 2 and --cpu-devices >= 2")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no weight-loading bars in Ray workers (they inherit it)
    transformers.utils.logging.disable_progress_bar()  # nor here

    print(f"machine: {CORES} cores, torch {torch.__version__}; fp32 matmul limit (1024^3): "
          f"{matmul_gflops(1):.0f} GFLOP/s on 1 thread, {matmul_gflops(CORES):.0f} GFLOP/s on {CORES} threads; {load()}")
    model_path = start_model(args, out)
    params = sum(p.numel() for p in load_model(model_path).parameters())
    print(f"work per step: {args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} new tokens, "
          f"temperature 1.0, lr {args.lr:g} (constant), kl_coef {args.kl_coef:g}; model {params / 1e6:.2f}M parameters; "
          f"{args.rounds} rounds of {args.steps} steps, median over steps {args.warmup + 1}..{args.steps}", flush=True)
    eval_cfg = make_cfg(args, out, "eval")
    before = evaluate_model(model_path, eval_cfg, k=8)
    print(f"  start model: held-out pass@1 {before['pass@1']:.1%}, pass@8 {before['pass@8']:.1%} "
          f"({before['problems']} problems)", flush=True)

    runs: dict[str, list[dict]] = {}
    failed: dict[str, str] = {}

    def attempt(name: str, fn, evaluate: bool) -> None:
        waited = wait_quiet(args.settle)  # the previous run's own load lingers in the 1-minute average
        before_load = os.getloadavg()[0]
        if waited:
            print(f"  waited {waited:.0f} s for the load to settle", flush=True)
        print(f"  running {name} ... ({load()})", flush=True)
        try:
            r = fn()
            r["load_before"], r["load_after"] = before_load, os.getloadavg()[0]
            if evaluate:
                r.update(evaluate_model(r["model"], eval_cfg, k=8))
            runs.setdefault(name, []).append(r)
            print(f"  {name}: median {median_step(r, args.warmup):.3f} s/step, wall {r['wall']:.0f} s "
                  f"(load {r['load_before']:.2f} -> {r['load_after']:.2f})", flush=True)
        except Exception as e:  # one failing system must not hide the others' numbers
            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    from m2flow.runtime import Cluster

    for i in range(args.rounds):
        if args.plans:
            cluster = Cluster(cpu_devices=args.cpu_devices)  # m2flow and TRL both get every core
            try:
                if i == 0:
                    plans = "; ".join(f"{p} = '{placement(p, args.cpu_devices)}'" for p in args.plans)
                    print(f"  {cluster!r}; plans: {plans}", flush=True)
                for plan in args.plans:
                    attempt(f"m2flow {plan}", lambda plan=plan: run_m2flow(args, out, model_path, plan, cluster), i == 0)
            finally:
                cluster.shutdown()  # no Ray daemons beside TRL
        if not args.no_trl:
            torch.set_num_threads(args.trl_threads)
            attempt("TRL GRPOTrainer", lambda: run_trl(args, out, model_path), i == 0)

    print()
    print(f"GRPO on {args.prompts} prompts x {args.n} samples per step (2-digit addition, tiny Qwen2 "
          f"h{args.hidden}/l{args.layers}, {params / 1e6:.2f}M parameters, SFT {args.sft_steps} steps), "
          f"{args.steps} steps; start model held-out pass@1 {before['pass@1']:.1%}, pass@8 {before['pass@8']:.1%}")
    ratios = print_rounds(runs, args.warmup) if runs else {}
    print_table(runs, ratios, args.steps, args.warmup, failed)
    record = {"args": vars(args), "cores": CORES, "start": before, "failed": failed, "ratios": ratios,
              "systems": {n: [{k: v for k, v in r.items() if k != "cfg"} for r in rs] for n, rs in runs.items()}}
    (out / "results.json").write_text(json.dumps(record, indent=1))
    for plan in args.plans:
        print(f"m2flow {plan}: cluster.placement '{placement(plan, args.cpu_devices)}'"
              + (f", algorithm.max_staleness={STALENESS[plan]}" if plan in STALENESS else ""))
    sizes = args.cpu_devices if isinstance(args.cpu_devices, list) else [max(1, CORES // args.cpu_devices)]
    print(f"threads: m2flow pipelined = one process per component and rank, pinned to its device's core(s) "
          f"({'/'.join(map(str, sizes))}), one torch thread per core; m2flow collocated = one process for all four "
          f"components (rollout.cohost) over all {CORES} cores, {CORES} threads, the stages taking turns; TRL = this "
          f"process, torch.set_num_threads({args.trl_threads}).")
    print(f"median s/step = median over rounds of each run's median step; speedup vs TRL = median over quiet rounds of "
          f"TRL's median s/step / the plan's in the same round; idle = m2flow's time/idle_fraction (median step); "
          f"per-step numbers: {out / 'results.json'}")
    print("gen tok/s = generated tokens (eos included) / step time, over the timed steps; held-out (first round's "
          f"models) = {before['problems']} problems, greedy; pass@8 = any of 8 samples at temperature 1.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
