"""Names -> functions, so a flow picks its advantage estimator, policy loss and KL estimator from config.
Only lookup tables; an unknown name raises ValueError listing the valid ones."""

from __future__ import annotations

from typing import Callable

from .advantages import (dr_grpo_advantages, embodied_grpo_advantages, gae, grpo_advantages,
                         reinforce_pp_advantages, rloo_advantages)
from .common import lookup
from .kl import KL_ESTIMATORS
from .losses import gspo_loss, policy_loss

# Two families: "gae" takes a [T, N] rollout (rewards, values, terminated, truncated, next_values);
# the others take (scores[B or N], mask, groups) and return per-token advantages shaped like mask.
ADVANTAGES: dict[str, Callable] = {
    "gae": gae,
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "embodied_grpo": embodied_grpo_advantages,
}

# Both: (logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip, agg, ...) [B, T].
POLICY_LOSSES: dict[str, Callable] = {"ppo": policy_loss, "gspo": gspo_loss}


def get_advantage_fn(name: str) -> Callable:
    """ADVANTAGES[name], or ValueError("unknown advantage estimator 'x'; valid: ...")."""
    return lookup(ADVANTAGES, "advantage estimator", name)


def get_policy_loss(name: str) -> Callable:
    """POLICY_LOSSES[name], or ValueError("unknown policy loss 'x'; valid: gspo, ppo")."""
    return lookup(POLICY_LOSSES, "policy loss", name)


def get_kl_estimator(name: str) -> Callable:
    """KL_ESTIMATORS[name] ((logprobs, ref_logprobs) -> per-token KL), or ValueError listing names."""
    return lookup(KL_ESTIMATORS, "KL estimator", name)
