"""The main job (`make demo`): a tiny model, an SFT warm start on synthetic arithmetic, then GRPO through the API;
held-out accuracy before and after. It sits beside the API and the CLI, above the flows: it runs a flow, no flow
imports it.
"""

from __future__ import annotations

import time

from m2flow import config as C
from m2flow.api import train
from m2flow.preflight import preflight
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.evaluation import evaluate_model
from m2flow.reasoning.warm_start import prepare_model
from m2flow.run_dir import holds_run, run_dir_claimed


def run_demo(overrides: list[str] | None = None, cluster=None) -> dict:
    """`make demo`: SFT warm start, held-out evaluation, GRPO (held-out pass@1 every `run.eval_every` steps), the
    evaluation again, a summary table and the line `held-out accuracy: BEFORE% -> AFTER%`."""
    cfg = C.load(ReasoningConfig, "demo", overrides)
    preflight(cfg)  # before the warm start: a mistake costs a second, not the minutes before GRPO starts
    t0 = time.perf_counter()
    replaced = holds_run(cfg.run.path) if cfg.run.overwrite else ""
    print(f"[m2flow demo] run directory: {cfg.run.path}" + (f" (the earlier run there, {replaced}, is replaced: "
                                                            f"run.overwrite)" if replaced else ""))
    with run_dir_claimed(cfg.run.path, cfg.run.resume, cfg.run.overwrite):  # the warm start and GRPO: one run
        until = (f"up to {cfg.sft.steps} steps, until greedy decoding answers {cfg.sft.target_accuracy:.0%} of "
                 f"{cfg.sft.val_size} held-back problems" if cfg.sft.target_accuracy and cfg.sft.steps
                 else f"{cfg.sft.steps} steps")
        width = f", answers as {cfg.data.answer_width} digits" if cfg.data.answer_width else ""
        print(f"[m2flow demo] 1/3 tiny model (hidden {cfg.model.tiny_hidden}, {cfg.model.tiny_layers} layers) + SFT "
              f"warm start ({until}) on {cfg.data.digits}-digit arithmetic{width}")
        start_model = prepare_model(cfg, cfg.run.path)
        before = evaluate_model(start_model, cfg)
        print(f"[m2flow demo]     held-out after SFT: pass@1 {before['pass@1']:.1%}, pass@8 {before['pass@8']:.1%}")
        every = f", held-out pass@1 every {cfg.run.eval_every} steps" if cfg.run.eval_every else ""
        print(f"[m2flow demo] 2/3 GRPO, {cfg.run.steps} steps, placement '{cfg.cluster.placement}'{every}")
        t1 = time.perf_counter()
        result = train(cfg, cluster=cluster)
    grpo_seconds = time.perf_counter() - t1
    print("[m2flow demo] 3/3 held-out evaluation of the trained policy")
    after = evaluate_model(str(result.final_model), cfg)
    run = result.run_dir
    print(f"[m2flow demo]     held-out after GRPO: pass@1 {after['pass@1']:.1%}, pass@8 {after['pass@8']:.1%}")
    print(f"[m2flow demo] curves: {run / 'plots'} (held-out accuracy: heldout_accuracy.png)  tensorboard: {run / 'tb'}  "
          f"trace: {run / 'trace.json'} (open in https://ui.perfetto.dev)  metrics: {run / 'metrics.jsonl'}")
    samples = cfg.run.steps * cfg.rollout.prompts_per_step * cfg.rollout.n
    print(summary(before, after, cfg.run.steps, samples, grpo_seconds, time.perf_counter() - t0, before["problems"]))
    print(f"held-out accuracy: {before['pass@1']:.1%} -> {after['pass@1']:.1%}")
    return {"before": before, "after": after, "run_dir": str(run)}


def summary(before: dict, after: dict, steps: int, samples: int, grpo_seconds: float, total_seconds: float,
            problems: int) -> str:
    """The demo's closing table: held-out pass@1 and pass@8 before and after GRPO, and what the GRPO part cost."""
    rows = [f"{'':12s} {'pass@1 (greedy)':>16s} {'pass@8':>8s}   on {problems} held-out problems"]
    for name, r in (("after SFT", before), ("after GRPO", after)):
        rows.append(f"{name:12s} {r['pass@1']:>16.1%} {r['pass@8']:>8.1%}")
    rows.append(f"{'change':12s} {100 * (after['pass@1'] - before['pass@1']):>+15.1f}p "
                f"{100 * (after['pass@8'] - before['pass@8']):>+7.1f}p")
    rows.append(f"GRPO: {steps} steps, {samples:,} samples, {grpo_seconds:.0f} s; whole demo {total_seconds:.0f} s")
    return "\n".join(rows)
