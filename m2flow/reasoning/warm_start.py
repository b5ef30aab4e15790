"""The model a reasoning run starts from: `model.path`, or a tiny model built from the config, then an optional
supervised warm start (SFT) on the task's reference answers. Used by the flows, the profilers and the examples."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import torch

from m2flow.engines.hf import load_tokenizer
from m2flow.reasoning.tasks.tools import tool_trace

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
    from m2flow.engines.train import exact_match, sft

    torch.manual_seed(cfg.run.seed)
    model, tok = load_model(model_path), load_tokenizer(model_path)
    pairs, held_back = _pairs(cfg)  # one draw of the training split for both
    losses = sft(model, tok, pairs, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size, lr=cfg.sft.lr,
                 seed=cfg.run.seed, progress=progress, target_accuracy=cfg.sft.target_accuracy,
                 val_pairs=held_back, val_every=cfg.sft.val_every)
    if held_back:
        reached = len(losses) < cfg.sft.steps
        print(f"[m2flow sft] {'stopped after' if reached else 'ran all'} {len(losses)} of {cfg.sft.steps} steps: "
              f"greedy exact match {exact_match(model, tok, held_back):.1%} on {len(held_back)} held-back training "
              f"problems ({'reached' if reached else 'short of'} sft.target_accuracy={cfg.sft.target_accuracy:g})")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return losses


def sft_pairs(cfg) -> list[tuple[str, str]]:
    """(prompt, reference response) of every training problem the warm start trains on; with a calc tool, a seeded
    `sft.tool_fraction` of the references call it and the others answer directly."""
    return _pairs(cfg)[0]


def validation_pairs(cfg) -> list[tuple[str, str]]:
    """The `sft.val_size` training-split problems held back from the warm start, which `sft.target_accuracy` is
    measured on (none without a target): synthetic tasks draw them after the `data.train_size` problems RL trains
    on, a file gives the last of its training records (which the warm start then leaves out)."""
    return _pairs(cfg)[1]


def _pairs(cfg) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    from m2flow.reasoning.tasks.datasets import task_records

    held_back = cfg.sft.val_size if cfg.sft.target_accuracy else 0
    if cfg.data.task == "file":
        records = task_records(cfg.data, cfg.run.seed, "train")
        held_back = min(held_back, len(records) // 2)
        cut = len(records) - held_back
    else:
        cut = cfg.data.train_size
        records = task_records(replace(cfg.data, train_size=cut + held_back), cfg.run.seed, "train")
    draw = random.Random(cfg.run.seed)
    pairs = [(r["prompt"], reference(r, cfg.agent.tools, draw.random() < cfg.sft.tool_fraction)) for r in records]
    return pairs[:cut], pairs[cut:]


def reference(record: dict, tools: dict, use_tool: bool = True) -> str:
    """The response SFT teaches for a record: its solution; with a calculator among the agent's tools, a record
    that has an `expression` (arithmetic) and `use_tool`, a tool-use trace that asks the calculator, reads its result
    and answers (`<calc>37+45</calc><result>82</result>82`), so that RL starts from a model that knows the format."""
    calc = next((name for name, spec in tools.items() if spec == "calc"), None)
    answer = str(record.get("solution", record["answer"]))
    if calc is None or "expression" not in record or not use_tool:
        return answer
    return tool_trace(calc, record["expression"], str(record["answer"]))
