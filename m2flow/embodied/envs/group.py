"""Gymnasium envs for embodied RL: the env factory by id, `EnvGroup` (a seeded vector of envs with normalization,
episode stats, action chunks and pipeline stages) and the [T, N] `Trajectory` with a lock-step collector.

Plain gymnasium + numpy + torch: no workers, no channels, no learning (the wing's workers/, runtime/ and algorithms/ do).

Autoreset is SAME_STEP (`gymnasium.vector.AutoresetMode.SAME_STEP`): when env i's episode ends at step t, the obs
returned for it is already the first obs of its next episode, and the last obs of the finished one comes back as
`final_obs`. Every [t, i] of a rollout is then a real transition (NEXT_STEP would insert a dead "reset" step whose
action is ignored and must be masked out of the loss), a truncated step bootstraps from V(final_obs), and no reset
is left pending between steps, so a group can be cut into pipeline stages at any step. `EnvGroup` steps its envs
itself (chunks and stages need per-env control) with exactly SyncVectorEnv's SAME_STEP contract; a test holds the two
equal.
"""

from __future__ import annotations

import difflib
import functools
import io
import logging
import math
import os
import pickle
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from . import maniskill, metaworld
from .normalize import ObsNormalizer, RewardScaler

# where this package's modules lived before the embodied wing: a snapshot written then names them so
MOVED = {"m2flow.workloads.embodied.envs": __name__, "m2flow.workloads.embodied.normalize": f"{__package__}.normalize",
         "m2flow.workloads.embodied.maniskill": f"{__package__}.maniskill",
         "m2flow.workloads.embodied.metaworld": f"{__package__}.metaworld"}


class _Unpickler(pickle.Unpickler):
    """Reads a snapshot whose classes carry their module's former name (MOVED)."""

    def find_class(self, module: str, name: str):
        return super().find_class(MOVED.get(module, module), name)

# --- factory ---


def check_env_id(env_id: str) -> None:
    """Raise ValueError naming the closest ids when `env_id` is neither in the gymnasium registry nor a ManiSkill3
    task (`maniskill.TASKS`)."""
    if maniskill.is_maniskill(env_id) or ":" in env_id:  # "module:Env-v0" ids register themselves in gym.make
        return
    if metaworld.is_metaworld(env_id):
        metaworld.task_of(env_id)
        return
    if "," in env_id:  # several tasks: each must be one m2flow runs
        for task in maniskill.task_ids(env_id):
            check_env_id(task)
        raise ValueError(f"{env_id!r}: only ManiSkill3 tasks can share an env group ({', '.join(maniskill.TASKS)})")
    # ManiSkill registers all its tasks into gymnasium's registry once imported; m2flow runs those of TASKS
    known = [*(name for name, spec in gym.registry.items() if not maniskill.registered_by_it(spec)), *maniskill.TASKS]
    if env_id in gym.registry and env_id not in known:
        raise ValueError(f"{env_id!r} is a ManiSkill3 task m2flow does not run yet; tasks: "
                         f"{', '.join(maniskill.TASKS)}")
    if env_id in known:
        return
    close = difflib.get_close_matches(env_id, known, n=5, cutoff=0.6)
    hint = f"close matches: {', '.join(close)}" if close else "no close match (see gymnasium.pprint_registry())"
    raise ValueError(f"unknown gymnasium env id {env_id!r}; {hint}")


class PixelObservation(gym.ObservationWrapper):
    """Replaces the observation with the rendered frame, resized to [3, size, size] uint8 (channel first)."""

    def __init__(self, env: gym.Env, size: int = 64):
        super().__init__(env)
        if env.render_mode != "rgb_array":
            raise ValueError(f"{_env_name(env)}: pixel observations need render_mode='rgb_array', "
                             f"got {env.render_mode!r}")
        self.size = size
        self.observation_space = spaces.Box(0, 255, (3, size, size), np.uint8)

    def observation(self, obs):
        frame = self.env.render()
        if frame is None or np.ndim(frame) != 3:
            raise RuntimeError(f"{_env_name(self.env)}: render() gave {type(frame).__name__}, "
                               "expected an [H, W, 3] frame")
        x = torch.from_numpy(np.ascontiguousarray(frame[..., :3])).permute(2, 0, 1)  # [3, H, W]
        if x.shape[1:] != (self.size, self.size):
            x = F.interpolate(x[None].float(), size=(self.size, self.size), mode="area")[0].round().clamp(0, 255)
        return x.to(torch.uint8).numpy()


def make_env_fns(
    env_id: str,
    num_envs: int,
    seed: int = 0,
    pixels: bool = False,
    render_mode: str | None = None,
    image_size: int = 64,
    render_triangles: int = maniskill.RENDER_TRIANGLES,
    wrist_camera: bool = False,
    seed_groups: int = 1,
    **kwargs,
) -> list[Callable[[], gym.Env]]:
    """One constructor per env: `gym.make(env_id, render_mode, **kwargs)` (kwargs e.g. max_episode_steps=...).

    Env i's action space is seeded with seed + i (reproducible random actions); reset seeds are given by the caller
    (`EnvGroup.reset`, or `vec.reset(seed=seed)` which seeds env i with seed + i). `pixels=True` wraps each env
    in `PixelObservation(image_size)`; MuJoCo envs then render at that size directly, headless through EGL; ManiSkill3's
    scenes keep `render_triangles` visual triangles per body (maniskill.SimplifiedVisuals), and `wrist_camera` adds
    their hand camera's frames. Several ManiSkill3 tasks: env i runs `maniskill.env_tasks`' task i, so that each group
    of `seed_groups` consecutive envs (the envs that share a reset seed) runs one task.
    """
    check_env_id(env_id)
    if wrist_camera and not (pixels and maniskill.is_maniskill(env_id)):
        raise ValueError(f"{env_id}: a wrist camera (env.wrist_camera) adds frames to the pixel observations of the "
                         f"ManiSkill3 tasks ({', '.join(maniskill.TASKS)}, with pixels)")
    if maniskill.is_maniskill(env_id):  # SAPIEN, not a gym.make of the registry's defaults
        tasks = maniskill.task_ids(env_id)
        if pixels:  # the task camera's frames, packed with the proprioception and the instruction
            kwargs = {**kwargs, "pixels": True, "image_size": image_size, "render_triangles": render_triangles,
                      "wrist_camera": wrist_camera}
            kwargs.pop("instruct", None)  # a pixel observation carries the instruction always
        if len(tasks) > 1 and not kwargs.get("instruct") and not pixels:
            raise ValueError(f"{env_id}: several tasks in one env group need instruction observations (env.instruct="
                             f"true: the tasks' states differ in size, and the policy must be told the task)")
        maniskill.check_available()  # a one-line error here rather than in every env's constructor
        return [functools.partial(_make_seeded, maniskill.make, task, render_mode, seed + i, kwargs)
                for i, task in enumerate(maniskill.env_tasks(env_id, num_envs, seed_groups))]
    if kwargs.get("instruct"):
        raise ValueError(f"{env_id}: instruction observations (env.instruct) are for the ManiSkill3 tasks "
                         f"({', '.join(maniskill.TASKS)})")
    if metaworld.is_metaworld(env_id):
        if pixels:
            raise ValueError(f"{env_id}: pixel observations are not supported for Meta-World tasks yet (state only)")
        _route_mujoco_warnings()
        return [functools.partial(_make_seeded, metaworld.make, env_id, render_mode, seed + i, kwargs)
                for i in range(num_envs)]
    is_mujoco = ":" not in env_id and "mujoco" in str(gym.spec(env_id).entry_point)
    if is_mujoco:
        _route_mujoco_warnings()
    if pixels:
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"{env_id}: pixels=True renders rgb_array frames; got render_mode={render_mode!r}")
        render_mode = "rgb_array"
        if is_mujoco:
            kwargs.setdefault("width", image_size)
            kwargs.setdefault("height", image_size)
            if not os.environ.get("DISPLAY"):
                os.environ.setdefault("MUJOCO_GL", "egl")  # read when the first renderer is made

    def make(i: int) -> gym.Env:
        env = gym.make(env_id, render_mode=render_mode, **kwargs)
        if pixels:
            env = PixelObservation(env, image_size)
        env.action_space.seed(seed + i)
        return env

    return [functools.partial(make, i) for i in range(num_envs)]


def _make_seeded(make: Callable[..., gym.Env], env_id: str, render_mode: str | None, action_seed: int,
                 kwargs: dict) -> gym.Env:
    """`make(env_id, render_mode=..., **kwargs)` (a family's own maker: ManiSkill3's, Meta-World's), its action
    space seeded."""
    env = make(env_id, render_mode=render_mode, **kwargs)
    env.action_space.seed(action_seed)
    return env


def make_vector_env(env_id: str, num_envs: int, seed: int = 0, pixels: bool = False, render_mode: str | None = None,
                    **kwargs) -> SyncVectorEnv:
    """A plain `SyncVectorEnv` with SAME_STEP autoreset over `make_env_fns(...)`; call `reset(seed=seed)` on it."""
    fns = make_env_fns(env_id, num_envs, seed, pixels=pixels, render_mode=render_mode, **kwargs)
    return SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)


def _route_mujoco_warnings() -> None:
    """MuJoCo writes each warning to stderr and to MUJOCO_LOG.TXT in the working directory (HalfCheetah-v5's XML
    gives one per env made): send them to logging instead, once per distinct message, unless a handler is set."""
    import mujoco

    if mujoco.get_mju_user_warning() is not None:
        return
    seen: set[str] = set()

    def warn(message: str) -> None:
        if message not in seen:
            seen.add(message)
            logging.getLogger(__name__).warning("mujoco: %s", message)

    mujoco.set_mju_user_warning(warn)


def _env_name(env: gym.Env) -> str:
    return env.spec.id if env.spec is not None else type(env.unwrapped).__name__


# --- EnvGroup ---


@dataclass
class StepResult:
    """What one policy step (one action, or one chunk of k actions) gives for the n envs of a group or stage."""

    obs: np.ndarray  # [n, *obs] next obs (first obs of the next episode where one ended); normalized if enabled
    reward: np.ndarray  # [n] float32: raw_reward, scaled if reward scaling is on
    raw_reward: np.ndarray  # [n] float64: sum of the env's rewards over the sub-steps executed
    terminated: np.ndarray  # [n] bool: the episode reached a terminal state (no bootstrap)
    truncated: np.ndarray  # [n] bool: cut by a time limit and not terminated (bootstrap from V(final_obs))
    final_obs: np.ndarray  # [n, *obs] last obs of the episode that ended (normalized like obs); 0 where none ended
    env_steps: np.ndarray  # [n] int: env steps executed (k, or fewer when the episode ended inside the chunk)


class _Pending:
    """Normalizer inputs of one round (one obs emission per env), merged once every env has filled its row."""

    def __init__(self, n: int, obs_shape: tuple | None, with_returns: bool):
        self.obs = np.zeros((n, *obs_shape)) if obs_shape is not None else None
        self.returns = np.full(n, np.nan) if with_returns else None
        self.filled = np.zeros(n, bool)


class _Shared:
    """The state of all N envs, shared by an EnvGroup and the stage views that `split` makes of it."""

    def __init__(self, envs, env_id, seeds, seed_groups, obs_norm, reward_scaler, training):
        n = len(envs)
        self.envs, self.env_id, self.seeds = envs, env_id, seeds
        self.obs_norm, self.reward_scaler, self.training = obs_norm, reward_scaler, training
        self.ep_return = np.zeros(n)  # raw, unnormalized
        self.ep_length = np.zeros(n, np.int64)
        self.success_once = np.zeros(n, bool)
        self.success_now = np.zeros(n, bool)  # at the last step
        self.reports_success = np.zeros(n, bool)
        self.disc_return = np.zeros(n)  # G_t for reward scaling
        self.env_steps = np.zeros(n, np.int64)  # total env steps of env i (for error messages)
        self.round = np.zeros(n, np.int64)  # obs emissions of env i: the normalizers merge data round by round
        self.pending: dict[int, _Pending] = {}
        self.episodes: list[dict] = []
        several = env_id and maniskill.is_maniskill(env_id) and len(maniskill.task_ids(env_id)) > 1
        self.tasks = maniskill.env_tasks(env_id, n, seed_groups) if several else None  # make_env_fns' order

    def record(self, lo: int, obs_raw: np.ndarray, returns: np.ndarray | None) -> None:
        """Queue rows for envs lo.. at their current round; merge every round all N envs have reached, in env order.

        The merged statistics thus depend only on the data, never on how the envs were split into stages. Obs of round
        t are normalized with rounds < t merged when the stages step round-robin (as a pipelined env worker does), so
        that gives bit-identical data to stepping the whole group; a stage that runs ahead uses what is merged so far.
        """
        rounds = self.round[lo:lo + len(obs_raw)]
        for r in np.unique(rounds):  # one round, unless the stages were stepped unevenly
            rows = np.flatnonzero(rounds == r)
            p = self.pending.get(r)
            if p is None:
                p = self.pending[r] = _Pending(len(self.envs), obs_raw.shape[1:] if self.obs_norm else None,
                                               self.reward_scaler is not None)
            if p.obs is not None:
                p.obs[lo + rows] = obs_raw[rows]
            if p.returns is not None and returns is not None:
                p.returns[lo + rows] = returns[rows]
            p.filled[lo + rows] = True
        rounds += 1
        while self.pending and self.pending[min(self.pending)].filled.all():
            p = self.pending.pop(min(self.pending))
            if p.obs is not None:
                self.obs_norm.update(p.obs)
            if p.returns is not None and not np.isnan(p.returns).all():
                self.reward_scaler.update(p.returns[~np.isnan(p.returns)])


def _mujoco_state(env) -> dict | None:
    """A gymnasium MuJoCo env's state that pickling loses: MuJoCo's full integration state (positions, velocities,
    activations, warm start: the next step is bit for bit the same) and the env's RNG. None for other envs."""
    if not type(env).__module__.startswith("gymnasium.envs.mujoco"):
        return None
    import mujoco

    kind = mujoco.mjtState.mjSTATE_INTEGRATION
    state = np.empty(mujoco.mj_stateSize(env.model, kind))
    mujoco.mj_getState(env.model, env.data, state, kind)
    return {"mujoco": state, "rng": env.np_random.bit_generator.state}


def _set_mujoco_state(env, extra: dict) -> None:
    import mujoco

    mujoco.mj_setState(env.model, env.data, extra["mujoco"], mujoco.mjtState.mjSTATE_INTEGRATION)
    mujoco.mj_forward(env.model, env.data)
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = extra["rng"]
    env.np_random = rng


class EnvGroup:
    """N gymnasium envs stepped together (SAME_STEP autoreset), with the bookkeeping an RL learner needs.

    - seeds: `reset()` seeds env i with seed + i // seed_groups, so groups of `seed_groups` consecutive envs start
      from the same state (embodied GRPO); autoresets inside a rollout continue each env's own RNG.
    - normalization (optional): obs by running mean/std, rewards by the running std of discounted returns
      (SB3 VecNormalize). Obs are normalized with the statistics of all earlier rounds, then queued (see
      `_Shared.record`); `training=False` freezes them. `state_dict()` / `load_state_dict()` carry them.
    - episodes: raw return, length, a multi-task group's task and, when the env reports info["success"] /
      info["is_success"], `success_once` (at any step) and `success` (at the last step), collected by
      `pop_episodes()`.
    - chunks: `step_chunk(actions[n, k, ...])` executes up to k actions per env as ONE learner step; see there.
    - stages: `split(s)` gives s views of consecutive envs sharing this state, for env/policy pipelining.
    Box actions are clipped to the bounds before the env sees them (`clip_actions=True`, the policy keeps the
    unclipped sample for its logprob); otherwise out-of-bounds actions are an error.
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], env_id: str | None = None, seed: int = 0,
                 seed_groups: int = 1, norm_obs: bool = False, norm_reward: bool = False, gamma: float = 0.99,
                 clip_obs: float = 10.0, clip_reward: float = 10.0, clip_actions: bool = True, training: bool = True):
        envs = [fn() for fn in env_fns]
        if not envs:
            raise ValueError("EnvGroup needs at least one env")
        env_id = env_id or _env_name(envs[0])
        n = len(envs)
        if seed_groups < 1 or n % seed_groups:
            raise ValueError(f"{env_id}: seed_groups={seed_groups} must divide num_envs={n}")
        obs_space, act_space = envs[0].observation_space, envs[0].action_space
        for i, env in enumerate(envs):
            if env.observation_space != obs_space or env.action_space != act_space:
                raise ValueError(f"{env_id}: env {i} has spaces {env.observation_space}, {env.action_space}; "
                                 f"env 0 has {obs_space}, {act_space}")
        if not isinstance(obs_space, spaces.Box):
            raise ValueError(f"{env_id}: observation space {obs_space} is not supported (Box only)")
        if not isinstance(act_space, (spaces.Box, spaces.Discrete)):
            raise ValueError(f"{env_id}: action space {act_space} is not supported (Box or Discrete)")
        self._float_obs = np.issubdtype(obs_space.dtype, np.floating)
        if norm_obs and not self._float_obs:
            raise ValueError(f"{env_id}: norm_obs needs float observations, got {obs_space.dtype} "
                             "(pixel policies scale uint8 frames themselves)")
        self.observation_space, self.action_space = obs_space, act_space
        self.seed, self.seed_groups, self.clip_actions = seed, seed_groups, clip_actions
        self._gamma = gamma
        self._s = _Shared(envs, env_id, seed + np.arange(n) // seed_groups, seed_groups,
                          ObsNormalizer(obs_space.shape, clip_obs) if norm_obs else None,
                          RewardScaler(gamma, clip_reward) if norm_reward else None, training)
        self._lo, self._hi = 0, n

    @classmethod
    def make(cls, env_id: str, num_envs: int, seed: int = 0, *, pixels: bool = False, render_mode: str | None = None,
             image_size: int = 64, env_kwargs: dict | None = None, **options) -> "EnvGroup":
        """`EnvGroup(make_env_fns(env_id, num_envs, seed, pixels, ...), **options)`; options as in `__init__`."""
        fns = make_env_fns(env_id, num_envs, seed, pixels=pixels, render_mode=render_mode, image_size=image_size,
                           seed_groups=options.get("seed_groups", 1), **(env_kwargs or {}))
        return cls(fns, env_id=env_id, seed=seed, **options)

    # --- views ---

    @property
    def env_id(self) -> str:
        return self._s.env_id

    @property
    def num_envs(self) -> int:
        return self._hi - self._lo

    @property
    def env_indices(self) -> range:
        """Global indices (in the full group) of this group's envs."""
        return range(self._lo, self._hi)

    @property
    def envs(self) -> list[gym.Env]:
        return self._s.envs[self._lo:self._hi]

    @property
    def training(self) -> bool:
        return self._s.training

    @training.setter
    def training(self, mode: bool) -> None:
        self._s.training = mode

    def split(self, stages: int) -> list["EnvGroup"]:
        """`stages` views of consecutive envs (sizes differ by at most one) sharing this group's state.

        Stepping the views round-robin (stage 0, 1, ..., s-1, then stage 0 again) gives exactly the data of stepping
        the whole group, normalization included (see `_Shared.record`). Views share unlocked state: step them from
        one thread (the env worker), while the policy works on the other stages elsewhere.
        """
        n = self.num_envs
        if not 1 <= stages <= n:
            raise ValueError(f"{self.env_id}: cannot split {n} envs into {stages} stages")
        bounds = [self._lo + (n * k) // stages for k in range(stages + 1)]
        views = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            view = object.__new__(EnvGroup)
            view.__dict__.update(self.__dict__)
            view._lo, view._hi = lo, hi
            views.append(view)
        return views

    # --- stepping ---

    def reset(self, seed: int | None = None) -> np.ndarray:
        """Reset every env, env i with seed + i // seed_groups (seed: the group's seed if None). -> obs [n, *obs]."""
        s = self._s
        seeds = s.seeds if seed is None else seed + np.arange(len(s.envs)) // self.seed_groups
        obs_raw = self._obs_buffer()
        for j, i in enumerate(self.env_indices):
            obs_raw[j], _ = s.envs[i].reset(seed=int(seeds[i]))
            self._check_finite(i, obs_raw[j], 0.0, "reset")
            self._start_episode(i)
        s.disc_return[self._lo:self._hi] = 0.0
        return self._emit(obs_raw, None)

    def step(self, actions) -> StepResult:
        """actions: [n, *action_shape] (numpy or torch). One env step per env."""
        return self._step(self._check_actions(actions, chunk=False))

    def step_chunk(self, actions) -> StepResult:
        """actions: [n, k, *action_shape]: ONE learner step made of up to k env steps per env.

        Env i executes actions[i, 0], actions[i, 1], ... and stops at the first sub-step that ends its episode: the
        rest of its chunk is dropped, it auto-resets, and `obs[i]` is the first obs of its next episode (final_obs
        holds the last one). The reward is the plain sum of the executed sub-steps' rewards (the chunk is one step
        for the learner: one discount per chunk, as in RLinf's chunked VLA policies); `env_steps` says how many ran.
        Episode lengths count env steps, returns sum every raw reward.
        """
        return self._step(self._check_actions(actions, chunk=True))

    def _step(self, acts: np.ndarray) -> StepResult:
        s, n = self._s, self.num_envs
        obs_raw, final_raw = self._obs_buffer(), self._obs_buffer(zero=True)
        raw_reward = np.zeros(n)
        terminated, truncated = np.zeros(n, bool), np.zeros(n, bool)
        env_steps = np.zeros(n, np.int64)
        for j, i in enumerate(self.env_indices):
            env = s.envs[i]
            for c in range(acts.shape[1]):
                obs, reward, term, trunc, info = env.step(acts[j, c])
                s.env_steps[i] += 1
                s.ep_length[i] += 1
                env_steps[j] += 1
                self._check_finite(i, obs, reward, "step")  # names this step: its env and episode step counts
                raw_reward[j] += float(reward)
                s.ep_return[i] += float(reward)
                success = info.get("success", info.get("is_success"))
                if success is not None:
                    s.reports_success[i] = True
                    s.success_now[i] = bool(np.any(success))
                    s.success_once[i] |= s.success_now[i]
                if term or trunc:
                    terminated[j], truncated[j] = bool(term), bool(trunc and not term)
                    final_raw[j] = obs
                    self._end_episode(i)
                    obs, _ = env.reset()
                    self._check_finite(i, obs, 0.0, "reset")
                    break
            obs_raw[j] = obs
        done = terminated | truncated
        returns = s.disc_return[self._lo:self._hi]  # a view: updated in place
        returns *= self._gamma
        returns += raw_reward
        reward = s.reward_scaler(raw_reward) if s.reward_scaler else raw_reward.astype(np.float32)
        final_obs = np.zeros(obs_raw.shape, np.float32 if self._float_obs else obs_raw.dtype)
        if done.any():
            final_obs[done] = self._normalize(final_raw[done])
        next_obs = self._emit(obs_raw, returns.copy())
        returns[done] = 0.0
        return StepResult(next_obs, reward, raw_reward, terminated, truncated, final_obs, env_steps)

    # --- episode stats and state ---

    def pop_episodes(self) -> list[dict]:
        """Finished episodes of this group's envs since the last call: dicts with env_index, return (raw), length
        (env steps) and, for envs that report success, success_once and success (at the episode's last step)."""
        mine = [e for e in self._s.episodes if self._lo <= e["env_index"] < self._hi]
        self._s.episodes = [e for e in self._s.episodes if not self._lo <= e["env_index"] < self._hi]
        return mine

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Normalizer statistics, a flat dict of float64 tensors ("obs.mean", "reward.var", ...): safetensors-ready."""
        out = {}
        for prefix, norm in (("obs", self._s.obs_norm), ("reward", self._s.reward_scaler)):
            if norm is not None:
                out.update({f"{prefix}.{k}": v for k, v in norm.state_dict().items()})
        return out

    def load_state_dict(self, state: dict) -> None:
        expected = set(self.state_dict())
        if set(state) != expected:
            raise KeyError(f"{self.env_id}: EnvGroup state has fields {sorted(state)}, expected {sorted(expected)}")
        for prefix, norm in (("obs", self._s.obs_norm), ("reward", self._s.reward_scaler)):
            if norm is not None:
                norm.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(prefix + ".")})
        self._s.pending.clear()

    def snapshot(self) -> bytes | None:
        """The whole group's state as a pickle: every env mid-episode (its simulator and RNG), the episode
        bookkeeping, the normalizers. `restore` continues from it as if never stopped. gymnasium's MuJoCo envs pickle
        by rebuilding themselves from their constructor's arguments (EzPickle), keeping no state, so their simulator
        state (MuJoCo's integration state) and RNG go beside them. None where an env cannot be captured: it does
        not pickle (a simulator behind native handles, as ManiSkill's), or it is another EzPickle env (Meta-World's
        keep task state outside the simulator)."""

        extras = []
        for env in self._s.envs:
            if isinstance(env.unwrapped, gym.utils.EzPickle):
                extras.append(_mujoco_state(env.unwrapped))
                if extras[-1] is None:
                    return None
            else:
                extras.append(None)
        try:
            return pickle.dumps((self._s, extras))
        except Exception:  # noqa: BLE001 (any env's own reason not to pickle)
            return None

    def restore(self, blob: bytes) -> None:
        """Continue from a `snapshot` of a group of the same envs: this group's envs are closed and replaced, in
        place, so that the stage views `split` made of it see the restored state too."""
        state, extras = _Unpickler(io.BytesIO(blob)).load()
        if len(state.envs) != len(self._s.envs) or state.env_id != self._s.env_id:
            raise ValueError(f"{self.env_id}: the snapshot holds {len(state.envs)} envs of {state.env_id}, this group "
                             f"{len(self._s.envs)} of {self._s.env_id}")
        for env, extra in zip(state.envs, extras):
            if extra is not None:
                _set_mujoco_state(env.unwrapped, extra)
        for env in self._s.envs:
            env.close()
        self._s.__dict__.clear()
        self._s.__dict__.update(state.__dict__)

    def close(self) -> None:
        for env in self.envs:
            env.close()

    # --- helpers ---

    def _obs_buffer(self, zero: bool = False) -> np.ndarray:
        dtype = np.float64 if self._float_obs else self.observation_space.dtype
        return (np.zeros if zero else np.empty)((self.num_envs, *self.observation_space.shape), dtype)

    def _normalize(self, obs_raw: np.ndarray) -> np.ndarray:
        if self._s.obs_norm is not None:
            return self._s.obs_norm(obs_raw)
        return obs_raw.astype(np.float32) if self._float_obs else obs_raw

    def _emit(self, obs_raw: np.ndarray, returns: np.ndarray | None) -> np.ndarray:
        """Normalize with the statistics so far, then queue the raw rows for the next merge."""
        out = self._normalize(obs_raw)
        s = self._s
        if s.training and (s.obs_norm is not None or s.reward_scaler is not None):
            s.record(self._lo, obs_raw, returns)
        return out

    def _start_episode(self, i: int) -> None:
        s = self._s
        s.ep_return[i], s.ep_length[i], s.success_once[i], s.reports_success[i] = 0.0, 0, False, False
        s.success_now[i] = False

    def _end_episode(self, i: int) -> None:
        s = self._s
        ep = {"env_index": i, "return": float(s.ep_return[i]), "length": int(s.ep_length[i])}
        if s.reports_success[i]:  # success at any step, and at the episode's last
            ep["success_once"], ep["success"] = bool(s.success_once[i]), bool(s.success_now[i])
        if s.tasks:  # a multi-task group: which task the episode was
            ep["task"] = s.tasks[i]
        s.episodes.append(ep)
        self._start_episode(i)

    def _check_finite(self, i: int, obs, reward, where: str) -> None:
        if (not self._float_obs or np.isfinite(obs).all()) and math.isfinite(reward):
            return
        s = self._s
        field, value = ("reward", reward) if not math.isfinite(reward) else ("observation", obs)
        raise ValueError(f"{s.env_id}: non-finite {field} from env {i} at {where} (env step {s.env_steps[i]}, "
                         f"episode step {s.ep_length[i]}): {np.asarray(value)}")

    def _check_actions(self, actions, chunk: bool) -> np.ndarray:
        """-> [n, k, *action_shape] in the space's dtype, clipped to Box bounds; clear errors on any mismatch."""
        a = actions.detach().cpu().numpy() if isinstance(actions, torch.Tensor) else np.asarray(actions)
        space, n = self.action_space, self.num_envs
        if chunk:
            expected = f"(n={n}, k, *{space.shape})"
            ok = a.ndim == 2 + len(space.shape) and a.shape[0] == n and a.shape[1] >= 1 and a.shape[2:] == space.shape
        else:
            expected, ok = (n, *space.shape), a.shape == (n, *space.shape)
        where = f"{self.env_id}: actions of shape {a.shape} and dtype {a.dtype} do not fit the action space {space}"
        if not ok:
            raise ValueError(f"{where}: expected shape {expected}")
        if isinstance(space, spaces.Box):
            if not np.issubdtype(a.dtype, np.floating):
                raise TypeError(f"{where}: expected floating actions")
            bad = ~np.isfinite(a).reshape(n, -1).all(1)
            if bad.any():
                raise ValueError(f"{where}: non-finite actions for envs {(np.flatnonzero(bad) + self._lo).tolist()}")
            if self.clip_actions:
                a = np.clip(a, space.low, space.high)
            elif ((a < space.low) | (a > space.high)).any():
                raise ValueError(f"{where}: actions outside the bounds [{space.low}, {space.high}]")
        else:
            if not np.issubdtype(a.dtype, np.integer):
                raise TypeError(f"{where}: expected integer actions")
            if ((a < space.start) | (a >= space.start + space.n)).any():
                raise ValueError(f"{where}: actions outside [{space.start}, {space.start + space.n})")
        a = a.astype(space.dtype)
        return a if chunk else a[:, None]


# --- rollouts ---


@dataclass
class Trajectory:
    """T learner steps of N envs; [t, i] is the transition taken from obs[t, i]."""

    obs: torch.Tensor  # [T, N, *obs] policy input (normalized)
    actions: torch.Tensor  # [T, N, *act] or [T, N, k, *act] for chunks: as sampled (unclipped)
    logprobs: torch.Tensor  # [T, N] log pi(actions | obs) at collection time
    values: torch.Tensor  # [T, N] V(obs)
    rewards: torch.Tensor  # [T, N] reward of the step (scaled if the group scales rewards)
    terminated: torch.Tensor  # [T, N] bool: terminal state, no bootstrap
    truncated: torch.Tensor  # [T, N] bool: time limit: bootstrap from final_values
    final_values: torch.Tensor  # [T, N] V(final obs) where truncated, else 0
    next_obs: torch.Tensor  # [N, *obs] obs after the last step (start of the next rollout)
    next_values: torch.Tensor  # [N] V(next_obs): bootstrap for step T-1
    final_obs: torch.Tensor | None = None  # [T, N, *obs] the episode's last obs where a step ended one, else 0
    # (recorded for off-policy algorithms only: their replay buffer's next obs)

    @staticmethod
    def cat_envs(parts: Sequence["Trajectory"]) -> "Trajectory":
        """Join the trajectories of consecutive env stages along the env axis (dim 1; dim 0 for next_*)."""
        joined = {}
        for f in fields(Trajectory):
            dim = 0 if f.name.startswith("next_") else 1
            got = [getattr(p, f.name) for p in parts]
            joined[f.name] = None if got[0] is None else torch.cat(got, dim=dim)
        return Trajectory(**joined)


def collect_lockstep(env_group: EnvGroup, policy_fn: Callable, steps: int, value_fn: Callable | None = None,
                     obs: np.ndarray | torch.Tensor | None = None) -> Trajectory:
    """Roll `env_group` for `steps` learner steps, all envs in lock step: the reference for pipelined collection.

    policy_fn(obs[N, *obs]) -> (actions, logprobs[N], values[N] or None), actions [N, *act] or chunks [N, k, *act]
    (told apart by their number of dims); value_fn(obs) -> values[N], used for V(final obs) of truncated steps and
    V(next_obs) (None: zeros, for critic-free algorithms). obs: the start obs (None: `env_group.reset()`).
    """
    obs = torch.as_tensor(env_group.reset() if obs is None else obs)
    n, chunked_ndim = env_group.num_envs, 2 + len(env_group.action_space.shape)
    zeros = torch.zeros(n)
    cols: dict[str, list] = {}
    with torch.no_grad():
        for _ in range(steps):
            actions, logprobs, values = policy_fn(obs)
            chunked = actions.ndim == chunked_ndim
            res = env_group.step_chunk(actions) if chunked else env_group.step(actions)
            final_values = zeros.clone()
            if value_fn is not None and res.truncated.any():
                idx = torch.from_numpy(np.flatnonzero(res.truncated))
                final_values[idx] = value_fn(torch.as_tensor(res.final_obs)[idx]).float()
            row = {"obs": obs, "actions": actions, "logprobs": zeros if logprobs is None else logprobs,
                   "values": zeros if values is None else values, "rewards": torch.from_numpy(res.reward),
                   "terminated": torch.from_numpy(res.terminated), "truncated": torch.from_numpy(res.truncated),
                   "final_values": final_values}
            for key, value in row.items():
                cols.setdefault(key, []).append(value)
            obs = torch.as_tensor(res.obs)
        next_values = zeros.clone() if value_fn is None else value_fn(obs).float()
    out = {k: torch.stack(v) for k, v in cols.items()}
    return Trajectory(**out, next_obs=obs, next_values=next_values)


def summarize_episodes(episodes: Sequence[dict]) -> dict[str, float]:
    """Mean return / length (and success rate where reported) of finished episodes, for metrics logging."""
    if not episodes:
        return {"episodes": 0}
    out = {"episodes": len(episodes), "return": float(np.mean([e["return"] for e in episodes])),
           "length": float(np.mean([e["length"] for e in episodes]))}
    reported = [e for e in episodes if "success_once" in e]
    if reported:
        out["success_once"] = float(np.mean([e["success_once"] for e in reported]))
        out["success"] = float(np.mean([e["success"] for e in reported]))
    return out
