"""Policy and value losses: PPO clipped surrogate (clip-higher, dual-clip, GSPO sequence ratio), critic loss.
Each returns (0-dim loss with grad, metrics); metrics are 0-dim detached tensors (no device sync here)."""

from __future__ import annotations

import torch
from torch import Tensor

from .common import aggregate, as_mask, masked_mean

RATIO_LEVELS = ("token", "sequence")
_MAX_LOG_RATIO = 20.0   # exp(20) ~ 5e8: a guard against overflow, far beyond any sane clip range


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor | None,
                clip_low: float = 0.2, clip_high: float | None = None, dual_clip: float | None = None,
                agg: str = "token-mean", ratio_level: str = "token",
                denom: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate. logprobs, old_logprobs, advantages, mask: [B, T] -> (loss, metrics).

    ratio r = exp(logprobs - old_logprobs); per token
        loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    clip_high=None means clip_high = clip_low; clip_high > clip_low is DAPO's "clip-higher".
    The clips may be 0-d tensors (a compiled caller's annealed clip: one graph for every value), then unchecked.
    dual_clip=c (> 1): for A < 0 the loss is also capped at -A c (so a huge ratio on a bad token
    cannot blow up the step). ratio_level="sequence" is GSPO: every token of response b uses
    s_b = exp(mean over its valid tokens of (logprobs - old_logprobs)) as its ratio value, with the
    gradient flowing through each token's own logprob (GSPO-token form, so per-token advantages
    work too); use small clips (3e-4 / 4e-4) and agg="seq-mean-token-mean" as in the paper.
    agg / denom: see common.aggregate. Masked-out tokens (padding) may hold any value in any input.
    Only logprobs gets a gradient; old_logprobs and advantages are detached.

    metrics: pg_loss; clipfrac_low (A < 0 and r < 1 - clip_low: clipped, no gradient), clipfrac_high
    (A > 0 and r > 1 + clip_high), clipfrac (their sum), dual_clipfrac (A < 0 and r > c); approx_kl
    (mean of (r - 1) - log r, the k3 estimate of KL(old || new)); ratio_mean, ratio_min, ratio_max; ratio_spread
    (the mean over responses of the largest minus the smallest ratio among its tokens: 0 at the sequence level).
    All over valid tokens; with no valid token the fractions are 0 and the ratio stats 1.
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape) or logprobs.dim() != 2:
        raise ValueError("logprobs, old_logprobs and advantages must share one [B, T] shape, got "
                         f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(advantages.shape)}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; valid: {', '.join(RATIO_LEVELS)}")
    clip_high = clip_low if clip_high is None else clip_high
    tensors = isinstance(clip_low, torch.Tensor) or isinstance(clip_high, torch.Tensor)  # the caller checked them
    if not tensors and not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    m = as_mask(mask, logprobs)
    zero = torch.zeros_like(logprobs)
    adv = torch.where(m, advantages.detach().to(logprobs.dtype), zero)
    log_ratio = torch.where(m, logprobs - old_logprobs.detach().to(logprobs.dtype), zero)
    if ratio_level == "sequence":
        seq_log_ratio = masked_mean(log_ratio, m, dim=-1)                               # [B]
        own = torch.where(m, logprobs, zero)
        log_ratio = own - own.detach() + seq_log_ratio.detach()[:, None]
    log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - clip_low, 1.0 + clip_high
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip), per_token)
    loss = aggregate(per_token, m, agg, denom)

    with torch.no_grad():
        r, lr = ratio.detach(), log_ratio.detach()
        n = m.sum().clamp(min=1).to(r.dtype)
        frac = lambda cond: (cond & m).sum().to(r.dtype) / n                             # noqa: E731
        one = torch.ones((), dtype=r.dtype, device=r.device)
        has = m.any()
        metrics = {
            "pg_loss": loss.detach(),
            "clipfrac_low": frac((adv < 0) & (r < low)),
            "clipfrac_high": frac((adv > 0) & (r > high)),
            "dual_clipfrac": frac((adv < 0) & (r > dual_clip)) if dual_clip is not None else 0 * one,
            "approx_kl": masked_mean(torch.expm1(lr) - lr, m),
            "ratio_mean": torch.where(has, masked_mean(r, m), one),
            "ratio_min": torch.where(has, torch.where(m, r, torch.inf).min(), one),
            "ratio_max": torch.where(has, torch.where(m, r, -torch.inf).max(), one),
        }
        rows = m.any(-1)
        spread = torch.where(m, r, -torch.inf).amax(-1) - torch.where(m, r, torch.inf).amin(-1)
        metrics["ratio_spread"] = torch.where(rows, spread, 0 * one).sum() / rows.sum().clamp(min=1).to(r.dtype)
        metrics["clipfrac"] = metrics["clipfrac_low"] + metrics["clipfrac_high"]
    return loss, metrics


def behaviour_weights(prox_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor | None,
                      cap: float = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO's behaviour importance weight per token, truncated: w = min(exp(prox - behaviour), cap).

    Off-policy samples come from a behaviour policy older than the proximal policy the PPO ratio is clipped
    against (the policy at the start of this update). Scaling each token's advantage by w corrects for that
    gap, and the cap bounds the variance a very stale or unlucky token can add (truncated importance sampling).
    Inputs [B, T]; returns (w [B, T], detached, 1 outside the mask; metrics). metrics: behaviour_weight_mean,
    behaviour_weight_max (before the cap), behaviour_capfrac (tokens whose weight was capped), over valid tokens.
    """
    if prox_logprobs.shape != behaviour_logprobs.shape:
        raise ValueError(f"prox and behaviour logprobs must share one shape, got {tuple(prox_logprobs.shape)} "
                         f"and {tuple(behaviour_logprobs.shape)}")
    if cap < 1.0:
        raise ValueError(f"behaviour weight cap must be >= 1, got {cap}")
    with torch.no_grad():
        m = as_mask(mask, prox_logprobs)
        log_w = torch.where(m, prox_logprobs.float() - behaviour_logprobs.float(), torch.zeros_like(prox_logprobs))
        raw = torch.exp(log_w.clamp(max=_MAX_LOG_RATIO))
        w = raw.clamp(max=cap)
        has = m.any()
        one = torch.ones((), dtype=w.dtype, device=w.device)
        metrics = {
            "behaviour_weight_mean": torch.where(has, masked_mean(w, m), one),
            "behaviour_weight_max": torch.where(has, torch.where(m, raw, -torch.inf).max(), one),
            "behaviour_capfrac": (m & (raw > cap)).sum().to(w.dtype) / m.sum().clamp(min=1).to(w.dtype),
        }
    return w, metrics


def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor | None,
              clip_low: float = 3e-4, clip_high: float | None = 4e-4, dual_clip: float | None = None,
              agg: str = "seq-mean-token-mean",
              denom: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: policy_loss with ratio_level="sequence" and the paper's defaults. Inputs [B, T]."""
    return policy_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip,
                       agg, "sequence", denom)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor | None = None,
               clip: float | None = None, huber_delta: float | None = None, agg: str = "token-mean",
               denom: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic loss. values (new, with grad), old_values (at rollout), returns, mask: [B, T] (or any
    one shape with agg="token-mean", e.g. [T, N]; mask None = all valid) -> (loss, metrics).

    Per element f(values - returns) with f(x) = 0.5 x^2, or the Huber loss with huber_delta
    (0.5 x^2 inside |x| <= delta, delta (|x| - 0.5 delta) outside). With clip=c, PPO value clipping:
    max(f(v - R), f(old + clamp(v - old, -c, c) - R)).
    metrics: vf_loss; vf_clipfrac (the clipped term is larger); value_mean; explained_var
    (1 - Var[R - v] / Var[R] over valid elements, 0 when Var[R] = 0).
    """
    if not (values.shape == old_values.shape == returns.shape):
        raise ValueError("values, old_values and returns must share one shape, got "
                         f"{tuple(values.shape)}, {tuple(old_values.shape)}, {tuple(returns.shape)}")
    if clip is not None and clip <= 0:
        raise ValueError(f"value clip must be > 0 (or None), got {clip}")
    if huber_delta is not None and huber_delta <= 0:
        raise ValueError(f"huber_delta must be > 0 (or None), got {huber_delta}")
    m = as_mask(mask, values)
    zero = torch.zeros_like(values)
    target = torch.where(m, returns.detach().to(values.dtype), zero)
    old = torch.where(m, old_values.detach().to(values.dtype), zero)
    v = torch.where(m, values, zero)

    def f(err: Tensor) -> Tensor:
        if huber_delta is None:
            return 0.5 * err.pow(2)
        return torch.nn.functional.huber_loss(err, torch.zeros_like(err), reduction="none",
                                              delta=huber_delta)

    unclipped = f(v - target)
    per_elem = unclipped
    if clip is not None:
        clipped = f(old + (v - old).clamp(-clip, clip) - target)
        per_elem = torch.maximum(unclipped, clipped)
    loss = aggregate(per_elem, m, agg, denom)

    with torch.no_grad():
        vd = v.detach()
        var_r = masked_mean((target - masked_mean(target, m)).pow(2), m)
        resid = target - vd
        var_e = masked_mean((resid - masked_mean(resid, m)).pow(2), m)
        metrics = {
            "vf_loss": loss.detach(),
            "vf_clipfrac": masked_mean((clipped > unclipped).to(vd.dtype), m) if clip is not None
            else torch.zeros((), dtype=vd.dtype, device=vd.device),
            "value_mean": masked_mean(vd, m),
            "explained_var": torch.where(var_r > 0, 1 - var_e / var_r.clamp(min=1e-12), 0 * var_r),
        }
    return loss, metrics


def sample_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                       clip: float | Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """policy_loss for one action per sample and every sample valid (embodied PPO): inputs [B] -> (loss, approx_kl,
    clipfrac), the same values as policy_loss(x[:, None] ..., mask=None, clip_low=clip)'s pg_loss, approx_kl and
    clipfrac, in a third of its ops (no mask, no other statistic): a small policy's minibatch is bound by the
    number of ops, not by FLOPs. `clip` may be a 0-d tensor (an annealed clip under torch.compile)."""
    if not (logprobs.shape == old_logprobs.shape == advantages.shape) or logprobs.dim() != 1:
        raise ValueError("logprobs, old_logprobs and advantages must share one [B] shape, got "
                         f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(advantages.shape)}")
    adv = advantages.detach().to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs.detach().to(logprobs.dtype)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip, 1.0 + clip)).mean()
    with torch.no_grad():
        r, lr = ratio.detach(), log_ratio.detach()
        approx_kl = (torch.expm1(lr) - lr).mean()
        clipfrac = (((adv < 0) & (r < 1.0 - clip)) | ((adv > 0) & (r > 1.0 + clip))).to(r.dtype).mean()
    return loss, approx_kl, clipfrac


def sample_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None = None) -> Tensor:
    """value_loss for every element valid, without its statistics: 0.5 * mean (v - R)^2, or with clip=c PPO value
    clipping, mean max(0.5 (v - R)^2, 0.5 (old + clamp(v - old, -c, c) - R)^2). The same value as value_loss(...)[0]."""
    if not (values.shape == old_values.shape == returns.shape):
        raise ValueError("values, old_values and returns must share one shape, got "
                         f"{tuple(values.shape)}, {tuple(old_values.shape)}, {tuple(returns.shape)}")
    if clip is not None and clip <= 0:
        raise ValueError(f"value clip must be > 0 (or None), got {clip}")
    target = returns.detach().to(values.dtype)
    per_elem = 0.5 * (values - target).pow(2)
    if clip is not None:
        old = old_values.detach().to(values.dtype)
        per_elem = torch.maximum(per_elem, 0.5 * (old + (values - old).clamp(-clip, clip) - target).pow(2))
    return per_elem.mean()
