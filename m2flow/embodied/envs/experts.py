"""Scripted experts for the ManiSkill3 tasks and the demonstration datasets they write (Meta-World tasks,
`metaworld/TASK`, use the package's own scripted policies).

An expert reads the simulator's true state (the cube, goal and gripper positions, whether it holds the cube:
privileged, as a motion planner's is) and drives the end effector toward the next waypoint in the policies' own
control mode (`pd_ee_delta_pos`: 3 deltas and the gripper, in [-1, 1]), so a demonstration needs no conversion: its
actions are what a policy emits, its observations what a policy sees. Its action is a function of the current state
alone (no phase or timer kept between steps), which is what lets a policy clone it. Success rates over 100 seeds are
in docs/results/manipulation.md (failed episodes are kept, marked failed).

Why not ManiSkill's motion planner: it needs `mplib` 0.1.1, which segfaults under numpy 2 (the main environment's),
and its demos are in joint-position control, to be converted by replaying them.

A dataset is a directory: `demos.npz` (obs [T, D] float32, or with `pixels` the packed pixel rows [T, nbytes] uint8
of `maniskill.pixel_layout`; actions [T, 4] float32, rewards [T] float32, episode [T] int32: each row's episode number)
and `demos.json` (task, instruction, control mode, the observations' kind (`pixels`, `image_size`,
`render_triangles`, `wrist_camera`, `joint_velocities`: false and `progress`: true, as pixel observations are now),
and per episode its reset seed, length, success and return). The expert reads the simulator either way, so a pixel
dataset's actions are the state dataset's for the same seeds.
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
    """An expert whose action is a function of the simulator's current state alone: it keeps nothing from one step
    to the next (no phase, no timer), so a policy that observes the same state can clone it; a grasp that slips is
    tried again. `act()` gives the next action."""

    def __init__(self, env: gym.Env):
        self.base = env.unwrapped

    def _holds(self, obj) -> bool:
        return bool(self.base.agent.is_grasping(obj)[0])

    @staticmethod
    def _pick(tcp: np.ndarray, obj: np.ndarray) -> np.ndarray:
        """Toward grasping the cube at `obj`: above it, open, while the gripper is off its vertical; down to it;
        then close on it."""
        if np.linalg.norm(tcp[:2] - obj[:2]) > 0.01:
            return _toward(tcp, obj + [0, 0, 0.05], OPEN)
        if tcp[2] > obj[2] + 0.005:
            return _toward(tcp, obj, OPEN)
        return _toward(tcp, obj, CLOSED)


class PickCubeExpert(_Expert):
    """Grasp the cube; holding it, carry it to the goal."""

    def act(self) -> np.ndarray:
        b = self.base
        tcp, cube, goal = _p(b.agent.tcp), _p(b.cube), _p(b.goal_site)
        return _toward(tcp, goal, CLOSED) if self._holds(b.cube) else self._pick(tcp, cube)


class PushCubeExpert(_Expert):
    """Behind the cube (the goal lies along +x) at its height, closed, then push it onto the goal; from above while
    the gripper is not behind it."""

    def act(self) -> np.ndarray:
        b = self.base
        tcp, cube, goal = _p(b.agent.tcp), _p(b.obj), _p(b.goal_region)
        h = float(b.cube_half_size)
        behind = np.array([cube[0] - h - 0.02, cube[1], h])
        if tcp[0] < cube[0] - h and abs(tcp[1] - cube[1]) < 0.02 and tcp[2] < h + 0.01:
            return _toward(tcp, np.array([goal[0] - h, goal[1], h]), CLOSED, gain=5.0)
        if np.linalg.norm(tcp[:2] - behind[:2]) > 0.01:
            return _toward(tcp, behind + [0, 0, 0.05], CLOSED)
        return _toward(tcp, behind, CLOSED)


class StackCubeExpert(_Expert):
    """Grasp the red cube (A); holding it, up clear of the green one (B), over it, down onto it; A resting on B: let
    go."""

    def act(self) -> np.ndarray:
        b = self.base
        tcp, a, bb = _p(b.agent.tcp), _p(b.cubeA), _p(b.cubeB)
        h = float(b.cube_half_size[-1])  # a tensor of the three half sizes
        on_b = bb + [0, 0, 2 * h]
        if np.linalg.norm(a - on_b) < 0.004:
            return _toward(tcp, tcp, OPEN)
        if not self._holds(b.cubeA):
            return self._pick(tcp, a)
        if np.linalg.norm(tcp[:2] - on_b[:2]) > 0.01:  # not over B yet: up first, then across 3 cm above it
            if tcp[2] < on_b[2] + 0.025:
                return _toward(tcp, np.array([tcp[0], tcp[1], on_b[2] + 0.05]), CLOSED)
            return _toward(tcp, on_b + [0, 0, 0.03], CLOSED)
        return _toward(tcp, on_b + [0, 0, 0.003], CLOSED, gain=5.0)


EXPERTS = {"PickCube-v1": PickCubeExpert, "PushCube-v1": PushCubeExpert, "StackCube-v1": StackCubeExpert}


def check_task(env_id: str) -> None:
    """ValueError naming the tasks with an expert when `env_id` has none."""
    if metaworld.is_metaworld(env_id):
        metaworld.task_of(env_id)
    elif env_id not in EXPERTS:
        raise ValueError(f"no expert for task '{env_id}'; tasks: {', '.join(EXPERTS)}, or metaworld/TASK for a "
                         f"Meta-World task (e.g. metaworld/reach-v3)")


def _make(env_id: str, max_episode_steps: int | None = None, pixels: bool = False, image_size: int = 64,
          render_triangles: int = maniskill.RENDER_TRIANGLES, wrist_camera: bool = False) -> gym.Env:
    if metaworld.is_metaworld(env_id):
        if pixels:
            raise ValueError(f"{env_id}: pixel demonstrations are recorded for the ManiSkill3 tasks only")
        return metaworld.make(env_id, max_episode_steps=max_episode_steps or metaworld.MAX_EPISODE_STEPS)
    extra = dict(pixels=True, image_size=image_size, render_triangles=render_triangles,
                 wrist_camera=wrist_camera) if pixels else {}
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
                image_size: int = 64, render_triangles: int = maniskill.RENDER_TRIANGLES,
                wrist_camera: bool = False) -> dict:
    """Run the expert from reset seeds seed, seed + 1, ... and write the dataset (module docstring) to `out`;
    `pixels`: the observations are the task camera's frames at `image_size` with the proprioception and the
    instruction (what env.pixels=true shows a policy), the meshes at `render_triangles` (env.render_triangles), and
    the hand camera's frames after the task camera's with `wrist_camera` (env.wrist_camera).
    `progress(i)` is called after each episode. Returns the JSON summary."""
    check_task(env_id)
    env = _make(env_id, pixels=pixels, image_size=image_size, render_triangles=render_triangles,
                wrist_camera=wrist_camera)
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
               **({"image_size": image_size, "render_triangles": render_triangles, "wrist_camera": wrist_camera,
                   "joint_velocities": False, "progress": True} if pixels else {}),
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
