"""Scripted experts for the ManiSkill3 tasks and the demonstration datasets they write (Meta-World tasks,
`metaworld/TASK`, use the package's own scripted policies).

An expert reads the simulator's true state (the cube, goal and gripper positions: privileged, as a motion planner's
is) and drives the end effector through waypoints in the policies' own control mode (`pd_ee_delta_pos`: 3 deltas
and the gripper, in [-1, 1]), so a demonstration needs no conversion: its actions are what a policy emits, its
observations what a policy sees. Measured on 100 seeds (`m2flow demos TASK -n 100`, see docs/embodied.md): PickCube
and PushCube succeed on every seed; StackCube on most (the failed episodes are kept, marked failed).

Why not ManiSkill's motion planner: it needs `mplib` 0.1.1, which segfaults under numpy 2 (the main environment's),
and its demos are in joint-position control, to be converted by replaying them.

A dataset is a directory: `demos.npz` (obs [T, D] float32, or with `pixels` the packed pixel rows [T, nbytes] uint8
of `maniskill.pixel_layout`; actions [T, 4] float32, rewards [T] float32, episode [T] int32: each row's episode number)
and `demos.json` (task, instruction, control mode, the observations' kind (`pixels`, `image_size`,
`render_triangles`), and per episode its reset seed, length, success and return). The expert reads the simulator
either way, so a pixel dataset's actions are the state dataset's for the same seeds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import gymnasium as gym
import numpy as np

from . import maniskill, metaworld


def _p(actor) -> np.ndarray:
    return actor.pose.p[0].cpu().numpy().astype(np.float64)


def _toward(tcp: np.ndarray, target: np.ndarray, grip: float, gain: float = 10.0) -> np.ndarray:
    """A `pd_ee_delta_pos` action moving the gripper toward `target` (clipped to the controller's range)."""
    return np.concatenate([np.clip((target - tcp) * gain, -1.0, 1.0), [grip]]).astype(np.float32)


OPEN, CLOSED = 1.0, -1.0


class _Expert:
    """A waypoint state machine over the env's true state; `act()` gives the next action."""

    def __init__(self, env: gym.Env):
        self.base = env.unwrapped
        self.phase, self.waited = 0, 0

    def _reach(self, tcp, target, grip, tol=0.01, gain=10.0) -> np.ndarray:
        if np.linalg.norm(tcp - target) < tol:
            self.phase += 1
        return _toward(tcp, target, grip, gain)

    def _grip(self, tcp, grip, steps=6) -> np.ndarray:
        self.waited += 1
        if self.waited >= steps:
            self.phase, self.waited = self.phase + 1, 0
        return _toward(tcp, tcp, grip)

    def _grasp(self, tcp, obj) -> np.ndarray | None:
        """Phases 0-2: above `obj`, down to it, close the gripper; None once it holds it (phase 3 on)."""
        if self.phase == 0:
            return self._reach(tcp, obj + [0, 0, 0.05], OPEN)
        if self.phase == 1:
            return self._reach(tcp, obj, OPEN, tol=0.005)
        if self.phase == 2:
            return self._grip(tcp, CLOSED)
        return None


class PickCubeExpert(_Expert):
    """Above the cube, down, close, carry it to the goal."""

    def act(self) -> np.ndarray:
        b = self.base
        tcp, cube, goal = _p(b.agent.tcp), _p(b.cube), _p(b.goal_site)
        grasping = self._grasp(tcp, cube)
        return grasping if grasping is not None else _toward(tcp, goal, CLOSED)


class PushCubeExpert(_Expert):
    """Behind the cube (the goal lies along +x), down to its height, push it onto the goal."""

    def act(self) -> np.ndarray:
        b = self.base
        tcp, cube, goal = _p(b.agent.tcp), _p(b.obj), _p(b.goal_region)
        h = float(b.cube_half_size)
        behind = np.array([cube[0] - h - 0.02, cube[1], h])
        if self.phase == 0:
            return self._reach(tcp, behind + [0, 0, 0.05], CLOSED)
        if self.phase == 1:
            return self._reach(tcp, behind, CLOSED)
        return _toward(tcp, np.array([goal[0] - h, goal[1], h]), CLOSED, gain=5.0)


class StackCubeExpert(_Expert):
    """Pick the red cube (A), lift it, bring it over the green one (B), lower it onto it, let go."""

    def act(self) -> np.ndarray:
        b = self.base
        tcp, a, bb = _p(b.agent.tcp), _p(b.cubeA), _p(b.cubeB)
        h = float(b.cube_half_size[-1])  # a tensor of the three half sizes
        on_b = bb + [0, 0, 2 * h]
        grasping = self._grasp(tcp, a)
        if grasping is not None:
            return grasping
        if self.phase == 3:  # straight up, clear of cube B
            target = np.array([tcp[0], tcp[1], on_b[2] + 0.05])
            if abs(tcp[2] - target[2]) < 0.01:
                self.phase += 1
            return _toward(tcp, target, CLOSED)
        if self.phase == 4:
            return self._reach(tcp, on_b + [0, 0, 0.03], CLOSED, tol=0.005)
        if self.phase == 5:
            if np.linalg.norm(a - on_b) < 0.004:
                self.phase += 1
            return _toward(tcp, on_b + [0, 0, 0.003], CLOSED, gain=5.0)
        return _toward(tcp, tcp, OPEN)


EXPERTS = {"PickCube-v1": PickCubeExpert, "PushCube-v1": PushCubeExpert, "StackCube-v1": StackCubeExpert}


def check_task(env_id: str) -> None:
    """ValueError naming the tasks with an expert when `env_id` has none."""
    if metaworld.is_metaworld(env_id):
        metaworld.task_of(env_id)
    elif env_id not in EXPERTS:
        raise ValueError(f"no expert for task '{env_id}'; tasks: {', '.join(EXPERTS)}, or metaworld/TASK for a "
                         f"Meta-World task (e.g. metaworld/reach-v3)")


def _make(env_id: str, max_episode_steps: int | None = None, pixels: bool = False, image_size: int = 64,
          render_triangles: int = maniskill.RENDER_TRIANGLES) -> gym.Env:
    if metaworld.is_metaworld(env_id):
        if pixels:
            raise ValueError(f"{env_id}: pixel demonstrations are recorded for the ManiSkill3 tasks only")
        return metaworld.make(env_id, max_episode_steps=max_episode_steps or metaworld.MAX_EPISODE_STEPS)
    extra = dict(pixels=True, image_size=image_size, render_triangles=render_triangles) if pixels else {}
    return maniskill.make(env_id, max_episode_steps=max_episode_steps or maniskill.MAX_EPISODE_STEPS, **extra)


def _policy(env_id: str, env: gym.Env) -> Callable[[np.ndarray], np.ndarray]:
    """obs -> the expert's action [4] float32 in [-1, 1]; ManiSkill's read the simulator's state, Meta-World's the
    (goal-observable) observation."""
    if metaworld.is_metaworld(env_id):
        scripted = metaworld.expert(env_id)
        return lambda obs: np.clip(scripted.get_action(obs), -1.0, 1.0).astype(np.float32)
    expert = EXPERTS[env_id](env)
    return lambda obs: expert.act()


def run_expert(env_id: str, seed: int, env: gym.Env | None = None, max_episode_steps: int | None = None) -> dict:
    """One expert episode from reset seed `seed`: obs [T, D], actions [T, 4], rewards [T], success, length."""
    check_task(env_id)
    env = env or _make(env_id, max_episode_steps)
    obs, _ = env.reset(seed=seed)
    policy = _policy(env_id, env)
    rows, actions, rewards, success = [], [], [], False
    while True:
        action = policy(obs)
        rows.append(obs)
        actions.append(action)
        obs, reward, terminated, truncated, info = env.step(action)
        rewards.append(float(reward))
        success = bool(info.get("success", False))
        if terminated or truncated:
            break
    obs_dtype = np.uint8 if np.asarray(rows[0]).dtype == np.uint8 else np.float32  # packed pixel rows stay bytes
    return {"obs": np.asarray(rows, obs_dtype), "actions": np.asarray(actions, np.float32),
            "rewards": np.asarray(rewards, np.float32), "success": success, "length": len(actions), "seed": seed}


def write_demos(env_id: str, episodes: int, out: str | Path, seed: int = 0, progress=None, pixels: bool = False,
                image_size: int = 64, render_triangles: int = maniskill.RENDER_TRIANGLES) -> dict:
    """Run the expert from reset seeds seed, seed + 1, ... and write the dataset (module docstring) to `out`;
    `pixels`: the observations are the task camera's frames at `image_size` with the proprioception and the
    instruction (what env.pixels=true shows a policy), the meshes at `render_triangles` (env.render_triangles).
    `progress(i)` is called after each episode. Returns the JSON summary."""
    check_task(env_id)
    env = _make(env_id, pixels=pixels, image_size=image_size, render_triangles=render_triangles)
    runs = []
    for i in range(episodes):
        runs.append(run_expert(env_id, seed + i, env))
        if progress is not None:
            progress(i + 1)
    env.close()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "demos.npz", obs=np.concatenate([r["obs"] for r in runs]),
                        actions=np.concatenate([r["actions"] for r in runs]),
                        rewards=np.concatenate([r["rewards"] for r in runs]),
                        episode=np.concatenate([np.full(r["length"], i, np.int32) for i, r in enumerate(runs)]))
    mw = metaworld.is_metaworld(env_id)
    summary = {"task": env_id, "instruction": "" if mw else maniskill.instruction(env_id),
               "control_mode": metaworld.CONTROL_MODE if mw else maniskill.CONTROL_MODE,
               "max_episode_steps": (metaworld if mw else maniskill).MAX_EPISODE_STEPS,
               "pixels": pixels,
               **({"image_size": image_size, "render_triangles": render_triangles} if pixels else {}),
               "expert": type(metaworld.expert(env_id)).__name__ if mw else EXPERTS[env_id].__name__,
               "success_rate": float(np.mean([r["success"] for r in runs])),
               "episodes": [{"seed": r["seed"], "length": r["length"], "success": r["success"],
                             "return": float(r["rewards"].sum())} for r in runs]}
    (out / "demos.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def load_demos(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(summary, arrays) of a dataset directory written by `write_demos`."""
    d = Path(path)
    for name in ("demos.json", "demos.npz"):
        if not (d / name).exists():
            raise FileNotFoundError(f"{d}: not a demonstration dataset (no {name}; `m2flow demos TASK -n N --out DIR` "
                                    f"writes one)")
    with np.load(d / "demos.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads((d / "demos.json").read_text()), arrays
