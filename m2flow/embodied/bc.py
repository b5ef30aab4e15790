"""Behaviour cloning: an actor-critic fitted to demonstrations (the datasets of `experts.write_demos`), as the warm
start RL then fine-tunes (RLinf starts RL from a supervised policy).

The actor maximises the Gaussian log-likelihood of the demonstrated actions (its mean and its state-independent std
both learn: the std BC ends with is the exploration PPO starts from); with action chunks of k, row t's target is the
next k demonstrated actions of its episode (the last repeated past the episode's end). The critic regresses the
discounted return of each demonstrated step (Monte Carlo, `gamma`), so PPO's first advantages are not against an
untrained value. Pure torch on given arrays: no envs, no workers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .envs.maniskill import RENDER_TRIANGLES
from .envs.packed import PackedLayout
from .policies import ActorCritic


def bc_dataset(arrays: dict[str, np.ndarray], summary: dict, chunk: int = 1, gamma: float = 0.99,
               episodes: int | None = None, successful_only: bool = True) -> dict[str, torch.Tensor]:
    """obs [N, D], actions [N, (chunk,) A] and returns [N] of the first `episodes` demonstrations (all if None), failed
    ones left out when `successful_only`."""
    info = summary["episodes"][:episodes] if episodes is not None else summary["episodes"]
    keep = [i for i, e in enumerate(info) if e["success"] or not successful_only]
    if not keep:
        raise ValueError(f"no {'successful ' if successful_only else ''}demonstrations among the first {len(info)} "
                         f"episodes of the dataset ({summary.get('task', '?')})")
    obs, actions, returns = [], [], []
    for i in keep:
        rows = np.flatnonzero(arrays["episode"] == i)
        acts, rewards = arrays["actions"][rows], arrays["rewards"][rows].astype(np.float64)
        if chunk > 1:  # row t: actions t .. t+k-1, the last one repeated past the end
            index = np.minimum(np.arange(len(rows))[:, None] + np.arange(chunk)[None, :], len(rows) - 1)
            acts = acts[index]
        ret, g = np.zeros(len(rows)), 0.0
        for t in range(len(rows) - 1, -1, -1):
            g = rewards[t] + gamma * g
            ret[t] = g
        obs.append(arrays["obs"][rows])
        actions.append(acts)
        returns.append(ret)
    rows_obs = torch.from_numpy(np.concatenate(obs))
    return {"obs": rows_obs if rows_obs.dtype == torch.uint8 else rows_obs.float(),  # packed pixel rows stay bytes
            "actions": torch.as_tensor(np.concatenate(actions), dtype=torch.float32),
            "returns": torch.as_tensor(np.concatenate(returns), dtype=torch.float32),
            "episodes": torch.tensor(len(keep))}


def _datasets(demos: str, env_id: str, instruct: bool, pixels: bool = False, image_size: int = 64,
              render_triangles: int = RENDER_TRIANGLES, wrist_camera: bool = False):
    """(summary, arrays) of each demonstration directory in `demos` (comma-separated), checked against the config's
    `env_id` and observations (`pixels` at `image_size`, rendered with `render_triangles`, the hand camera's frames
    too with `wrist_camera`), the observations as the policy sees them (`instruct`: the instruction's words, then the
    state padded)."""
    from .envs import maniskill
    from .envs.experts import load_demos

    tasks = maniskill.task_ids(env_id)
    for where in demos.split(","):
        summary, arrays = load_demos(where)
        if summary["task"] not in tasks:
            raise ValueError(f"{where}: demonstrations of {summary['task']}, but the config's env.id is {env_id}")
        theirs = (bool(summary.get("pixels")), summary.get("image_size") if summary.get("pixels") else None)
        flags = f" --pixels --image-size {image_size}" if pixels else ""
        if pixels and render_triangles != RENDER_TRIANGLES:
            flags += f" --render-triangles {render_triangles}"
        if pixels and wrist_camera:
            flags += " --wrist-camera"
        if theirs != (pixels, image_size if pixels else None):
            seen = f"pixels at {theirs[1]}x{theirs[1]}" if theirs[0] else "state observations"
            raise ValueError(f"{where}: demonstrations of {seen}, but the config observes "
                             f"{f'pixels at {image_size}x{image_size}' if pixels else 'states'} (record them with "
                             f"`m2flow demos {summary['task']}{flags}`)")
        # datasets from before env.render_triangles rendered the meshes as shipped (0)
        recorded = summary.get("render_triangles", 0)
        if pixels and recorded != render_triangles:
            raise ValueError(f"{where}: demonstrations rendered with render_triangles={recorded}, but the config's "
                             f"env.render_triangles is {render_triangles} (the frames would differ; record them "
                             f"with `m2flow demos {summary['task']}{flags}`)")
        if pixels and summary.get("joint_velocities", True):  # pixel datasets from before 2026-12-06 held them
            raise ValueError(f"{where}: demonstrations whose proprioception holds the joints' velocities, which pixel "
                             f"observations no longer do (record them again with `m2flow demos "
                             f"{summary['task']}{flags}`)")
        if pixels and not summary.get("progress", False):  # pixel datasets from before 2026-12-06 (later) lacked it
            raise ValueError(f"{where}: demonstrations without the episode's progress in their observations, which "
                             f"pixel observations carry now (record them again with `m2flow demos "
                             f"{summary['task']}{flags}`)")
        recorded = bool(summary.get("wrist_camera", False))  # datasets from before env.wrist_camera had none
        if pixels and recorded != wrist_camera:
            raise ValueError(f"{where}: demonstrations {'with' if recorded else 'without'} the hand camera's frames, "
                             f"but the config's env.wrist_camera is {str(wrist_camera).lower()} (record them with "
                             f"`m2flow demos {summary['task']}{flags}`)")
        if instruct:
            arrays["obs"] = maniskill.instruction_obs(maniskill.tokenize(summary["instruction"]).astype(np.float32),
                                                      arrays["obs"])
        yield summary, arrays


def demo_data(demos: str, env_id: str, instruct: bool = False, chunk: int = 1, gamma: float = 0.99,
              episodes: int | None = None, pixels: bool = False, image_size: int = 64,
              render_triangles: int = RENDER_TRIANGLES, wrist_camera: bool = False) -> dict[str, torch.Tensor]:
    """`bc_dataset` of the demonstration directories `demos` (`m2flow demos`; comma-separated, one per task of a
    multi-task `env_id`), concatenated, their observations as the policy sees them (`instruct`: the instruction's
    words, then the state padded; `pixels`: packed pixel rows at `image_size` rendered with `render_triangles`, with
    the hand camera's frames when `wrist_camera`, which the dataset must hold)."""
    parts = [bc_dataset(arrays, summary, chunk=chunk, gamma=gamma, episodes=episodes)
             for summary, arrays in _datasets(demos, env_id, instruct, pixels, image_size, render_triangles,
                                              wrist_camera)]
    return {k: torch.cat([p[k] for p in parts]) if k != "episodes" else sum(p[k] for p in parts) for k in parts[0]}


def shift_frames(rows: torch.Tensor, layout: PackedLayout, pad: int, gen: torch.Generator) -> torch.Tensor:
    """Random shifts of packed pixel rows [B, nbytes] (DrQ's augmentation, robomimic's crop randomization): each
    camera's frame of each row moved by up to `pad` pixels along each axis, the border pixels repeated into the gap,
    the offsets drawn from `gen`. A new tensor; the other fields are copied unchanged."""
    if pad < 1:
        return rows
    out = rows.clone()
    rgb = layout.unpack(out)["rgb"]  # [B, 3 * views, H, W], a view of `out`
    b, channels, h, w = rgb.shape
    frames = layout.unpack(rows)["rgb"].reshape(b * channels // 3, 3, h, w)  # read from the input, uint8
    n = frames.shape[0]
    dy, dx = (torch.randint(0, 2 * pad + 1, (n,), generator=gen) - pad for _ in range(2))
    ys = (dy[:, None] + torch.arange(h)).clamp(0, h - 1)[:, None, :, None]  # [n, 1, H, 1]: past an edge, the edge
    xs = (dx[:, None] + torch.arange(w)).clamp(0, w - 1)[:, None, None, :]  # [n, 1, 1, W]
    moved = frames[torch.arange(n)[:, None, None, None], torch.arange(3)[None, :, None, None], ys, xs]
    rgb.copy_(moved.reshape(b, channels, h, w))
    return out


def fit(policy: ActorCritic, data: dict[str, torch.Tensor], steps: int, batch_size: int = 256, lr: float = 1e-3,
        vf_coef: float = 0.5, seed: int = 0, on_step: Callable[[int, dict], None] | None = None,
        augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None) -> dict:
    """`steps` Adam steps on minibatches of `data` (sampled with replacement from a seeded generator): loss =
    -mean log-likelihood of the actions + vf_coef * mean squared error of the values. The value loss trains the
    policy's encoder too, also where RL keeps it from doing so (the VLA's `value_trains_encoder`): the returns are
    a target that teaches it where things are. `augment(obs, generator)` (e.g. `shift_frames`) transforms each
    minibatch's observations before the policy sees them. Returns the last step's metrics; `on_step(i, metrics)`
    sees every step's."""
    if steps < 1:
        raise ValueError(f"behaviour cloning needs steps >= 1, got {steps}")
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    policy.train()
    rl_setting = getattr(policy, "value_trains_encoder", None)
    if rl_setting is not None:
        policy.value_trains_encoder = True
    try:
        return _fit_steps(policy, optimizer, data, steps, batch_size, vf_coef, gen, on_step, augment)
    finally:
        if rl_setting is not None:
            policy.value_trains_encoder = rl_setting


def _fit_steps(policy, optimizer, data, steps, batch_size, vf_coef, gen, on_step, augment=None) -> dict:
    n, metrics = len(data["obs"]), {}
    for i in range(steps):
        rows = torch.randint(0, n, (min(batch_size, n),), generator=gen)
        obs = data["obs"][rows] if augment is None else augment(data["obs"][rows], gen)
        logprob, entropy, value = policy.evaluate(obs, data["actions"][rows])
        nll = -logprob.mean()
        vf = (value - data["returns"][rows]).square().mean()
        loss = nll + vf_coef * vf
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        metrics = {"bc/nll": nll.item(), "bc/vf_loss": vf.item(), "bc/entropy": entropy.detach().mean().item()}
        if on_step is not None:
            on_step(i + 1, metrics)
    return metrics


def demo_transitions(demos: str, env_id: str, instruct: bool = False, episodes: int | None = None,
                     sparse: bool = False, end_at_success: bool = True) -> dict[str, torch.Tensor]:
    """The successful demonstrations of `demos` (as `demo_data` reads them) as replay-buffer transitions
    (`replay.transitions`' fields): next obs is the episode's next row; an episode's last step (the expert's
    success, which ends a ManiSkill episode) is terminated, unless `end_at_success` is False (the env runs on past
    success, `ignore_terminations`: that step bootstraps, from its own obs, the last the dataset holds). `sparse`:
    rewards relabelled as the env's sparse reward gives them, 1 on that last step and 0 before (the datasets record
    the env's default, dense reward)."""
    parts = []
    for summary, arrays in _datasets(demos, env_id, instruct):
        info = summary["episodes"][:episodes] if episodes is not None else summary["episodes"]
        for i in (i for i, e in enumerate(info) if e["success"]):
            rows = np.flatnonzero(arrays["episode"] == i)
            obs = torch.as_tensor(arrays["obs"][rows], dtype=torch.float32)
            last = torch.zeros(len(rows), dtype=torch.bool)
            last[-1] = True
            terminated = last if end_at_success else torch.zeros_like(last)
            rewards = last.float() if sparse else torch.as_tensor(arrays["rewards"][rows], dtype=torch.float32)
            parts.append({"obs": obs, "actions": torch.as_tensor(arrays["actions"][rows], dtype=torch.float32),
                          "rewards": rewards, "next_obs": torch.cat([obs[1:], obs[-1:]]), "terminated": terminated})
    if not parts:
        raise ValueError(f"{demos}: no successful demonstrations to put in the replay buffer")
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
