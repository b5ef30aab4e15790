"""ManiSkill3 tabletop manipulation (RLinf's embodied benchmark) as plain gymnasium envs: PickCube-v1, PushCube-v1 and
StackCube-v1 with state observations on SAPIEN's CPU physics, one env per gymnasium env (the env worker's processes
and pipeline stages vectorise them, as for every other task), each with its task instruction in words.

Needs the `maniskill` extra (`pip install 'm2flow[maniskill]'`) and a Vulkan device: SAPIEN asks for one even when
nothing is rendered. On Debian 12, `make vulkan` installs Mesa's software driver from bookworm-backports (Debian 12's
own Mesa 22 lacks an extension SAPIEN needs).
"""

from __future__ import annotations

import gymnasium as gym

# the task's instruction, as an instruction-conditioned policy reads it
TASKS = {
    "PickCube-v1": "pick up the cube and move it to the goal",
    "PushCube-v1": "push the cube to the goal region",
    "StackCube-v1": "stack the red cube on top of the green cube",
}
CONTROL_MODE = "pd_ee_delta_pos"  # 3 end-effector deltas and the gripper: 4 actions in [-1, 1]
# the registered limits (50 steps) are too short: the motion-planning expert first succeeds at steps 46-78
MAX_EPISODE_STEPS = 100
EXTRA_HINT = "pip install 'm2flow[maniskill]' (make test installs it)"
VULKAN_ERROR = ("ManiSkill3 needs a Vulkan device and found none (SAPIEN: 'failed to find a rendering device'); on "
                "Debian 12 run `make vulkan` (Mesa's software Vulkan driver from bookworm-backports)")


def is_maniskill(env_id: str) -> bool:
    return env_id in TASKS


def registered_by_it(spec) -> bool:
    """Whether a gymnasium registry entry is one of ManiSkill's (it registers all its tasks once imported)."""
    entry = spec.entry_point
    entry = getattr(entry, "func", entry)  # ManiSkill registers functools.partial(its make, env_id=...)
    module = entry.split(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "") or ""
    return module.startswith("mani_skill")


def instruction(env_id: str) -> str:
    """The task's instruction in words."""
    if env_id not in TASKS:
        raise ValueError(f"{env_id!r} is not a ManiSkill3 task m2flow runs; tasks: {', '.join(TASKS)}")
    return TASKS[env_id]


def check_available() -> None:
    """Raise a one-line error when the extra is missing or no Vulkan device is found."""
    try:
        import mani_skill  # noqa: F401  (the package, before its renderer)
        import sapien
    except ImportError as e:
        raise ImportError(f"ManiSkill3 tasks need the mani-skill package ({e}): {EXTRA_HINT}") from None
    try:
        sapien.render.RenderSystem()
    except RuntimeError as e:
        if "rendering device" in str(e):
            raise RuntimeError(VULKAN_ERROR) from None
        raise


def make(env_id: str, render_mode: str | None = None, max_episode_steps: int = MAX_EPISODE_STEPS, **kwargs) -> gym.Env:
    """One ManiSkill3 env with state observations on the CPU backend, as a standard gymnasium env: numpy arrays, no
    batch dimension (`CPUGymWrapper`). obs [D] float32 (42 for PickCube), actions [4] in [-1, 1]; `info["success"]`
    at every step. An episode terminates when the task succeeds and is truncated after `max_episode_steps`."""
    instruction(env_id)
    check_available()
    import mani_skill.envs  # noqa: F401  (registers the tasks)
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    options = dict(obs_mode="state", sim_backend="physx_cpu", control_mode=CONTROL_MODE,
                   render_backend="none" if render_mode is None else "cpu")
    options.update(kwargs)
    env = gym.make(env_id, num_envs=1, render_mode=render_mode, max_episode_steps=max_episode_steps, **options)
    return CPUGymWrapper(env)
