"""Advantage estimators: GAE for [T, N] env rollouts; GRPO, Dr.GRPO, RLOO, REINFORCE++ and embodied GRPO.
Pure tensor functions under no_grad (advantages are targets, never differentiated); no rollout logic."""

from __future__ import annotations

import torch
from torch import Tensor

from .common import as_flag, as_mask, group_index, masked_mean, masked_std


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, terminated: Tensor, truncated: Tensor, next_values: Tensor,
        gamma: float = 0.99, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over a time-major rollout with episode ends inside it.

    Shapes: every input is [T, N] (T steps of N envs; extra trailing dims are allowed if all agree).
    Step t of env n: the agent saw observation o_t (critic value values[t]), acted, got rewards[t]
    and reached o_{t+1}. next_values[t] is V(o_{t+1}), the observation *reached by* step t, taken
    before any auto-reset:
      - truncated[t] (time limit, or any cut that is not a true end): V(final observation of the
        episode); the bootstrap that makes truncation differ from termination;
      - otherwise values[t+1], and at t = T-1 the value of the observation after the rollout;
      - terminated[t] (a true terminal state): ignored, may hold anything (even nan).
    `shift_values(values, last_values, truncated, final_values)` builds exactly this tensor.
    A step that is both terminated and truncated counts as terminated.

        delta_t = rewards[t] + gamma * (1 - terminated[t]) * next_values[t] - values[t]
        A_t     = delta_t + gamma * lam * (1 - done[t]) * A_{t+1},   done = terminated | truncated
    so no advantage flows across an episode boundary, and A_{T} = 0 (the tail is bootstrapped by
    next_values[T-1]). For token-level LM PPO, pass [T, B] transposes with terminated at each
    response's last token; steps after it are padding and get garbage that the loss mask drops.
    Returns (advantages[T, N], returns[T, N]) with returns = advantages + values (critic target).
    """
    if next_values is values:
        raise ValueError("next_values must be the values of the next observations, not `values`; "
                         "build it with shift_values(values, last_values, truncated, final_values)")
    for name, x in (("rewards", rewards), ("next_values", next_values)):
        if x.shape != values.shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} != values shape {tuple(values.shape)}")
    if values.dim() < 1:
        raise ValueError("gae needs [T, N] inputs")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    term = as_flag(terminated, values, "terminated")
    done = term | as_flag(truncated, values, "truncated")
    dtype = values.dtype if values.is_floating_point() else torch.float32
    values = values.to(dtype)
    bootstrap = torch.where(term, torch.zeros_like(values), next_values.to(dtype))
    deltas = rewards.to(dtype) + gamma * bootstrap - values
    carry = gamma * lam * (~done).to(dtype)
    advantages = torch.empty_like(deltas)
    running = torch.zeros_like(deltas[0])
    for t in range(deltas.shape[0] - 1, -1, -1):
        running = deltas[t] + carry[t] * running
        advantages[t] = running
    return advantages, advantages + values


def token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """[B] response scores -> [B, L] token rewards: each score at its response's last token (mask [B, L], 1 on
    response tokens), 0 elsewhere (a row without response tokens gets none)."""
    m = mask.float()
    last = m.shape[1] - 1 - torch.flip(m, dims=[1]).argmax(dim=1)  # the last column where the mask is 1
    out = torch.zeros_like(m)
    out[torch.arange(len(scores)), last] = scores.float() * (m.sum(1) > 0)
    return out


def response_gae(scores: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
                 lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Token-level GAE of LM responses (reasoning PPO): each response is an episode that ends at its last token with
    reward `scores` [B]; `values`, `mask` [B, L] token-aligned (values[b, t]: V of the state that generated the token
    at t). Returns (advantages, returns) [B, L], 0 outside the responses. `gae` on the [L, B] transposes, terminated
    at each response's last token (no bootstrap after it).

    A mask with gaps (a multi-turn response, 0 on the tokens a tool wrote: the loss mask) skips them: the model's
    tokens are the steps, each bootstrapping from the value at the model's next token, as if the tools' tokens were
    not there (they are the environment's answer, not actions)."""
    m = mask.float()
    ends = m.bool() & ~torch.cat([m[:, 1:], m.new_zeros(m.shape[0], 1)], 1).bool()
    if bool(ends.sum(1).gt(1).any()):  # a row whose mask has gaps (several runs): pack each row, then put back
        order = torch.argsort(1 - m, dim=1, stable=True)  # each row's masked columns first, in order
        adv, ret = response_gae(scores, values.gather(1, order), m.gather(1, order), gamma, lam)
        return torch.zeros_like(adv).scatter(1, order, adv), torch.zeros_like(ret).scatter(1, order, ret)
    v = (values * m).T
    adv, ret = gae(token_rewards(scores, m).T, v, ends.T, torch.zeros_like(ends.T),
                   shift_values(v, v.new_zeros(v.shape[1])), gamma=gamma, lam=lam)
    return adv.T * m, ret.T * m


@torch.no_grad()
def shift_values(values: Tensor, last_values: Tensor, truncated: Tensor | None = None,
                 final_values: Tensor | None = None) -> Tensor:
    """Build gae's next_values[T, N] from values[T, N] and last_values[N] (V of the observation
    after the rollout's last step); where truncated[T, N], take final_values[T, N] instead (V of
    the episode's final observation, before auto-reset; read only where truncated).
    With gymnasium's next-step autoreset the observation returned at a done step already is the
    final one, so values[t+1] is its value and final_values is not needed; the step after a done
    (the reset step) is not a real transition: mask it out of the losses."""
    if last_values.shape != values.shape[1:]:
        raise ValueError(f"last_values shape {tuple(last_values.shape)} != {tuple(values.shape[1:])}")
    nxt = torch.cat([values[1:], last_values.unsqueeze(0).to(values.dtype)])
    if (truncated is None) != (final_values is None):
        raise ValueError("pass truncated and final_values together (or neither)")
    if truncated is not None:
        trunc = as_flag(truncated, values, "truncated")
        if final_values.shape != values.shape:
            raise ValueError(f"final_values shape {tuple(final_values.shape)} != {tuple(values.shape)}")
        nxt = torch.where(trunc, final_values.to(values.dtype), nxt)
    return nxt


@torch.no_grad()
def first_episode_mask(done: Tensor) -> Tensor:
    """done[T, N] (bool or 0/1) -> bool[T, N]: True for the steps of each env's first episode,
    up to and including its first done step (all True for an env that never finishes)."""
    d = (done != 0).long()
    return (d.cumsum(0) - d) == 0


@torch.no_grad()
def group_normalize(scores: Tensor, groups: int | Tensor, norm_std: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """GRPO per-sample advantage: scores[B] -> (s - mean_g) / (std_g + eps) [B] (or s - mean_g).

    groups: the group size (contiguous groups) or a group id per sample [B]. std is Bessel-
    corrected (unbiased). A group whose scores are all equal gets 0 (not nan); so does a group
    of one sample, which has no baseline."""
    s = scores.float() if not scores.is_floating_point() else scores
    index, g = group_index(groups, s.shape[0], s.device)
    count = torch.zeros(g, dtype=s.dtype, device=s.device).index_add_(0, index, torch.ones_like(s))
    mean = torch.zeros_like(count).index_add_(0, index, s) / count
    hi = torch.zeros_like(count).scatter_reduce_(0, index, s, "amax", include_self=False)
    lo = torch.zeros_like(count).scatter_reduce_(0, index, s, "amin", include_self=False)
    flat = (hi == lo)[index]                        # exact 0 for all-equal groups, no rounding dust
    centered = torch.where(flat, torch.zeros_like(s), s - mean[index])
    if not norm_std:
        return centered
    var = torch.zeros_like(count).index_add_(0, index, centered.pow(2)) / (count - 1).clamp(min=1)
    return centered / (var.sqrt()[index] + eps)


def _per_token(per_seq: Tensor, mask: Tensor | None) -> Tensor:
    """per_seq[B] broadcast over mask[B, T] -> [B, T], 0 at padding; mask None -> per_seq[B] itself."""
    if mask is None:
        return per_seq
    m = as_mask(mask, mask)
    if m.dim() != 2 or m.shape[0] != per_seq.shape[0]:
        raise ValueError(f"mask must be [B, T] with B={per_seq.shape[0]}, got {tuple(mask.shape)}")
    return torch.where(m, per_seq[:, None], torch.zeros_like(per_seq[:, None]))


@torch.no_grad()
def grpo_advantages(scores: Tensor, mask: Tensor | None, groups: int | Tensor, norm_std: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """GRPO: scores[B] (one per response), mask[B, T] (response tokens) -> advantages[B, T].

    Each response's group-normalized score (see group_normalize) on each of its valid tokens, 0 on
    padding; mask=None returns the per-response advantages [B] (a worker that sees one group at a
    time: fn(scores, None, len(scores))). groups: group size, or a group id per response [B]."""
    return _per_token(group_normalize(scores, groups, norm_std, eps), mask)


@torch.no_grad()
def dr_grpo_advantages(scores: Tensor, mask: Tensor | None, groups: int | Tensor) -> Tensor:
    """Dr.GRPO: scores[B], mask[B, T] (or None -> [B]) -> [B, T]; GRPO without the std division.
    Pair it with agg="seq-mean-token-sum" to also drop the length normalization."""
    return _per_token(group_normalize(scores, groups, norm_std=False), mask)


@torch.no_grad()
def rloo_advantages(scores: Tensor, mask: Tensor | None, groups: int | Tensor) -> Tensor:
    """RLOO: scores[B], mask[B, T] (or None -> [B]) -> [B, T]; s_i minus the mean of the *other*
    samples of its group, i.e. k/(k-1) * (s_i - mean_g) for a group of k. A group of one gets 0."""
    s = scores.float() if not scores.is_floating_point() else scores
    index, g = group_index(groups, s.shape[0], s.device)
    count = torch.zeros(g, dtype=s.dtype, device=s.device).index_add_(0, index, torch.ones_like(s))
    total = torch.zeros_like(count).index_add_(0, index, s)
    k = count[index]
    others = (total[index] - s) / (k - 1).clamp(min=1)
    return _per_token(torch.where(k > 1, s - others, torch.zeros_like(s)), mask)


@torch.no_grad()
def reinforce_pp_advantages(scores: Tensor, mask: Tensor, groups: int | Tensor | None = None,
                            kl: Tensor | None = None, kl_coef: float = 0.0, gamma: float = 1.0,
                            eps: float = 1e-6) -> Tensor:
    """REINFORCE++: scores[B], mask[B, T], optional per-token kl[B, T] -> advantages[B, T].

    Token rewards: -kl_coef * kl[b, t] on every valid token, plus scores[b] on the last valid token
    of response b. Returns G_t = sum_{s >= t} gamma^(s-t) r_s (per position), then normalized over
    all valid tokens of the batch: (G - mean) / (std + eps), 0 on padding. If groups is given, each
    score first has its group mean subtracted (the "REINFORCE++-baseline" variant).
    kl is typically kl_k1(logprobs, ref_logprobs) from the rollout; padding values are ignored."""
    m = as_mask(mask, mask)
    if m.dim() != 2 or m.shape[0] != scores.shape[0]:
        raise ValueError(f"mask must be [B, T] with B={scores.shape[0]}, got {tuple(mask.shape)}")
    s = scores.float() if not scores.is_floating_point() else scores
    if groups is not None:
        s = group_normalize(s, groups, norm_std=False)
    rewards = torch.zeros(m.shape, dtype=s.dtype, device=s.device)
    if kl is not None and kl_coef != 0.0:
        if kl.shape != m.shape:
            raise ValueError(f"kl shape {tuple(kl.shape)} != mask shape {tuple(m.shape)}")
        rewards = torch.where(m, -kl_coef * kl.to(s.dtype), rewards)
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m, positions, -1).amax(-1)                      # -1: no valid token
    has_tokens = last >= 0
    rows = torch.arange(m.shape[0], device=m.device)[has_tokens]
    rewards[rows, last[has_tokens]] += s[has_tokens]
    returns = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(m.shape[1] - 1, -1, -1):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    normalized = (returns - masked_mean(returns, m)) / (masked_std(returns, m) + eps)
    return torch.where(m, normalized, torch.zeros_like(normalized))


@torch.no_grad()
def token_moments(values: Tensor, lengths: Tensor) -> Tensor:
    """Per-sequence values[B], each repeated over its lengths[B] tokens -> [count, sum, sum of squares] of those
    tokens (float64). Moments add up: sum them over data-parallel ranks for the whole batch's."""
    v, w = values.double(), lengths.double()
    return torch.stack([w.sum(), (w * v).sum(), (w * v * v).sum()])


@torch.no_grad()
def whiten(values: Tensor, moments: Tensor, eps: float = 1e-6) -> Tensor:
    """values[B] -> (values - mean) / (std + eps), with the token-weighted mean and Bessel-corrected std of
    `token_moments`: the global whitening of REINFORCE++ for per-sequence returns (gamma 1, no KL in the reward)."""
    n, total, squares = moments.unbind()
    mean = total / n.clamp(min=1)
    var = ((squares - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0)
    std = torch.where(n > 1, var.sqrt(), torch.zeros_like(var))
    return ((values.double() - mean) / (std + eps)).to(values.dtype)


@torch.no_grad()
def embodied_grpo_advantages(success: Tensor, mask: Tensor | None, groups: int | Tensor,
                             norm_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Embodied GRPO: success[N] (0/1 or bool: the episode outcome of env n, e.g. success_once),
    mask[T, N] (the valid steps of that episode, e.g. first_episode_mask(done)) -> advantages[T, N].

    Envs in one group share a reset seed, so their outcomes are comparable; each env's
    group-normalized outcome (group_normalize) is put on every valid step, 0 elsewhere (mask=None:
    the per-env advantages [N]). groups: group size (envs [0, k) form group 0, ...) or a group id
    per env [N]."""
    s = success.float() if not success.is_floating_point() else success
    per_env = group_normalize(s, groups, norm_std, eps)
    if mask is None:
        return per_env
    m = as_mask(mask, mask)
    if m.dim() != 2 or m.shape[1] != s.shape[0]:
        raise ValueError(f"mask must be [T, N] with N={s.shape[0]}, got {tuple(mask.shape)}")
    return torch.where(m, per_env[None, :], torch.zeros_like(per_env[None, :]))
