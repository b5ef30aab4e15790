"""The replay buffer of off-policy RL: a fixed-capacity ring of transitions (obs, action, reward, next obs,
terminated) held as preallocated tensors, sampled uniformly with its own seeded generator. Its state (the rows
filled, the write position, the generator) goes into checkpoints, so a resumed run samples what an uninterrupted
one does.

Episode boundaries are handled as Stable-Baselines3 handles them: a transition that ends an episode keeps that
episode's last obs as its next obs (not the next episode's first, which the env auto-reset to), and only a real
termination stops the bootstrap; a time-limit truncation bootstraps from its last obs.
"""

from __future__ import annotations

import math
import os

import torch

from m2flow.embodied.envs import Trajectory

FIELDS = ("obs", "actions", "rewards", "next_obs", "terminated")
FITS = 0.8  # the largest share of the available memory a buffer may take


def transitions(traj: Trajectory) -> dict[str, torch.Tensor]:
    """A rollout's [T, N] steps as flat transitions [T * N, ...] (time-major): next obs is obs[t + 1] (next_obs
    after the last step), or the episode's last obs (traj.final_obs) where the step ended an episode."""
    if traj.final_obs is None:
        raise ValueError("transitions: the trajectory carries no final_obs (the env worker records it for off-policy "
                         "algorithms only)")
    nxt = torch.cat([traj.obs[1:], traj.next_obs.unsqueeze(0)])
    done = traj.terminated | traj.truncated
    nxt = torch.where(done.view(*done.shape, *[1] * (nxt.ndim - 2)), traj.final_obs.to(nxt.dtype), nxt)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    return {"obs": flat(traj.obs), "actions": flat(traj.actions).float(), "rewards": flat(traj.rewards).float(),
            "next_obs": flat(nxt), "terminated": flat(traj.terminated).bool()}


def available_bytes() -> int:
    """Memory the OS can still hand out (MemAvailable), or the free pages where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ReplayBuffer:
    """`capacity` transitions of obs `obs_shape` (`obs_dtype`) and float actions `act_shape`; the oldest are
    overwritten once it is full."""

    def __init__(self, capacity: int, obs_shape: tuple[int, ...], act_shape: tuple[int, ...],
                 obs_dtype: torch.dtype = torch.float32, seed: int = 0, max_fraction: float = FITS):
        if capacity < 1:
            raise ValueError(f"replay buffer: capacity must be >= 1, got {capacity}")
        need = self.bytes_needed(capacity, obs_shape, act_shape, obs_dtype)
        free = available_bytes()
        if need > max_fraction * free:
            raise MemoryError(f"replay buffer of {capacity:,} transitions needs {need / 2**30:.2f} GiB, more than "
                              f"{max_fraction:.0%} of the {free / 2**30:.2f} GiB available: lower sac.buffer_size")
        self.capacity, self.pos, self.full = capacity, 0, False
        self.data = {"obs": torch.empty(capacity, *obs_shape, dtype=obs_dtype),
                     "actions": torch.empty(capacity, *act_shape), "rewards": torch.empty(capacity),
                     "next_obs": torch.empty(capacity, *obs_shape, dtype=obs_dtype),
                     "terminated": torch.empty(capacity, dtype=torch.bool)}
        self.gen = torch.Generator().manual_seed(seed)

    @staticmethod
    def bytes_needed(capacity: int, obs_shape, act_shape, obs_dtype: torch.dtype = torch.float32) -> int:
        obs = math.prod(obs_shape) * torch.empty((), dtype=obs_dtype).element_size()
        return capacity * (2 * obs + 4 * math.prod(act_shape) + 4 + 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data.values())

    def __len__(self) -> int:
        return self.capacity if self.full else self.pos

    def add(self, batch: dict[str, torch.Tensor]) -> None:
        """Append n transitions (`transitions(traj)`'s dict, each [n, ...]) in order, wrapping around."""
        n = len(batch["rewards"])
        if n > self.capacity:  # only the newest capacity survive
            batch = {k: v[-self.capacity:] for k, v in batch.items()}
            n = self.capacity
        idx = (self.pos + torch.arange(n)) % self.capacity
        for k in FIELDS:
            self.data[k][idx] = batch[k].to(self.data[k].dtype)
        self.full = self.full or self.pos + n >= self.capacity
        self.pos = (self.pos + n) % self.capacity

    def sample(self, batch_size: int) -> dict[str, torch.Tensor]:
        """`batch_size` transitions drawn uniformly (with replacement) from those held."""
        if not len(self):
            raise ValueError("replay buffer: sample() from an empty buffer")
        idx = torch.randint(0, len(self), (batch_size,), generator=self.gen)
        return {k: v[idx] for k, v in self.data.items()}

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The rows held (in slot order), the write position and the generator's state, as tensors (safetensors)."""
        n = len(self)
        state = {f"data.{k}": v[:n].contiguous() for k, v in self.data.items()}
        state.update(pos=torch.tensor(self.pos), full=torch.tensor(self.full), capacity=torch.tensor(self.capacity),
                     gen=self.gen.get_state())
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if int(state["capacity"]) != self.capacity:
            raise ValueError(f"replay buffer: the checkpoint's holds {int(state['capacity']):,} transitions, this "
                             f"run's sac.buffer_size is {self.capacity:,}")
        for k in FIELDS:
            rows = state[f"data.{k}"]
            if rows.shape[1:] != self.data[k].shape[1:]:
                raise ValueError(f"replay buffer: the checkpoint's {k} rows are {tuple(rows.shape[1:])}, this run's "
                                 f"{tuple(self.data[k].shape[1:])}")
            self.data[k][:len(rows)] = rows
        self.pos, self.full = int(state["pos"]), bool(state["full"])
        self.gen.set_state(state["gen"])
