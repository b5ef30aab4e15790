"""Env worker: steps its share of the envs, split into `env.pipeline_stages` stages, against a policy worker.

Per time step it sends each stage's obs to the policy and steps the stage once its actions arrive; with two stages the
simulator steps one while the policy infers for the other (one stage: lockstep). At the end of a rollout it puts the
[T, n] trajectory, values of truncated episodes' final obs included, into the actor's channel. It never runs a policy.

Obs go to the policy as direct calls (`policy.act(request)` returns a handle at once; the env waits on it only when
the stage comes round again), not through a channel: a request/answer pair per stage and step is an RPC, and a direct
call is one hop where a channel round trip is three (put, get, put back through the channel actor), which dominates
a small policy's step (measured on 2 loaded cores: 1.4 ms vs 8.7 ms). Trajectories, the bulk data, use a channel.
With `cluster.compress_frames`, uint8 observations (frames) in requests to a policy worker on another node travel
compressed (runtime/compression.py); the trajectories' channel is made so by the flow.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from m2flow.algorithms import first_episode_mask
from m2flow.embodied.envs import EnvGroup, Trajectory, make_env_fns
from m2flow.runtime import Worker, WorkerError, concurrent, wait_all
from m2flow.runtime import compression
from m2flow.runtime.files import load_sealed, save_sealed
from m2flow.runtime.stream import consumers_of


def make_env_group(cfg, num_envs: int, seed: int, training: bool = True, render_mode: str | None = None,
                   wrap=None, seed_groups: int | None = None) -> EnvGroup:
    """The EnvGroup of `cfg.env` (normalization, seed groups); `wrap(i, env_fn) -> env_fn` can wrap env i."""
    e = cfg.env
    kwargs = dict(e.kwargs)
    if e.max_episode_steps is not None:
        kwargs["max_episode_steps"] = e.max_episode_steps
    if e.instruct:
        kwargs["instruct"] = True
    groups = seed_groups or e.seed_groups
    fns = make_env_fns(e.id, num_envs, seed, pixels=e.pixels, render_mode=render_mode, image_size=e.image_size,
                       render_triangles=e.render_triangles, wrist_camera=e.wrist_camera, seed_groups=groups, **kwargs)
    if wrap is not None:
        fns = [wrap(i, fn) for i, fn in enumerate(fns)]
    return EnvGroup(fns, env_id=e.id, seed=seed, seed_groups=groups, norm_obs=e.norm_obs,
                    norm_reward=e.norm_reward, gamma=cfg.algorithm.gamma, clip_obs=e.clip_obs,
                    clip_reward=e.clip_reward, training=training)


class EnvWorker(Worker):
    def __init__(self, cfg):
        e = self.cfg_env = cfg.env
        self.cfg = cfg
        if e.num_envs % self.world_size:
            raise ValueError(f"env.num_envs={e.num_envs} must be a multiple of the env workers ({self.world_size})")
        n = e.num_envs // self.world_size
        if n % e.seed_groups:
            raise ValueError(f"env.seed_groups={e.seed_groups} must divide the envs per env worker ({n})")
        if e.pipeline_stages > n:
            raise ValueError(f"env.pipeline_stages={e.pipeline_stages} exceeds the envs per env worker ({n})")
        self.lo, self.total = self.rank * n, e.num_envs  # this worker's envs are lo..lo+n of all `total` envs
        self.group = make_env_group(cfg, n, cfg.run.seed + self.lo // e.seed_groups)
        self.stages = self.group.split(e.pipeline_stages)
        self.obs: list[np.ndarray] | None = None  # current obs per stage
        self.busy_since: float | None = None  # monotonic start of the env step (or reset) under way

    @contextmanager
    def _in_env(self):
        """Mark an env step or reset as under way (what `stuck_seconds` reports)."""
        self.busy_since = time.monotonic()
        try:
            yield
        finally:
            self.busy_since = None

    @concurrent
    def stuck_seconds(self) -> float:
        """How long the env step (or reset) under way has run; 0 between them. Answers while `rollout` runs."""
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    def spaces(self):
        return self.group.observation_space, self.group.action_space

    def reset_seed(self, step: int) -> int:
        """Reset seed of iteration `step`: groups of seed_groups envs share it, whatever the worker count."""
        e = self.cfg_env
        return self.cfg.run.seed + step * (self.total // e.seed_groups) + self.lo // e.seed_groups

    def rollout(self, policy, out, steps: int, step: int, actor_ranks: int | None = None,
                trace: bool = False) -> dict:
        """`steps` policy steps of every env, asking `policy` (a PolicyWorker group of one rank) for each stage's
        actions; puts {env_rank, traj, scores} into `out` once per actor rank (key = actor rank; `actor_ranks`
        defaults to the channel's consumers).

        Stage s's next request is sent before stage s+1 is stepped and answered only when stage s comes round again,
        so with two stages the policy infers for one while the simulator steps the other (one stage: lockstep)."""
        grpo = self.cfg.algorithm.name == "grpo"
        if self.obs is None or grpo:  # grpo: every iteration starts each group from one shared state
            with self._in_env():
                obs = self.group.reset(seed=self.reset_seed(step))
            self.obs = [obs[st.env_indices.start:st.env_indices.stop] for st in self.stages]
        chunked, off_policy = self.cfg_env.chunk > 1, self.cfg.algorithm.name == "sac"
        rows: list[list[dict]] = [[] for _ in self.stages]
        truncs = [np.zeros(0, np.int64) for _ in self.stages]
        timing = {"env_time": 0.0, "wait_time": 0.0, "policy_time": 0.0}
        env_steps, start = 0, time.perf_counter()
        t0 = step * steps  # policy time step of the rollout's first action: the sampling-noise clock
        wire = self._wire(policy, timing)

        def ask(s: int, t: int, obs: np.ndarray, final, values_only: bool):
            lo = self.lo + self.stages[s].env_indices.start  # global index of the stage's first env
            return policy.act({"env_rank": self.rank, "stage": s, "t": t, "lo": lo, "total": self.total,
                               "obs": wire(obs), "final_obs": final,
                               "values_only": values_only, "step": step, "trace": trace})

        def answer(s: int) -> dict:
            w = time.perf_counter()
            reply = pending[s].wait()[0]
            timing["wait_time"] += time.perf_counter() - w
            timing["policy_time"] += reply["seconds"]
            if truncs[s].size:  # V(final obs) of the stage's episodes truncated on the previous step
                rows[s][-1]["final_values"][truncs[s]] = reply["final_values"]
            return reply

        pending = [ask(s, t0, self.obs[s], None, steps == 0) for s in range(len(self.stages))]
        for t in range(steps):
            for s, st in enumerate(self.stages):
                reply = answer(s)
                w, wall = time.perf_counter(), time.time()
                with self._in_env():
                    res = st.step_chunk(reply["actions"]) if chunked else st.step(reply["actions"])
                timing["env_time"] += time.perf_counter() - w
                if trace:
                    self.tracer.record(f"env s{s}", wall, time.time(), step)
                env_steps += int(res.env_steps.sum())
                rows[s].append({"obs": self.obs[s], "actions": reply["actions"], "logprobs": reply["logprobs"],
                                "values": reply["values"], "rewards": res.reward, "raw_rewards": res.raw_reward,
                                "terminated": res.terminated, "truncated": res.truncated,
                                "final_values": np.zeros(st.num_envs, np.float32)})
                if off_policy:  # the replay buffer's next obs where an episode ended
                    rows[s][-1]["final_obs"] = res.final_obs
                truncs[s] = np.flatnonzero(res.truncated)
                self.obs[s] = res.obs
                final = res.final_obs[truncs[s]] if truncs[s].size else None
                pending[s] = ask(s, t0 + t + 1, res.obs, final, t == steps - 1)
        parts = []
        for s in range(len(self.stages)):
            next_values = torch.tensor(answer(s)["values"])
            cols = {k: torch.from_numpy(np.stack([r[k] for r in rows[s]])) for k in rows[s][0]} if rows[s] else {}
            cols.pop("raw_rewards", None)
            parts.append(Trajectory(**cols, next_obs=torch.from_numpy(self.obs[s]), next_values=next_values))
        traj = Trajectory.cat_envs(parts)
        episodes = self.group.pop_episodes()
        for e in episodes:
            e["env_index"] += self.lo
        scores = self._scores(rows, episodes) if grpo else None
        seconds = time.perf_counter() - start
        for a in range(consumers_of(out, actor_ranks)):
            out.put({"env_rank": self.rank, "traj": traj, "scores": scores}, key=a)
        return {"episodes": episodes, "env_steps": env_steps, "seconds": seconds, **timing}

    def _wire(self, policy, timing: dict):
        """How this rollout's observations go to `policy`: compressed where they are frames, `cluster.compress_frames`
        is on and the policy worker sits on another node (their bytes before and after counted in `timing`), else as
        they are."""
        if not (self.cfg.cluster.compress_frames and self.devices
                and policy.info().wait()[0]["node_id"] != self.devices[0].node_id):
            return lambda obs: obs
        timing["obs_bytes"] = timing["obs_bytes_sent"] = 0

        def wire(obs: np.ndarray):
            if not compression.compressible(obs):
                return obs
            packed = compression.compress(obs)
            timing["obs_bytes"] += obs.nbytes
            timing["obs_bytes_sent"] += packed.nbytes
            return packed

        return wire

    def _scores(self, rows: list[list[dict]], episodes: list[dict]) -> torch.Tensor:
        """GRPO outcome of each env's first episode this rollout: success_once where the env reports success
        (algorithm.score), else its raw return (partial if it did not end)."""
        def column(key):  # [T, n] over all stages
            return torch.from_numpy(np.concatenate([np.stack([r[key] for r in rs]) for rs in rows], 1))

        done = column("terminated") | column("truncated")
        raw = column("raw_rewards")
        partial = (raw * first_episode_mask(done)).sum(0)
        first: dict[int, dict] = {}
        for e in episodes:
            first.setdefault(e["env_index"] - self.lo, e)
        mode = self.cfg.algorithm.score
        success = mode == "success" or (mode == "auto" and any("success_once" in e for e in episodes))
        scores = torch.zeros(self.group.num_envs)
        for i in range(self.group.num_envs):
            if success:
                scores[i] = float(first[i].get("success_once", False)) if i in first else 0.0
            else:
                scores[i] = first[i]["return"] if i in first else float(partial[i])
        return scores

    # -- normalizer state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.group.state_dict()

    def save_state(self, directory: str) -> None:
        """Normalizer statistics to directory/env_<rank>.safetensors (nothing if the envs do not normalize), and
        where the envs can be captured (`EnvGroup.snapshot`) the envs mid-episode with the obs each stage holds, to
        env_<rank>.pkl (a pickle, sealed: `runtime.files.save_sealed`): a resume then continues every episode where it was, as an uninterrupted run does."""
        from safetensors.torch import save_file

        state = self.group.state_dict()
        if state:
            save_file(state, str(Path(directory) / f"env_{self.rank}.safetensors"))
        blob = self.group.snapshot() if self.obs is not None else None
        if blob is not None:
            save_sealed({"group": blob, "obs": self.obs}, Path(directory) / f"env_{self.rank}.pkl")

    def load_state(self, directory: str) -> None:
        """The normalizers, and the envs mid-episode where the checkpoint captured them (else every env starts a
        new episode at the next rollout)."""
        from safetensors.torch import load_file

        snap = Path(directory) / f"env_{self.rank}.pkl"
        if snap.exists():  # a pickle: loaded only if this machine's m2flow sealed it (else refused, naming it)
            state = load_sealed(snap)
            self.group.restore(state["group"])
            self.obs = state["obs"]
        path = Path(directory) / f"env_{self.rank}.safetensors"
        if self.group.state_dict():
            if not path.exists():
                raise FileNotFoundError(f"{path}: no normalizer state for env worker {self.rank} (was the checkpoint "
                                        "written with fewer env workers, or without normalization?)")
            self.group.load_state_dict(load_file(str(path)))


def wait_rollout(handles: list, env, limit_s: float, env_id: str, poll_s: float = 2.0) -> list:
    """`wait_all(handles)` while watching the env workers: an env step or reset that has not returned after `limit_s`
    seconds (`env.step_timeout_s`; 0: no limit) raises a WorkerError naming the env worker, and the flow then kills its
    groups, the hung process with them: nothing hangs."""
    if not limit_s:
        return wait_all(handles)
    while True:
        try:
            return wait_all(handles, timeout=min(poll_s, limit_s))
        except TimeoutError:
            pass
        try:
            stuck = env.stuck_seconds().wait(timeout=limit_s)
        except TimeoutError:  # a step that holds the interpreter: the worker cannot even answer
            raise WorkerError(env.component, 0, f"rollout(): the env workers did not answer for {limit_s:g} s (an "
                                                f"env step of env.id={env_id} holds the process)") from None
        for rank, seconds in enumerate(stuck):
            if seconds > limit_s:
                raise WorkerError(env.component, rank, f"rollout(): an env step (or reset) of env.id={env_id} has not "
                                                       f"returned for {seconds:.0f} s (env.step_timeout_s="
                                                       f"{limit_s:g}); the run stops")


def video_recorder(video_dir: str):
    """wrap(i, env_fn) for make_env_group: env 0 records its first episode to video_dir (gymnasium RecordVideo,
    mp4; an animated GIF through Pillow where moviepy is missing). The env must render rgb_array frames."""

    def wrap(i: int, fn):
        if i != 0:
            return fn

        def make():
            env = fn()
            try:
                return gym.wrappers.RecordVideo(env, video_dir, episode_trigger=lambda ep: ep == 0, disable_logger=True)
            except gym.error.DependencyNotInstalled:
                return GifRecorder(env, video_dir)
        return make
    return wrap


class GifRecorder(gym.Wrapper):
    """Records the first episode as video_dir/episode-0.gif (RecordVideo's stand-in where moviepy is missing)."""

    def __init__(self, env: gym.Env, video_dir: str):
        super().__init__(env)
        self.frames, self.done, self.path = [], False, Path(video_dir) / "episode-0.gif"

    def reset(self, **kwargs):
        if self.frames and not self.done:
            self._write()
        out = self.env.reset(**kwargs)
        self._grab()
        return out

    def step(self, action):
        out = self.env.step(action)
        self._grab()
        if (out[2] or out[3]) and not self.done:
            self._write()
        return out

    def _grab(self) -> None:
        if self.done:
            return
        frame = self.env.render()
        if frame is None:
            raise RuntimeError(f"{self.env.spec.id if self.env.spec else self.env}: render() gave no frame; "
                               "a video needs render_mode='rgb_array'")
        self.frames.append(np.asarray(frame)[..., :3].copy())

    def _write(self) -> None:
        from PIL import Image

        self.done = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        images = [Image.fromarray(f) for f in self.frames]
        fps = self.env.metadata.get("render_fps") or 30
        images[0].save(self.path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
        self.frames = []
