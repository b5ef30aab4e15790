"""Running statistics for embodied RL: mean/variance (parallel Welford), an observation normalizer and a
return-based reward scaler, as numpy state with `state_dict()` of float64 tensors. It never steps an env.
"""

from __future__ import annotations

import numpy as np
import torch


class RunningMeanStd:
    """Mean and variance of a stream of batches [B, *shape], merged with Chan et al.'s parallel update.

    Starts at mean 0, var 1, count `epsilon` (as SB3/OpenAI baselines), so an empty normalizer is ~identity.
    """

    def __init__(self, shape: tuple[int, ...] = (), epsilon: float = 1e-4):
        self.shape = tuple(shape)
        self.mean = np.zeros(self.shape, np.float64)
        self.var = np.ones(self.shape, np.float64)
        self.count = float(epsilon)

    def update(self, x: np.ndarray) -> None:
        """x: [B, *shape]. Merges the batch moments into the running ones."""
        x = np.asarray(x, np.float64)
        if x.shape[1:] != self.shape:
            raise ValueError(f"RunningMeanStd.update: expected batches [B, *{self.shape}], got {x.shape}")
        if x.shape[0] == 0:
            return
        b = x.shape[0]
        mean = x.sum(0) / b  # sum / b rather than mean(): fewer numpy layers on these tiny per-step batches
        self.update_from_moments(mean, np.square(x - mean).sum(0) / b, b)

    def update_from_moments(self, batch_mean: np.ndarray, batch_var: np.ndarray, batch_count: int) -> None:
        delta = batch_mean - self.mean
        total = self.count + batch_count
        m2 = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total
        self.mean = self.mean + delta * batch_count / total
        self.var = m2 / total
        self.count = total

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "mean": torch.tensor(self.mean, dtype=torch.float64),
            "var": torch.tensor(self.var, dtype=torch.float64),
            "count": torch.tensor(self.count, dtype=torch.float64),
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("mean", "var", "count"):
            if key not in state:
                raise KeyError(f"RunningMeanStd.load_state_dict: missing field {key!r} (have {sorted(state)})")
        mean = np.asarray(state["mean"], np.float64)
        if mean.shape != self.shape:
            raise ValueError(f"RunningMeanStd.load_state_dict: field 'mean' has shape {mean.shape}, "
                             f"expected {self.shape}")
        self.mean = mean.copy()
        self.var = np.asarray(state["var"], np.float64).copy()
        self.count = float(np.asarray(state["count"]))


class ObsNormalizer:
    """clip((obs - mean) / sqrt(var + eps), -clip, clip) with running statistics; returns float32."""

    def __init__(self, shape: tuple[int, ...], clip: float = 10.0, eps: float = 1e-8):
        self.rms = RunningMeanStd(shape)
        self.clip, self.eps = clip, eps

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """obs: [B, *shape] -> [B, *shape] float32. Does not update the statistics."""
        z = (np.asarray(obs, np.float64) - self.rms.mean) / np.sqrt(self.rms.var + self.eps)
        return np.clip(z, -self.clip, self.clip).astype(np.float32)

    def update(self, obs: np.ndarray) -> None:
        self.rms.update(obs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.rms.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rms.load_state_dict(state)


class RewardScaler:
    """r / sqrt(Var[G] + eps), clipped, where G_t = gamma * G_{t-1} + r_t is each env's running discounted return.

    The caller keeps G per env (reset to 0 at episode end) and feeds it to `update` (SB3 VecNormalize's scheme).
    The mean is not subtracted: scaling only, so the sign of rewards is kept.
    """

    def __init__(self, gamma: float = 0.99, clip: float = 10.0, eps: float = 1e-8):
        self.rms = RunningMeanStd(())
        self.gamma, self.clip, self.eps = gamma, clip, eps

    def __call__(self, rewards: np.ndarray) -> np.ndarray:
        """rewards: [B] -> [B] float32. Does not update the statistics."""
        r = np.asarray(rewards, np.float64) / np.sqrt(self.rms.var + self.eps)
        return np.clip(r, -self.clip, self.clip).astype(np.float32)

    def update(self, returns: np.ndarray) -> None:
        """returns: [B] discounted returns G_t after adding r_t."""
        self.rms.update(np.asarray(returns, np.float64).reshape(-1))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.rms.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rms.load_state_dict(state)
