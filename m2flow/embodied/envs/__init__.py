"""The embodied recipe's environments: gymnasium env groups stepped as one, the trajectories they yield, running
normalization, and the ManiSkill3 and Meta-World adapters with their scripted experts (no runtime imports)."""

from .group import (EnvGroup, PixelObservation, StepResult, Trajectory, check_env_id, collect_lockstep, make_env_fns,
                    make_vector_env, summarize_episodes)
from .normalize import ObsNormalizer, RewardScaler, RunningMeanStd

__all__ = [
    "EnvGroup", "PixelObservation", "StepResult", "Trajectory", "check_env_id", "collect_lockstep", "make_env_fns",
    "make_vector_env", "summarize_episodes", "ObsNormalizer", "RewardScaler", "RunningMeanStd",
]
