"""Meta-World v3 (MT1 tasks: one Sawyer arm task per env, 50 of them) as plain gymnasium envs: the light second
manipulation family beside ManiSkill3, on MuJoCo, about 5x faster per env step than SAPIEN, each task with the
package's scripted expert (`m2flow demos metaworld/TASK`).

An env id is `metaworld/<task>`, e.g. `metaworld/reach-v3`, `metaworld/pick-place-v3`. Observations are the 39
numbers of Meta-World's goal-observable envs (hand, gripper, objects, the previous frame's, the goal), actions 4 in
[-1, 1] (3 end-effector deltas and the gripper), the dense v2 reward, `info["success"]` at every step. Each reset
draws the objects' and the goal's positions from the reset seed, so a seed fixes an episode's start (Meta-World's own
MT1 picks one of 50 fixed starts with an RNG the reset seed does not reach). An episode terminates at success
(`ignore_terminations=True`: it runs on, as in Meta-World's own benchmark) and is truncated after
`max_episode_steps` (Meta-World's 500).

Installed by `make setup` / `make test` with `pip install --no-deps metaworld==3.1.1`: the release pins
mujoco==3.3.0, this project runs MuJoCo 4 (the gymnasium MuJoCo tasks' figures were measured on it), and the one
incompatibility found is patched here (`_patch_welds`).
"""

from __future__ import annotations

import difflib
import functools

import gymnasium as gym

PREFIX = "metaworld/"
MAX_EPISODE_STEPS = 500  # Meta-World's max_path_length
CONTROL_MODE = "mocap_delta_pos"  # 3 end-effector (mocap) deltas and the gripper: 4 actions in [-1, 1]
INSTALL_HINT = "pip install --no-deps metaworld==3.1.1 (make setup installs it)"


def is_metaworld(env_id: str) -> bool:
    return env_id.startswith(PREFIX)


@functools.cache
def _package():
    try:
        import metaworld
    except ImportError as e:
        raise ImportError(f"Meta-World tasks need the metaworld package ({e}): {INSTALL_HINT}") from None
    _patch_welds()
    return metaworld


@functools.cache
def tasks() -> tuple[str, ...]:
    """The task names, e.g. 'reach-v3' (those with a scripted expert: all 50)."""
    _package()
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS
    from metaworld.policies import ENV_POLICY_MAP

    return tuple(sorted(name for name in ALL_V3_ENVIRONMENTS if name in ENV_POLICY_MAP))


def task_of(env_id: str) -> str:
    """'metaworld/reach-v3' -> 'reach-v3'; ValueError naming close tasks (or listing them all) if there is none."""
    task = env_id[len(PREFIX):]
    known = tasks()
    if task not in known:
        close = difflib.get_close_matches(task, known, n=5, cutoff=0.6)
        hint = f"close matches: {', '.join(PREFIX + c for c in close)}" if close else f"tasks: {', '.join(known)}"
        raise ValueError(f"{env_id!r} is not a Meta-World task; {hint}")
    return task


def _patch_welds() -> None:
    """MuJoCo 4 gives a weld constraint 12 numbers of eq_data where 3.x gave 11 (Meta-World 3.1.1 writes 11 and
    fails on a shape mismatch): write Meta-World's 11, leave the new last one at the model's value."""
    import mujoco
    from metaworld.sawyer_xyz_env import SawyerMocapBase

    weld = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 5.0]

    def reset_mocap_welds(self) -> None:
        if self.model.nmocap > 0 and self.model.eq_data is not None:
            for i in range(self.model.eq_data.shape[0]):
                if self.model.eq_type[i] == mujoco.mjtEq.mjEQ_WELD:
                    self.model.eq_data[i, :len(weld)] = weld

    SawyerMocapBase.reset_mocap_welds = reset_mocap_welds


class SeededStarts(gym.Wrapper):
    """reset(seed=s) draws the task's random start (objects, goal) from s: the same seed, the same episode start."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        base = env.unwrapped
        base._freeze_rand_vec, base.seeded_rand_vec = False, True  # each reset draws from base.np_random

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self.env.unwrapped.seed(seed)
        return self.env.reset(options=options)


def make(env_id: str, render_mode: str | None = None, max_episode_steps: int = MAX_EPISODE_STEPS,
         ignore_terminations: bool = False) -> gym.Env:
    """One Meta-World env (module docstring): obs [39] float64, actions [4] in [-1, 1], `info["success"]`."""
    task = task_of(env_id)
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE

    base = ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE[f"{task}-goal-observable"](seed=0, render_mode=render_mode)
    base.max_path_length = max_episode_steps + 1  # the TimeLimit below truncates; Meta-World raises past its own
    env = gym.wrappers.TimeLimit(SeededStarts(base), max_episode_steps)
    return env if ignore_terminations else _EndAtSuccess(env)


class _EndAtSuccess(gym.Wrapper):
    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated or bool(info.get("success", 0.0)), truncated, info


def expert(env_id: str):
    """The task's scripted policy: `.get_action(obs) -> action [4]` (reads the goal-observable obs)."""
    from metaworld.policies import ENV_POLICY_MAP

    return ENV_POLICY_MAP[task_of(env_id)]()
