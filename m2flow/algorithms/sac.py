"""Soft actor-critic (Haarnoja et al. 2018, as Stable-Baselines3's SAC computes it): the squashed Gaussian's
log-probability, the critics' soft Bellman loss (twin critics, or an ensemble as REDQ and RLPD), the actor's and the
entropy temperature's losses, Polyak averaging. Pure tensor functions."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
_LOG_2 = math.log(2.0)


def squashed_gaussian_logprob(u: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor,
                              eps: float = 0.0) -> torch.Tensor:
    """log pi(tanh(u)) for u ~ N(mean, exp(log_std)^2), per row [B, A] -> [B]: the Gaussian's log-density minus the
    log-determinant of tanh. eps 0: log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)), exact, and finite where
    tanh(u) rounds to +-1. eps > 0: log(1 - tanh(u)^2 + eps), as SB3 computes it (its eps is 1e-6), which caps the
    term at log(eps) where the action saturates."""
    z = (u - mean) * torch.exp(-log_std)
    gaussian = (-0.5 * z.pow(2) - log_std - _HALF_LOG_2PI).sum(-1)
    if eps:
        return gaussian - torch.log(1 - torch.tanh(u).pow(2) + eps).sum(-1)
    return gaussian - (2.0 * (_LOG_2 - u - F.softplus(-2.0 * u))).sum(-1)


def soft_td_target(rewards: torch.Tensor, terminated: torch.Tensor, next_q: torch.Tensor, next_logp: torch.Tensor,
                   alpha: torch.Tensor | float, gamma: float) -> torch.Tensor:
    """y = r + gamma (1 - terminated) (min_i Q_i'(s', a') - alpha log pi(a' | s')), a' ~ pi(s'), next_q [N, B] the
    target critics' Q (all N of them, as SB3; or a random subset, as REDQ and RLPD): the soft Bellman target [B]. A
    truncated step (time limit) is not terminated: it bootstraps from its final obs. No gradient flows through it."""
    with torch.no_grad():
        soft = next_q.min(0).values - alpha * next_logp
        return rewards + gamma * (1.0 - terminated.float()) * soft


def critic_loss(q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Every critic's regression on the soft target, q [N, B]: 0.5 sum_i MSE(Q_i, y), as SB3."""
    return 0.5 * (q - target).pow(2).mean(1).sum()


def actor_loss(logp: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor | float, reduce: str = "min") -> torch.Tensor:
    """mean(alpha log pi(a | s) - Q(s, a)) for a ~ pi(s) reparameterized, Q the critics' min (SB3) or mean (REDQ,
    RLPD) over q [N, B]: the critics score the actor's own actions (their parameters get gradients here that the
    caller does not step)."""
    score = q.min(0).values if reduce == "min" else q.mean(0)
    return (alpha * logp - score).mean()


def temperature_loss(log_alpha: torch.Tensor, logp: torch.Tensor, target_entropy: float) -> torch.Tensor:
    """-mean(log_alpha (log pi + target_entropy)): alpha rises while the policy's entropy is below the target and
    falls above it (SB3 optimizes log alpha, as here)."""
    return -(log_alpha * (logp.detach() + target_entropy)).mean()


@torch.no_grad()
def polyak_update(target: list[torch.Tensor], source: list[torch.Tensor], tau: float) -> None:
    """target <- (1 - tau) target + tau source, in place, tensor by tensor."""
    torch._foreach_mul_(target, 1.0 - tau)
    torch._foreach_add_(target, source, alpha=tau)
