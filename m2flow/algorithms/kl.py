"""KL estimators against a reference policy (k1, k2, k3) and entropy from logits, with masked losses.
Pure elementwise math on log-probabilities of the sampled tokens; computing those is the engine's job."""

from __future__ import annotations

import torch
from torch import Tensor

from .common import aggregate, as_mask, lookup

_MAX_LOG_RATIO = 20.0
_K3_MAX = 10.0


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi(x) - log pi_ref(x): [*S], [*S] -> [*S]. Unbiased for KL(pi || pi_ref) with x ~ pi,
    high variance, can be negative per sample."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 ("mse") = 0.5 (log pi(x) - log pi_ref(x))^2: [*S], [*S] -> [*S]. Biased, low variance, >= 0."""
    return 0.5 * (logprobs - ref_logprobs).pow(2)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 ("low_var_kl") = (r - 1) - log r with r = pi_ref(x) / pi(x): [*S], [*S] -> [*S].

    Unbiased for KL(pi || pi_ref) with x ~ pi, low variance, and >= 0. log r is clamped to
    [-20, 20] and the result to [0, 10], so one wild token cannot dominate a batch (as in veRL)."""
    log_r = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (torch.expm1(log_r) - log_r).clamp(0.0, _K3_MAX)


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "mse": kl_k2, "k3": kl_k3, "low_var_kl": kl_k3}


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None, estimator: str = "k3",
            agg: str = "token-mean", denom: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """KL penalty to the reference policy: logprobs (with grad), ref_logprobs, mask: [B, T] ->
    (loss, {"kl": detached loss}). estimator: a KL_ESTIMATORS name; agg/denom: common.aggregate.
    Padding positions may hold anything."""
    fn = lookup(KL_ESTIMATORS, "KL estimator", estimator)
    if ref_logprobs.shape != logprobs.shape:
        raise ValueError(f"ref_logprobs shape {tuple(ref_logprobs.shape)} != {tuple(logprobs.shape)}")
    m = as_mask(mask, logprobs)
    zero = torch.zeros_like(logprobs)
    per_token = fn(torch.where(m, logprobs, zero), torch.where(m, ref_logprobs.detach(), zero))
    loss = aggregate(per_token, m, agg, denom)
    return loss, {"kl": loss.detach()}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logits[*S, V] (finite) -> [*S].
    H = -sum_v p_v log p_v with log p = log_softmax(z): stable for large logits, differentiable."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def mean_entropy(logits: Tensor, mask: Tensor | None, agg: str = "token-mean",
                 denom: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked policy entropy: logits[B, T, V], mask[B, T] -> (entropy, {"entropy": detached}).
    A 0-dim tensor with grad; a flow *subtracts* coef * entropy from its loss for an entropy bonus.
    Padding rows of logits may hold anything finite or not: they are replaced before the softmax."""
    if logits.dim() < 1:
        raise ValueError("logits need a vocabulary dim: [B, T, V]")
    m = as_mask(mask, logits[..., 0])
    safe = torch.where(m[..., None], logits, torch.zeros_like(logits))
    ent = aggregate(entropy_from_logits(safe), m, agg, denom)
    return ent, {"entropy": ent.detach()}
