"""`m2flow eval` for the embodied flow: a checkpoint's policy run deterministically in fresh envs, in this process
(success per task for a multi-task env.id, a video where the env renders frames)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from m2flow import config as C
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.envs import maniskill
from m2flow.embodied.workers.actor import load_policy
from m2flow.embodied.workers.env import make_env_group, video_recorder
from m2flow.embodied.workers.policy import make_policy
from m2flow.run_dir import latest_checkpoint, progress


def evaluate_checkpoint(path: str | Path, episodes: int = 10, video_dir: str | None = None,
                        show: bool = True) -> dict:
    """Run a checkpoint's policy (or a run directory's newest one) deterministically, with the mode of its action
    distribution, for `episodes` episodes (each env's first episode per round) under the saved obs normalization,
    frozen. Returns mean/std return, mean length, the success rate where the env reports success, and the video
    folder if `video_dir` (env 0's first episode, recorded where the env renders rgb_array frames). `show`: a progress
    bar over the episodes (lines at each tenth where stderr is a file)."""
    path = Path(path)
    if not (path / "policy.safetensors").exists() and (found := latest_checkpoint(path)):  # a run directory: its newest
        path = found[1]
    if not (path / "policy.safetensors").exists():
        raise FileNotFoundError(f"{path}: no policy.safetensors (expected an embodied checkpoint or run directory)")
    cfg = C.load(EmbodiedConfig, C.read_yaml(path / "config.yaml"))
    n = max(1, min(episodes, cfg.eval.num_envs))
    render = "rgb_array" if video_dir else None  # pixel envs too: the video is the render camera's view
    group = make_env_group(cfg, n, cfg.eval.seed, training=False, render_mode=render, seed_groups=1,
                           wrap=video_recorder(video_dir) if video_dir else None)
    if (path / "env_0.safetensors").exists():
        from safetensors.torch import load_file

        group.load_state_dict(load_file(str(path / "env_0.safetensors")))
    policy = make_policy(cfg, group.observation_space, group.action_space).eval()
    load_policy(policy, path)
    found: list[dict] = []
    with torch.no_grad(), progress(show) as bar:
        task = bar.add_task("evaluation", total=episodes, info=str(path))
        for rnd in range(-(-episodes // n)):
            obs, first = group.reset(seed=cfg.eval.seed + rnd * n), {}
            while len(first) < n:
                actions = policy.act(torch.as_tensor(obs), deterministic=True)[0]
                obs = (group.step_chunk(actions) if cfg.env.chunk > 1 else group.step(actions)).obs
                for e in group.pop_episodes():
                    first.setdefault(e["env_index"], e)
            found += [first[i] for i in sorted(first)]
            bar.update(task, completed=min(len(found), episodes))
    group.close()
    found = found[:episodes]
    returns = np.array([e["return"] for e in found])
    out = {"episodes": len(found), "return_mean": float(returns.mean()), "return_std": float(returns.std()),
           "length_mean": float(np.mean([e["length"] for e in found]))}
    flags = [e["success_once"] for e in found if "success_once" in e]
    if flags:
        out["success_rate"] = float(np.mean(flags))
    if flags:  # a multi-task group's episodes name their task
        for task in maniskill.task_ids(cfg.env.id):
            mine = [e["success_once"] for e in found if e.get("task") == task]
            if mine:
                out[f"success_rate/{task}"] = float(np.mean(mine))
    if video_dir:
        out["video_dir"] = str(video_dir)
    return out
