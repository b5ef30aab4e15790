"""RL math as pure tensor functions: advantages, policy/value/KL losses, entropy, DAPO sampling, SAC, registry.
Imports torch and the standard library only; knows nothing of workers, devices or flows."""

from .advantages import (dr_grpo_advantages, embodied_grpo_advantages, first_episode_mask, gae,
                         group_normalize, grpo_advantages, reinforce_pp_advantages, rloo_advantages,
                         response_gae, shift_values, token_moments, token_rewards, whiten)
from .common import AGG_MODES, aggregate, masked_mean, masked_std
from .kl import KL_ESTIMATORS, entropy_from_logits, kl_k1, kl_k2, kl_k3, kl_loss, mean_entropy
from .losses import (behaviour_weights, gspo_loss, policy_loss, sample_policy_loss, sample_value_loss,
                     value_loss)
from .registry import ADVANTAGES, POLICY_LOSSES, get_advantage_fn, get_kl_estimator, get_policy_loss
from .sac import (actor_loss, critic_loss, polyak_update, soft_td_target, squashed_gaussian_logprob,
                  temperature_loss)
from .sampling import filter_groups, overlong_filter, overlong_penalty

__all__ = [
    "gae", "response_gae", "token_rewards", "shift_values", "first_episode_mask", "group_normalize", "grpo_advantages",
    "dr_grpo_advantages", "rloo_advantages", "reinforce_pp_advantages", "embodied_grpo_advantages",
    "token_moments", "whiten",
    "policy_loss", "gspo_loss", "behaviour_weights", "value_loss", "sample_policy_loss", "sample_value_loss", "kl_k1", "kl_k2", "kl_k3", "kl_loss",
    "entropy_from_logits", "mean_entropy", "aggregate", "masked_mean", "masked_std", "AGG_MODES",
    "filter_groups", "overlong_penalty", "overlong_filter",
    "ADVANTAGES", "POLICY_LOSSES", "KL_ESTIMATORS", "get_advantage_fn", "get_policy_loss",
    "get_kl_estimator",
    "squashed_gaussian_logprob", "soft_td_target", "critic_loss", "actor_loss", "temperature_loss", "polyak_update",
]
