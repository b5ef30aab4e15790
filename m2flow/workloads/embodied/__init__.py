"""Embodied workloads: gymnasium env groups, running normalization and actor-critic policies (no runtime imports)."""

from .envs import (EnvGroup, PixelObservation, StepResult, Trajectory, check_env_id, collect_lockstep, make_env_fns,
                   make_vector_env, summarize_episodes)
from .normalize import ObsNormalizer, RewardScaler, RunningMeanStd
from .policies import (ActorCritic, CNNActorCritic, Critics, MLPActorCritic, SquashedGaussianActor, build_policy,
                       categorical_logprob, gaussian_logprob)

__all__ = [
    "EnvGroup", "PixelObservation", "StepResult", "Trajectory", "check_env_id", "collect_lockstep", "make_env_fns",
    "make_vector_env", "summarize_episodes", "ObsNormalizer", "RewardScaler", "RunningMeanStd", "ActorCritic",
    "CNNActorCritic", "Critics", "MLPActorCritic", "SquashedGaussianActor", "build_policy", "categorical_logprob",
    "gaussian_logprob",
]
