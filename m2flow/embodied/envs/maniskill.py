"""ManiSkill3 tabletop manipulation (RLinf's embodied benchmark) as plain gymnasium envs: PickCube-v1, PushCube-v1 and
StackCube-v1 on SAPIEN's CPU physics, one env per gymnasium env (the env worker's processes and pipeline stages
vectorise them, as for every other task), each with its task instruction in words. Observations are the task's state,
or (`pixels`) the task camera's RGB frame with the robot's proprioception and the instruction beside it, packed in
one uint8 row (`pixel_layout`, m2flow.embodied.envs.packed).

Needs the `maniskill` extra (`pip install 'm2flow[maniskill]'`) and a Vulkan device: SAPIEN asks for one even when
nothing is rendered. On Debian 12, `make vulkan` installs Mesa's software driver from bookworm-backports (Debian 12's
own Mesa 22 lacks an extension SAPIEN needs).
"""

from __future__ import annotations

import functools
import hashlib
import logging

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from m2flow.embodied.envs.packed import Field, PackedLayout

# the task's instruction, as an instruction-conditioned policy reads it
TASKS = {
    "PickCube-v1": "pick up the cube and move it to the goal",
    "PushCube-v1": "push the cube to the goal region",
    "StackCube-v1": "stack the red cube on top of the green cube",
}
CONTROL_MODE = "pd_ee_delta_pos"  # 3 end-effector deltas and the gripper: 4 actions in [-1, 1]
# the registered limits (50 steps) are too short: the motion-planning expert first succeeds at steps 46-78
MAX_EPISODE_STEPS = 100
# instruction-conditioned observations (`instruct=True`): [instruction word ids; state zero-padded to STATE_DIM]
VOCAB = ["<pad>", "<unk>", *sorted({w for text in TASKS.values() for w in text.split()})]
INSTRUCTION_TOKENS = 12
RENDER_TRIANGLES = 1000  # pixel observations: visual triangles per body the scene keeps (SimplifiedVisuals)
# ManiSkill's Panda with a camera on its hand (env.wrist_camera): PickCube and PushCube do not list it among their
# robots, so ManiSkill warns, but they run it as the Panda it is (only PickCube's dense reward differs: its
# "stay still" term counts the fingers' velocities too, as for the robots it does not know)
WRIST_CAMERA_ROBOT = "panda_wristcam"
STATE_DIM = 48  # the largest of the tasks' states (StackCube's); the others are zero-padded to it
EXTRA_HINT = "pip install 'm2flow[maniskill]' (make test installs it)"
VULKAN_ERROR = ("ManiSkill3 needs a Vulkan device and found none (SAPIEN: 'failed to find a rendering device'); on "
                "Debian 12 run `make vulkan` (Mesa's software Vulkan driver from bookworm-backports)")


class _KnownRobotWarning(logging.Filter):
    """Drops ManiSkill's warning that the wrist-camera Panda is not among a task's robots (WRIST_CAMERA_ROBOT)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(f"{WRIST_CAMERA_ROBOT} is not in the task's list")


def is_maniskill(env_id: str) -> bool:
    """A ManiSkill3 task m2flow runs, or a comma-separated list of them (multi-task)."""
    return all(t in TASKS for t in task_ids(env_id))


def task_ids(env_id: str) -> list[str]:
    """The tasks of an env id: one, or several separated by commas (a multi-task group: `env_tasks`)."""
    return [t.strip() for t in env_id.split(",")]


def env_tasks(env_id: str, num_envs: int, seed_groups: int = 1) -> list[str]:
    """The task of each of an env group's `num_envs` envs: env i runs task (i // seed_groups) % n of the n tasks, so
    that with `seed_groups` 1 they take turns (PickCube, PushCube, StackCube, PickCube, ...) and the envs of a group
    that shares a reset seed (embodied GRPO compares outcomes within it) run one task."""
    tasks = task_ids(env_id)
    return [tasks[(i // seed_groups) % len(tasks)] for i in range(num_envs)]


def tokenize(text: str) -> np.ndarray:
    """[INSTRUCTION_TOKENS] int64: the words' ids in VOCAB (unknown words 1), padded with 0."""
    ids = [VOCAB.index(w) if w in VOCAB else 1 for w in text.lower().split()][:INSTRUCTION_TOKENS]
    return np.array(ids + [0] * (INSTRUCTION_TOKENS - len(ids)), np.int64)


class InstructionObservation(gym.ObservationWrapper):
    """The observation as [instruction word ids; state zero-padded to STATE_DIM], float32: every task then has the
    same observation space, and one policy reads which task it is doing from the words."""

    def __init__(self, env: gym.Env, text: str):
        super().__init__(env)
        self.tokens = tokenize(text).astype(np.float32)
        state = env.observation_space.shape[0]
        if state > STATE_DIM:
            raise ValueError(f"{text!r}: a state of {state} numbers does not fit STATE_DIM={STATE_DIM}")
        self.observation_space = spaces.Box(-np.inf, np.inf, (INSTRUCTION_TOKENS + STATE_DIM,), np.float32)

    def observation(self, obs):
        return instruction_obs(self.tokens, obs[None])[0]


def instruction_obs(tokens: np.ndarray, states: np.ndarray) -> np.ndarray:
    """[N, INSTRUCTION_TOKENS + STATE_DIM] float32: each row the instruction's word ids, then its state zero-padded
    (a dataset's rows as `InstructionObservation` shows them to a policy)."""
    out = np.zeros((len(states), INSTRUCTION_TOKENS + STATE_DIM), np.float32)
    out[:, :INSTRUCTION_TOKENS] = tokens
    out[:, INSTRUCTION_TOKENS:INSTRUCTION_TOKENS + states.shape[1]] = states
    return out


@functools.cache
def pixel_layout(image_size: int, wrist_camera: bool = False) -> PackedLayout:
    """A pixel observation's fields: `state` the robot's proprioception and what the task tells it (joint positions,
    the gripper's pose, whether it grasps, the goal where the task has one: not the objects' poses, which the frames
    show, nor the joints' velocities, `frames_and_proprioception`) zero-padded to STATE_DIM; `instruction` the task's
    word ids; `rgb` the task camera's frame [3, image_size, image_size], channel first, then (`wrist_camera`) the
    hand camera's: [3 * views, image_size, image_size]; `progress` the share of the episode's step limit gone by
    (0 at a reset), which the value function reads and the policy does not (`PixelObservation`)."""
    views = 2 if wrist_camera else 1
    return PackedLayout([Field("state", "float32", (STATE_DIM,)), Field("progress", "float32", (1,)),
                         Field("instruction", "int32", (INSTRUCTION_TOKENS,)),
                         Field("rgb", "uint8", (3 * views, image_size, image_size))])


class PixelObservation(gym.ObservationWrapper):
    """ManiSkill's {"rgb": [H, W, 3 * views], "state": [D]} (its FlattenRGBDObservationWrapper, unbatched: the
    cameras' frames side by side in the channels) with the task's instruction, as one packed row of
    `pixel_layout(image_size, wrist_camera)`, and the episode's progress: the steps since the reset over the step
    limit. Progress is what a value function needs beside what the robot sees where episodes run to their step limit
    (`ignore_terminations`): the return left is the steps left at the goal. On PickCube's sparse reward, value
    functions fitted to a clone's returns explained 0.55 (linear, on the VLA's readout state) and 0.62 (an MLP over the
    proprioception) of the returns' variance on held-out rollouts, and 0.87 with the progress beside the
    proprioception (docs/results/vla.md, 2026-12-06): Pardo et al.'s time-aware value, as sb3-contrib's
    TimeFeatureWrapper gives it, here to the critic alone."""

    def __init__(self, env: gym.Env, text: str, image_size: int, wrist_camera: bool = False,
                 max_episode_steps: int = MAX_EPISODE_STEPS):
        super().__init__(env)
        self.layout, self.tokens = pixel_layout(image_size, wrist_camera), tokenize(text).astype(np.int32)
        self.limit, self.elapsed = max_episode_steps, 0
        state = env.observation_space["state"].shape[0]
        if state > STATE_DIM:
            raise ValueError(f"{text!r}: a state of {state} numbers does not fit STATE_DIM={STATE_DIM}")
        rgb, expected = env.observation_space["rgb"].shape, self.layout.fields["rgb"].shape
        if (rgb[-1], *rgb[:2]) != expected:
            raise ValueError(f"{text!r}: the cameras give frames {rgb}, expected {expected} channel last")
        self.observation_space = self.layout.space()

    def reset(self, **kwargs):
        self.elapsed = 0
        return super().reset(**kwargs)

    def step(self, action):
        self.elapsed += 1
        return super().step(action)

    def observation(self, obs):
        state = np.zeros(STATE_DIM, np.float32)
        state[:len(obs["state"])] = obs["state"]
        return self.layout.pack(state=state, progress=np.array([self.elapsed / self.limit], np.float32),
                                instruction=self.tokens, rgb=np.ascontiguousarray(np.moveaxis(obs["rgb"], -1, 0)))


def frames_and_proprioception(env: gym.Env) -> gym.Env:
    """ManiSkill's own flattening of an rgb observation ({"rgb": the cameras' frames side by side in the channels,
    "state": the rest, flat}, its FlattenRGBDObservationWrapper), without the joints' velocities.

    Why not the velocities: the scripted expert's motions are smooth, so the arm's velocity at a step tells much of
    the action the expert takes at it, whatever the frames show. A clone from pixels learns that shortcut instead of
    where the cube is (what imitation learning calls the copycat problem: it repeats its last motion and, from a
    standstill at a reset, never starts toward the cube): on PickCube with the hand camera, 300 demonstrations, the
    same fit, 1 of 30 held-out episodes succeeded with the velocities, 19 of 30 with them zeroed, 29 of 30 with them
    left out as here (docs/results/vla.md, 2026-12-06). The joints' positions stay: they tell the arm's posture, not
    its motion."""
    from mani_skill.utils.wrappers.flatten import FlattenRGBDObservationWrapper

    class FramesAndProprioception(FlattenRGBDObservationWrapper):
        def observation(self, observation: dict):
            observation["agent"] = {k: v for k, v in observation["agent"].items() if k != "qvel"}
            return super().observation(observation)

    return FramesAndProprioception(env, rgb=True, depth=False, state=True)


class SeededResets(gym.Wrapper):
    """ManiSkill draws an unseeded reset's episode (where the cube and the goal start) from torch's global RNG, which
    every env of a process shares: the episodes after a seeded reset then depend on how many draws the other envs,
    and anything else in the process, took before, so the same seeds gave other episodes in another plan. Here an
    unseeded reset is seeded from the env's own generator, which the last seeded reset seeded: each env's episodes are
    a function of its seeds alone, as gymnasium's contract has it."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self._rng = np.random.default_rng()

    def reset(self, *, seed=None, options=None):
        if seed is None:
            seed = int(self._rng.integers(2**31 - 1))
        else:
            self._rng = np.random.default_rng(seed)
        return self.env.reset(seed=seed, options=options)


class NoGraspAtReset(gym.Wrapper):
    """SAPIEN's CPU physics keeps the last step's contacts through a reset, so ManiSkill's `agent.is_grasping` went on
    reporting the grasp that ended the previous episode until the next one's first step: in its first observation
    (`is_grasped` 1) and to the experts, whose first action then carried a cube they did not hold. Every task here
    resets the gripper open, away from the cubes: until the first step after a reset, the robot grasps nothing."""

    def reset(self, **kwargs):
        self._grasp_nothing()  # the agent the reset computes its observation with (a rebuilt scene has no contacts)
        out = self.env.reset(**kwargs)
        self._grasp_nothing()  # the agent after it: what an expert asks before the first step
        return out

    def step(self, action):
        self.env.unwrapped.agent.__dict__.pop("is_grasping", None)  # the class's own, from the contacts of this step on
        return self.env.step(action)

    def _grasp_nothing(self) -> None:
        import torch

        agent = self.env.unwrapped.agent
        grasping = type(agent).is_grasping
        agent.is_grasping = lambda obj, *args, **kw: torch.zeros_like(grasping(agent, obj, *args, **kw))


class SimplifiedVisuals(gym.Wrapper):
    """The scene's untextured visual meshes simplified to about `max_triangles` triangles per body (each link of the
    robot), by quadric decimation (fast-simplification, through trimesh), whenever the env builds its scene. The
    Panda ships with about 135,000 visual triangles, which a small frame cannot show, and a software renderer
    (llvmpipe) processes every one of them for every frame: almost all of a frame's time. Only what the camera sees
    changes: collision shapes, physics and the state stay as they are. Textured parts (the ground) and primitives are
    left alone: decimation keeps no texture coordinates."""

    def __init__(self, env: gym.Env, max_triangles: int):
        super().__init__(env)
        self.max_triangles, self._scene = max_triangles, None
        self._simplify()  # ManiSkill builds its scene in its constructor

    def reset(self, **kwargs):
        out = self.env.reset(**kwargs)
        self._simplify()  # a reset that rebuilt the scene (reconfigure) brings the shipped meshes back
        return out

    def _simplify(self) -> None:
        scene = self.env.unwrapped.scene
        if scene is not self._scene:
            for sub in scene.sub_scenes:
                simplify_visuals(sub, self.max_triangles)
            self._scene = scene


def simplify_visuals(scene, max_triangles: int) -> None:
    """Replace each render body of `scene` whose untextured triangle meshes hold more than `max_triangles` triangles
    with one whose meshes share that budget in proportion to their sizes."""
    import sapien

    for entity in scene.entities:
        for body in [c for c in entity.components if isinstance(c, sapien.render.RenderBodyComponent)]:
            meshes = [s for s in body.render_shapes if isinstance(s, sapien.render.RenderShapeTriangleMesh)
                      and all(p.material.base_color_texture is None for p in s.parts)]
            total = sum(len(p.get_triangles()) for s in meshes for p in s.parts)
            if total <= max_triangles:
                continue
            new = sapien.render.RenderBodyComponent()
            new.name = body.name
            for shape in body.render_shapes:
                if shape not in meshes:
                    new.attach(shape)
                    continue
                for part in shape.parts:
                    target = max(16, len(part.get_triangles()) * max_triangles // total)
                    vertices, faces, normals = _decimated(part.get_vertices(), part.get_triangles(), target)
                    uvs = np.zeros((len(vertices), 2), np.float32)  # untextured: no texture coordinates
                    mesh = sapien.render.RenderShapeTriangleMesh(vertices, faces, normals, uvs, part.material)
                    mesh.local_pose, mesh.scale, mesh.front_face = shape.local_pose, shape.scale, shape.front_face
                    new.attach(mesh)
            entity.remove_component(body)
            entity.add_component(new)


def _decimated(vertices: np.ndarray, faces: np.ndarray, target: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(vertices, faces, vertex normals) of the mesh decimated to about `target` faces, its duplicate vertices merged
    first (meshes split at their seams would tear open); memoized, as every env of a process loads the same robot."""
    key = (hashlib.sha1(vertices.tobytes() + faces.tobytes()).hexdigest(), target)
    if key not in _DECIMATED:
        import trimesh

        mesh = trimesh.Trimesh(vertices, faces, process=True)
        if len(mesh.faces) > target:
            mesh = mesh.simplify_quadric_decimation(face_count=target)
        _DECIMATED[key] = (np.asarray(mesh.vertices, np.float32), np.asarray(mesh.faces, np.uint32),
                           np.asarray(mesh.vertex_normals, np.float32))
    return _DECIMATED[key]


_DECIMATED: dict[tuple[str, int], tuple] = {}  # (mesh digest, target faces) -> _decimated's arrays


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


@functools.cache  # once per process
def _quiet_about_the_wrist_camera() -> None:
    from mani_skill import logger  # its name is "mani_skill " (a trailing space): the package's own object

    logger.addFilter(_KnownRobotWarning())


@functools.cache  # once per process (each env's constructor asks): only a success is kept
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


def make(env_id: str, render_mode: str | None = None, max_episode_steps: int = MAX_EPISODE_STEPS,
         instruct: bool = False, ignore_terminations: bool = False, pixels: bool = False, image_size: int = 64,
         render_triangles: int = RENDER_TRIANGLES, wrist_camera: bool = False, **kwargs) -> gym.Env:
    """One ManiSkill3 env on the CPU backend, as a standard gymnasium env: numpy arrays, no batch dimension
    (`CPUGymWrapper`). obs [D] float32 (42 for PickCube), actions [4] in [-1, 1]; `info["success"]` at every step.
    An episode terminates when the task succeeds and is truncated after `max_episode_steps`.
    `instruct`: observations carry the task's instruction (`InstructionObservation`). `pixels`: the task camera
    renders at image_size x image_size and the observation is its frame with the proprioception and the instruction
    (`PixelObservation`; the instruction is always there), with the visual meshes simplified to `render_triangles`
    per body (`SimplifiedVisuals`; 0: as shipped); `wrist_camera`: a second frame from a camera on the hand
    (ManiSkill's `panda_wristcam`, the same Panda with a camera mount), after the task camera's.
    `ignore_terminations`: an episode runs to its step limit whatever happens (ManiSkill's own option; its PPO
    baseline trains so), and a dense reward keeps paying for staying at the goal, where ending on success would stop
    it."""
    text = instruction(env_id)
    if wrist_camera and not pixels:
        raise ValueError("a wrist camera's frames are pixel observations: wrist_camera needs pixels")
    check_available()
    import mani_skill.envs  # noqa: F401  (registers the tasks)
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    _quiet_about_the_wrist_camera()

    options = dict(obs_mode="rgb" if pixels else "state", sim_backend="physx_cpu", control_mode=CONTROL_MODE,
                   render_backend="none" if render_mode is None and not pixels else "cpu")
    if pixels:
        options["sensor_configs"] = dict(width=image_size, height=image_size)
    if pixels:  # StackCube's default robot carries the hand camera: a pixel env renders the cameras asked for
        options["robot_uids"] = WRIST_CAMERA_ROBOT if wrist_camera else "panda"
    options.update(kwargs)
    env = NoGraspAtReset(gym.make(env_id, num_envs=1, render_mode=render_mode, max_episode_steps=max_episode_steps,
                                  **options))
    if pixels and render_triangles:
        env = SimplifiedVisuals(env, render_triangles)
    if pixels:  # {"rgb": the cameras' frames, "state": the rest but the joints' velocities}
        env = frames_and_proprioception(env)
    env = SeededResets(CPUGymWrapper(env, ignore_terminations=ignore_terminations))
    if pixels:
        return PixelObservation(env, text, image_size, wrist_camera, max_episode_steps)
    return InstructionObservation(env, text) if instruct else env
