"""The model a reasoning run starts from: `model.path`, or a tiny model built from the config, then an optional
supervised warm start (SFT) on the task's reference answers. Used by the flows, the profilers and the examples."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from m2flow.engines.hf import load_tokenizer
from m2flow.workloads.reasoning.tools import tool_trace

def prepare_model(cfg, run_path: Path) -> str:
    """The model directory RL starts from: `model.path`, or a tiny model built into the run directory;
    then, with `sft.steps`, a supervised warm start on the task's reference answers (done once)."""
    path = cfg.model.path
    if not path:
        from m2flow.engines.hf import init_tiny_model

        path = str(run_path / "init_model")
        if not (Path(path) / "config.json").exists():
            init_tiny_model(path, arch=cfg.model.tiny_arch, hidden_size=cfg.model.tiny_hidden,
                            num_layers=cfg.model.tiny_layers, seed=cfg.run.seed)
    if cfg.sft.steps > 0:
        out = run_path / "sft_model"
        if not (out / "config.json").exists():
            sft_model(path, str(out), cfg, progress=cfg.run.progress)
        path = str(out)
    return str(Path(path).resolve())  # absolute: worker processes do not share the driver's working directory


def sft_model(model_path: str, out: str, cfg, progress: bool = True) -> list[float]:
    """Fine-tune `model_path` on the train split's reference answers; writes an HF directory to `out`."""
    from m2flow.engines.hf import load_model
    from m2flow.engines.train import sft

    torch.manual_seed(cfg.run.seed)
    model, tok = load_model(model_path), load_tokenizer(model_path)
    losses = sft(model, tok, sft_pairs(cfg), steps=cfg.sft.steps, batch_size=cfg.sft.batch_size, lr=cfg.sft.lr,
                 seed=cfg.run.seed, progress=progress, target_accuracy=cfg.sft.target_accuracy)
    if len(losses) < cfg.sft.steps:
        print(f"[m2flow sft] stopped after {len(losses)} of {cfg.sft.steps} steps: the training batches' exact match "
              f"reached sft.target_accuracy={cfg.sft.target_accuracy:g}")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return losses


def sft_pairs(cfg) -> list[tuple[str, str]]:
    """(prompt, reference response) of every training problem; with a calc tool, a seeded `sft.tool_fraction` of the
    references call it and the others answer directly."""
    from m2flow.workloads.reasoning.tasks import task_records

    draw = random.Random(cfg.run.seed)
    return [(r["prompt"], reference(r, cfg.agent.tools, draw.random() < cfg.sft.tool_fraction))
            for r in task_records(cfg.data, cfg.run.seed, "train")]


def reference(record: dict, tools: dict, use_tool: bool = True) -> str:
    """The response SFT teaches for a record: its solution; with a calculator among the agent's tools, a record
    that has an `expression` (arithmetic) and `use_tool`, a tool-use trace that asks the calculator, reads its result
    and answers (`<calc>37+45</calc><result>82</result>82`), so that RL starts from a model that knows the format."""
    calc = next((name for name, spec in tools.items() if spec == "calc"), None)
    answer = str(record.get("solution", record["answer"]))
    if calc is None or "expression" not in record or not use_tool:
        return answer
    return tool_trace(calc, record["expression"], str(record["answer"]))
