"""The Python API: what the `m2flow` command does, as functions (`import m2flow`; docs/api.md).

    cfg = m2flow.load_config("grpo_arithmetic", ["run.steps=50"])
    result = m2flow.train(cfg)                       # a TrainResult: metrics, run_dir, plan, final_model
    scores = m2flow.evaluate(result.final_model)      # held-out pass@1 / pass@k under the run's config

Nothing heavy is imported until a function is called: `import m2flow` stays fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any

__all__ = ["TrainResult", "load_config", "train", "evaluate", "measure_plan"]


@dataclass
class TrainResult:
    """What a training run left behind."""

    flow: str  # "reasoning" | "embodied"
    run_dir: Path  # runs/NAME: config.yaml, plan.yaml, metrics.jsonl, tb/, plots/, checkpoints/
    metrics: dict  # the last step's metrics
    plan: dict  # the execution plan that ran: placement, mode, granularity
    final_model: Path | None  # reasoning: the last checkpoint's HF model directory; embodied: the last checkpoint
    config: Any  # the resolved ReasoningConfig or EmbodiedConfig

    def history(self) -> list[dict]:
        """Every row of metrics.jsonl, in step order."""
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def load_config(config: Any, overrides: list[str] | None = None):
    """A ReasoningConfig or EmbodiedConfig from a preset name (`"grpo_arithmetic"`), a YAML path, a dict or a config
    object, with dotted overrides (`["run.steps=5", "actor.lr=1e-4"]`). A file's or dict's `flow:` key picks the
    class (reasoning when absent). Bad fields raise `m2flow.config.ConfigError` naming the field."""
    from m2flow import config as C
    from m2flow.embodied.config import EmbodiedConfig
    from m2flow.reasoning.config import ReasoningConfig

    flows = {"reasoning": ReasoningConfig, "embodied": EmbodiedConfig}
    if isinstance(config, tuple(flows.values())):
        return C.load(type(config), C.to_dict(config), overrides) if overrides else config
    data = dict(config) if isinstance(config, dict) else C.read_yaml(C.resolve_path(config))
    flow = data.get("flow", "reasoning")
    if flow not in flows:
        where = "(a dict)" if isinstance(config, dict) else f"'{config}'"
        raise C.ConfigError(f"config {where}: flow must be reasoning | embodied, got '{flow}'")
    return C.load(flows[flow], data, overrides)


def train(config: Any, overrides: list[str] | None = None, cluster=None) -> TrainResult:
    """Train from a preset, path, dict or config object (see load_config) on `cluster` (an m2flow.runtime.Cluster;
    default: the config's `cluster.address`, else a local Ray instance). The plan is chosen first, then handed to the
    flow: the one `cluster.placement` names, or with `auto` the fastest the planner predicts from a profile of this
    run's components (profile.json, plan_candidates.txt and, after training, plan_report.json in the run directory)."""
    from m2flow.preflight import preflight
    from m2flow.reasoning.config import ReasoningConfig
    from m2flow.run_dir import run_dir_claimed
    from m2flow.runtime import Cluster

    cfg = load_config(config, overrides)
    preflight(cfg)  # placement, model, data, reward, env: a mistake found before Ray starts
    auto = cfg.cluster.placement == "auto"
    reasoning_run = isinstance(cfg, ReasoningConfig)
    # the run directory first: a run already there is refused (or resumed, or removed) before anything starts
    with run_dir_claimed(cfg.run.path, cfg.run.resume, cfg.run.overwrite):
        cluster = cluster or Cluster(cfg.cluster.address, cfg.cluster.cpu_devices,
                                     reuse_processes=cfg.cluster.reuse_processes)
        plan = None  # the flow makes the plan the placement names
        if auto:
            from m2flow.auto import choose_plan

            cfg, plan = choose_plan(cfg, cluster, cfg.run.path)
        # the run's flow alone: the reasoning flow's imports (transformers) take seconds an embodied run never needs
        if reasoning_run:
            from m2flow.reasoning import flow
        else:
            from m2flow.embodied import flow
        out = flow.train(cfg, cluster, plan)
        if auto:
            from m2flow.auto import write_plan_report

            write_plan_report(out["run_dir"], "time/step" if reasoning_run else "time/iteration")
    if reasoning_run:
        return TrainResult("reasoning", Path(out["run_dir"]), out["metrics"], out["plan"], Path(out["final_model"]), cfg)
    final = Path(out["checkpoint"]) if out.get("checkpoint") else None
    return TrainResult("embodied", Path(out["run_dir"]), out["metrics"], out["plan"], final, cfg)


def measure_plan(config: Any, placement: str, granularity: int, run_dir: str | Path, steps: int = 3,
                 cluster=None) -> float:
    """Time one plan by training it: `steps` steps (embodied: iterations) of the config's flow with placement
    `placement` at `granularity` (reasoning: samples per message, `actor.micro_batch`; embodied: env pipeline
    stages), in `run_dir` (a run already there is replaced); returns the median step time, the first step left
    out. What benchmarks/plans.py and the auto-mode tests put beside the planner's predictions."""
    from m2flow.auto import measured_step_seconds
    from m2flow.embodied.config import EmbodiedConfig

    cfg = load_config(config)
    run_dir = Path(run_dir)
    cfg = dc_replace(cfg, run=dc_replace(cfg.run, dir=str(run_dir.parent), name=run_dir.name, steps=steps, trace=False,
                                         progress=False, save_every=0, resume=False, overwrite=True),
                     cluster=dc_replace(cfg.cluster, placement=placement))
    if isinstance(cfg, EmbodiedConfig):  # without evaluation or an early stop
        cfg = dc_replace(cfg, env=dc_replace(cfg.env, pipeline_stages=granularity), eval=dc_replace(cfg.eval, episodes=0),
                         run=dc_replace(cfg.run, eval_every=0, stop_return=None))
        key = "time/iteration"
    else:
        cfg, key = dc_replace(cfg, actor=dc_replace(cfg.actor, micro_batch=granularity)), "time/step"
    return measured_step_seconds(train(cfg, cluster=cluster).history(), key)


def evaluate(path: str | Path, overrides: list[str] | None = None, k: int = 8, limit: int | None = None,
             episodes: int = 10, video_dir: str | None = None) -> dict:
    """Evaluate a checkpoint, a run directory (its newest checkpoint) or a model directory.

    Reasoning: greedy pass@1 and sampled pass@k on the held-out split, under the run's config (overrides on top; a
    bare model directory gets the defaults); the result also names the `model`, the `config` it came from and the
    `data`. Embodied: `episodes` deterministic episodes: return mean/std, length, success rate where reported."""
    p = Path(path)
    if (p / "policy.safetensors").exists() or any(p.glob("checkpoints/*/policy.safetensors")):
        from m2flow.embodied.evaluation import evaluate_checkpoint

        return evaluate_checkpoint(p, episodes=episodes, video_dir=video_dir)
    from m2flow.reasoning.evaluation import describe_eval_data, eval_config, evaluate_model

    model, cfg, source = eval_config(str(p), overrides)
    about = {"model": model, "config": source, "data": describe_eval_data(cfg.data, cfg.run.seed),
             "reward": cfg.reward.fn, "max_new_tokens": cfg.rollout.max_new_tokens}
    return {**about, **evaluate_model(model, cfg, k=k, limit=limit)}
