"""Gymnasium envs that misbehave on purpose, for the fault tests (`env.id=faulty_envs:Hang-v0`)."""

import time

import gymnasium as gym
import numpy as np


class Hang(gym.Env):
    """CartPole-shaped; its `step` never returns once `after` steps have been taken (a simulator that deadlocks)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, after: int = 5, render_mode=None):
        self.after, self.steps, self.render_mode = after, 0, render_mode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.steps += 1
        while self.steps > self.after:
            time.sleep(1.0)
        return np.zeros(4, np.float32), 1.0, False, False, {}


gym.register("Hang-v0", entry_point=Hang, max_episode_steps=100)


class Broken(Hang):
    """CartPole-shaped; after `after` steps its `step` raises (`mode="raise"`, a simulator that crashes) or returns
    a NaN observation (`mode="nan"`, a simulator that blew up)."""

    def __init__(self, after: int = 5, mode: str = "raise", render_mode=None):
        super().__init__(after, render_mode)
        self.mode = mode

    def step(self, action):
        self.steps += 1
        obs = np.full(4, 0.1, np.float32)
        if self.steps > self.after:
            if self.mode == "raise":
                raise RuntimeError(f"simulator crashed at step {self.steps}")
            obs[2] = np.nan
        return obs, 1.0, False, False, {}


gym.register("Raises-v0", entry_point=Broken, max_episode_steps=100, kwargs={"mode": "raise"})
gym.register("NaNObs-v0", entry_point=Broken, max_episode_steps=100, kwargs={"mode": "nan"})
