"""Evaluation of a reasoning model (`m2flow eval`, the demo's before and after): greedy pass@1 and sampled pass@k on
the held-out split, under the config of the run the model comes from."""

from __future__ import annotations

from pathlib import Path

from m2flow import config as C
from m2flow.engines.hf import load_model, load_tokenizer
from m2flow.reasoning.config import DataConfig, ReasoningConfig
from m2flow.reasoning.tasks.datasets import build_datasets, reward_name, reward_timeout
from m2flow.reasoning.tasks.evaluate import evaluate
from m2flow.run_dir import latest_checkpoint


def model_dir(path: str) -> str:
    """A model directory, or a checkpoint directory holding one under model/."""
    p = Path(path)
    return str(p / "model") if (p / "model" / "config.json").exists() else str(p)


def eval_config(path: str, overrides: list[str] | None = None) -> tuple[str, ReasoningConfig, str]:
    """What `m2flow eval PATH` evaluates: (model directory, config, where the config came from). A run directory
    means its newest checkpoint; a checkpoint (or its model/ directory) is evaluated under its run's config (data,
    reward, generation length: the checkpoint's config.yaml, else the run directory's), `overrides` on top; a bare
    model directory under the defaults."""
    p = Path(path)
    if not (p / "config.json").exists() and not (p / "model").is_dir() and (found := latest_checkpoint(p)):
        p = found[1]  # a run directory
    ckpt = p.parent if p.name == "model" and p.parent.parent.name == "checkpoints" else p
    candidates = [ckpt / "config.yaml"] + ([ckpt.parent.parent / "config.yaml"] if ckpt.parent.name == "checkpoints"
                                           else [])
    saved = [c for c in candidates if c.exists()]
    base = C.read_yaml(saved[0]) if saved else None
    source = f"the run's config ({saved[0]})" if saved else "the default config"
    return model_dir(str(p)), C.load(ReasoningConfig, base, overrides), source


def describe_eval_data(data: DataConfig, seed: int) -> str:
    """The held-out split in words, e.g. `2-digit '+' arithmetic (seed 0), held-out split of 200 problems`."""
    if data.task == "file":
        return f"{data.path}, held-out split (its last {data.eval_size} records)"
    what = f"{data.digits}-digit '{data.ops}' arithmetic" if data.task == "arithmetic" else data.task
    return f"{what} (seed {seed}), held-out split of {data.eval_size} problems"


def evaluate_model(path: str, cfg: ReasoningConfig, k: int = 8, limit: int | None = None) -> dict:
    """Greedy pass@1 and sampled pass@k of a model directory on the held-out split of `cfg.data`."""
    from m2flow.reasoning.workers.rollout import agent_hook, build_engine

    path = model_dir(path)
    model, tok = load_model(path).eval(), load_tokenizer(path)
    _, test = build_datasets(cfg.data, tok, cfg.run.seed)
    items = [test[i] for i in range(len(test) if limit is None else min(limit, len(test)))]
    engine = build_engine(cfg.rollout.engine, model, tok, cfg.rollout.max_slots,
                          cfg.data.max_prompt_len + cfg.rollout.max_new_tokens + 1, tools=bool(cfg.agent.tools))
    name = reward_name(cfg.reward.fn, cfg.data.task)
    return evaluate(engine, tok, items, name, k=k, max_new_tokens=cfg.rollout.max_new_tokens,
                    temperature=cfg.rollout.temperature, seed=cfg.run.seed, timeout_s=reward_timeout(name, cfg.reward.timeout_s),
                    tool_hook=agent_hook(cfg.agent, tok))
