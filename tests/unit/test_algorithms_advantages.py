"""Advantage estimators vs naive Python loops on random inputs, plus hand-worked cases."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m2flow.algorithms import (dr_grpo_advantages, embodied_grpo_advantages, first_episode_mask, gae,
                               group_normalize, grpo_advantages, reinforce_pp_advantages,
                               rloo_advantages, shift_values)

FAST = settings(max_examples=25, deadline=None)


# ---------------------------------------------------------------- naive references (plain Python)

def naive_gae(r, v, term, trunc, nv, gamma, lam):
    """Episode by episode: A_t = sum_k (gamma lam)^k delta_{t+k} within the episode segment."""
    T, N = len(r), len(r[0])
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        start = 0
        for t in range(T):
            if term[t][n] or trunc[t][n] or t == T - 1:       # the segment start..t ends here
                seg = range(start, t + 1)
                delta = {}
                for s in seg:
                    boot = 0.0 if term[s][n] else nv[s][n]
                    delta[s] = r[s][n] + gamma * boot - v[s][n]
                for s in seg:
                    adv[s][n] = sum((gamma * lam) ** (k - s) * delta[k] for k in range(s, t + 1))
                start = t + 1
    ret = [[adv[t][n] + v[t][n] for n in range(N)] for t in range(T)]
    return adv, ret


def naive_groups(ids):
    groups = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    return groups


def naive_grpo(scores, ids, norm_std=True, eps=1e-6):
    out = [0.0] * len(scores)
    for members in naive_groups(ids).values():
        xs = [scores[i] for i in members]
        k = len(xs)
        mean = sum(xs) / k
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (k - 1)) if k > 1 else 0.0
        for i in members:
            if k == 1 or max(xs) == min(xs):
                out[i] = 0.0
            else:
                out[i] = (scores[i] - mean) / (std + eps) if norm_std else scores[i] - mean
    return out


def naive_rloo(scores, ids):
    out = [0.0] * len(scores)
    for members in naive_groups(ids).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            out[i] = scores[i] - sum(others) / len(others) if others else 0.0
    return out


def naive_reinforce_pp(scores, mask, ids, kl, kl_coef, gamma, eps=1e-6):
    B, T = len(mask), len(mask[0])
    if ids is not None:
        means = {g: sum(scores[i] for i in m) / len(m) for g, m in naive_groups(ids).items()}
        scores = [scores[i] - means[ids[i]] for i in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        valid = [t for t in range(T) if mask[b][t]]
        rew = [(-kl_coef * kl[b][t] if mask[b][t] else 0.0) for t in range(T)]
        if valid:
            rew[valid[-1]] += scores[b]
        for t in range(T):
            ret[b][t] = sum(gamma ** (s - t) * rew[s] for s in range(t, T))
    vals = [ret[b][t] for b in range(B) for t in range(T) if mask[b][t]]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((x - mean) ** 2 for x in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return [[(ret[b][t] - mean) / (std + eps) if mask[b][t] else 0.0 for t in range(T)] for b in range(B)]


def random_mask(rng, B, T):
    """Right-padded response masks, with the occasional empty row."""
    return [[1 if t < rng.choice([0, rng.randint(1, T)]) or (t == 0 and b % 3) else 0 for t in range(T)]
            for b in range(B)]


def close(a, b, tol=1e-9):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol, rtol=tol), (a, b)


# ---------------------------------------------------------------- GAE

def test_gae_matches_naive_on_random_rollouts():
    rng = random.Random(0)
    for trial in range(30):
        T, N = rng.randint(1, 12), rng.randint(1, 5)
        g = torch.Generator().manual_seed(trial)
        r, v, nv = (torch.randn(T, N, generator=g, dtype=torch.float64) for _ in range(3))
        term = torch.rand(T, N, generator=g) < 0.2
        trunc = torch.rand(T, N, generator=g) < 0.2                   # may overlap with term
        gamma, lam = rng.choice([0.0, 0.5, 0.99, 1.0]), rng.choice([0.0, 0.9, 0.95, 1.0])
        adv, ret = gae(r, v, term, trunc, nv, gamma, lam)
        nadv, nret = naive_gae(r.tolist(), v.tolist(), term.tolist(), trunc.tolist(), nv.tolist(), gamma, lam)
        close(adv, nadv)
        close(ret, nret)


def test_gae_hand_worked_terminated_vs_truncated():
    # env 0 terminates at t=1; env 1 is truncated at t=1 with V(final obs) = 10. gamma .9, lam .8.
    r = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    v = torch.tensor([[0.5, 0.5], [1.0, 1.0], [2.0, 2.0]])
    nv = torch.tensor([[1.0, 1.0], [float("nan"), 10.0], [4.0, 4.0]])  # nan: ignored at terminated
    term = torch.tensor([[False, False], [True, False], [False, False]])
    trunc = torch.tensor([[False, False], [False, True], [False, False]])
    adv, ret = gae(r, v, term, trunc, nv, gamma=0.9, lam=0.8)
    # t2: 3 + .9*4 - 2 = 4.6 (both). t1: env0 2 - 1 = 1; env1 2 + .9*10 - 1 = 10 (no carry of 4.6).
    # t0: 1 + .9*1 - .5 = 1.4, plus .72 * A1 -> 2.12 and 8.6.
    close(adv, [[2.12, 8.6], [1.0, 10.0], [4.6, 4.6]], 1e-5)
    close(ret, [[2.62, 9.1], [2.0, 11.0], [6.6, 6.6]], 1e-5)


def test_gae_terminated_wins_when_both_flags_set():
    r, v = torch.ones(1, 1), torch.zeros(1, 1)
    adv, _ = gae(r, v, torch.ones(1, 1, dtype=torch.bool), torch.ones(1, 1, dtype=torch.bool),
                 torch.full((1, 1), 5.0), 0.9, 0.9)
    close(adv, [[1.0]])


def test_gae_rejects_unshifted_values_and_bad_shapes():
    v = torch.zeros(3, 2)
    f = torch.zeros(3, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="shift_values"):
        gae(torch.zeros(3, 2), v, f, f, v)
    with pytest.raises(ValueError, match="shape"):
        gae(torch.zeros(3, 2), v, f, f, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="gamma"):
        gae(torch.zeros(3, 2), v, f, f, torch.zeros(3, 2), gamma=1.5)


def test_shift_values_with_truncation():
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    last = torch.tensor([5.0, 6.0])
    trunc = torch.tensor([[True, False], [False, False]])
    final = torch.tensor([[9.0, -1.0], [-1.0, -1.0]])
    close(shift_values(v, last), [[3.0, 4.0], [5.0, 6.0]])
    close(shift_values(v, last, trunc, final), [[9.0, 4.0], [5.0, 6.0]])
    with pytest.raises(ValueError):
        shift_values(v, last, trunc)


def test_first_episode_mask():
    done = torch.tensor([[0, 0, 1], [1, 0, 0], [0, 0, 1], [1, 0, 0]])
    expect = [[True, True, True], [True, True, False], [False, True, False], [False, True, False]]
    assert first_episode_mask(done).tolist() == expect


# ---------------------------------------------------------------- GRPO / Dr.GRPO / RLOO

@FAST
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 1.0, 0.5, -2.0, 3.25])),
                min_size=1, max_size=24), st.booleans())
def test_group_normalize_matches_naive_with_arbitrary_ids(pairs, norm_std):
    ids = [p[0] * 7 - 3 for p in pairs]                                 # arbitrary, unsorted ids
    scores = [p[1] for p in pairs]
    got = group_normalize(torch.tensor(scores, dtype=torch.float64), torch.tensor(ids), norm_std)
    close(got, naive_grpo(scores, ids, norm_std), 1e-6)


def test_grpo_matches_naive_and_broadcasts_over_mask():
    rng = random.Random(1)
    for _ in range(20):
        k, G, T = rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 6)
        B = k * G
        scores = [rng.gauss(0, 1) for _ in range(B)]
        mask = random_mask(rng, B, T)
        ids = [i // k for i in range(B)]
        for fn, ref in ((grpo_advantages, naive_grpo(scores, ids)),
                        (dr_grpo_advantages, naive_grpo(scores, ids, norm_std=False)),
                        (rloo_advantages, naive_rloo(scores, ids))):
            got = fn(torch.tensor(scores, dtype=torch.float64), torch.tensor(mask), k)
            close(got, [[ref[b] if mask[b][t] else 0.0 for t in range(T)] for b in range(B)], 1e-7)


def test_grpo_zero_variance_group_gives_exact_zero():
    scores = torch.tensor([0.1, 0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 0.0])  # group 0 all equal (0.1: inexact)
    adv = grpo_advantages(scores, torch.ones(8, 2), 4)
    assert adv[:4].abs().max().item() == 0.0
    assert torch.isfinite(adv).all()
    # group 1: mean .5, unbiased std sqrt(1/3): +-0.5 / 0.57735 = +-0.8660
    close(adv[4:, 0], [0.8660254, -0.8660254, 0.8660254, -0.8660254], 1e-5)


def test_without_mask_the_reasoning_estimators_return_one_advantage_per_response():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        per_seq = fn(scores, None, 3)
        assert per_seq.shape == (6,)
        close(fn(scores, torch.ones(6, 4), 3), per_seq[:, None].expand(6, 4))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(embodied_grpo_advantages(torch.tensor([1, 0]), None, 2), [a, -a], 1e-6)


def test_grpo_rejects_bad_groups():
    with pytest.raises(ValueError, match="divide"):
        grpo_advantages(torch.zeros(5), torch.ones(5, 2), 2)
    with pytest.raises(ValueError, match="group id"):
        grpo_advantages(torch.zeros(4), torch.ones(4, 2), torch.zeros(4))  # float ids


def test_rloo_hand_worked():
    # group [1, 0, 0]: 1 - 0 = 1; 0 - .5 = -.5 (twice). group of one: 0.
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 7.0]), torch.ones(4, 1), torch.tensor([0, 0, 0, 1]))
    close(adv[:, 0], [1.0, -0.5, -0.5, 0.0])


# ---------------------------------------------------------------- REINFORCE++

def test_reinforce_pp_matches_naive():
    rng = random.Random(2)
    for trial in range(20):
        k, G, T = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 7)
        B = k * G
        scores = [rng.gauss(0, 1) for _ in range(B)]
        mask = random_mask(rng, B, T)
        mask[0][0] = 1                                                   # at least one valid token
        kl = [[rng.gauss(0, 1) if mask[b][t] else float("nan") for t in range(T)] for b in range(B)]
        kl_coef, gamma = rng.choice([0.0, 0.1]), rng.choice([1.0, 0.9])
        ids = [i // k for i in range(B)] if trial % 2 else None
        got = reinforce_pp_advantages(torch.tensor(scores, dtype=torch.float64), torch.tensor(mask),
                                      k if ids else None, torch.tensor(kl, dtype=torch.float64),
                                      kl_coef, gamma)
        close(got, naive_reinforce_pp(scores, mask, ids, kl, kl_coef, gamma), 1e-7)


def test_reinforce_pp_is_whitened_over_valid_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask)
    valid = adv[mask.bool()]
    close(valid.mean(), 0.0, 1e-6)
    close(valid.std(), 1.0, 1e-4)
    assert adv[~mask.bool()].abs().sum() == 0


# ---------------------------------------------------------------- embodied GRPO

def test_embodied_grpo_matches_naive():
    rng = random.Random(3)
    for _ in range(20):
        k, G, T = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 6)
        N = k * G
        success = [rng.random() < 0.5 for _ in range(N)]
        done = torch.rand(T, N, generator=torch.Generator().manual_seed(N * T)) < 0.3
        mask = first_episode_mask(done)
        got = embodied_grpo_advantages(torch.tensor(success), mask, k)
        per_env = naive_grpo([float(s) for s in success], [n // k for n in range(N)])
        close(got, [[per_env[n] if mask[t, n] else 0.0 for n in range(N)] for t in range(T)], 1e-5)


def test_embodied_grpo_hand_worked_seed_groups():
    # envs 0,1 share a seed (1 success, 1 failure); envs 2,3 both succeed -> zero signal.
    mask = torch.tensor([[True, True, True, True], [True, False, True, True]])
    adv = embodied_grpo_advantages(torch.tensor([1, 0, 1, 1]), mask, torch.tensor([5, 5, 9, 9]))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(adv, [[a, -a, 0.0, 0.0], [a, 0.0, 0.0, 0.0]], 1e-6)


def test_whiten_by_token_moments_equals_reinforce_pp_with_a_group_baseline():
    """REINFORCE++-baseline with gamma 1 and no KL in the reward gives every token of a response one value: its
    group-centred score, whitened over the batch's tokens. The streaming flow gets it from per-response values and
    moments that add up over shares and ranks."""
    from m2flow.algorithms import dr_grpo_advantages, reinforce_pp_advantages, token_moments, whiten

    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(12, generator=gen)
    lengths = torch.randint(1, 7, (12,), generator=gen)
    mask = torch.arange(6)[None, :] < lengths[:, None]
    ref = reinforce_pp_advantages(scores, mask, groups=4)
    centred = dr_grpo_advantages(scores, None, 4)
    moments = token_moments(centred[:5], lengths[:5]) + token_moments(centred[5:], lengths[5:])  # two shares
    got = whiten(centred, moments)
    torch.testing.assert_close(got[:, None].expand_as(ref)[mask], ref[mask], rtol=1e-5, atol=1e-6)


def test_response_gae_runs_backwards_over_each_response_from_its_last_token():
    """Two responses at different columns (prompts of 2 and 1 tokens), right-padded: the reward sits on each one's
    last token, and A_t = delta_t + gamma lam A_{t+1} inside the response, nothing outside it."""
    from m2flow.algorithms import response_gae, token_rewards

    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.float32)
    values = torch.tensor([[9, 9, 0.5, 0.2, 0.1, 9], [9, 0.3, 0.4, 9, 9, 9]])  # 9: outside, never read
    scores = torch.tensor([1.0, -1.0])
    assert token_rewards(scores, mask).tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, -1, 0, 0, 0]]
    g, lam = 0.9, 0.8
    adv, ret = response_gae(scores, values, mask, gamma=g, lam=lam)
    d4 = 1 - 0.1
    d3 = g * 0.1 - 0.2
    d2 = g * 0.2 - 0.5
    want0 = [0, 0, d2 + g * lam * (d3 + g * lam * d4), d3 + g * lam * d4, d4, 0]
    e2 = -1 - 0.4
    e1 = g * 0.4 - 0.3
    want1 = [0, e1 + g * lam * e2, e2, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor([want0, want1]))
    torch.testing.assert_close(ret, (adv + values) * mask)
    # gamma = lam = 1 (the reasoning default): every token's return is the response's score
    _, ret1 = response_gae(scores, values, mask)
    torch.testing.assert_close(ret1, token_rewards(scores, mask).sum(1, keepdim=True) * mask)


def test_response_gae_skips_the_tokens_a_tool_wrote():
    """A multi-turn response masked 0 where a tool's answer was inserted: GAE runs over the model's tokens only, each
    bootstrapping from the model's next token, exactly as over the same response with the tool's tokens cut out;
    nothing lands on the tool's tokens."""
    from m2flow.algorithms import response_gae

    gapped = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.float32)
    values = torch.tensor([[9, 0.1, 0.2, 7, 7, 0.3, 0.4, 9], [9, 9, 0.5, 0.6, 0.7, 0.8, 9, 9]])
    scores = torch.tensor([1.0, 0.5])
    adv, ret = response_gae(scores, values, gapped, gamma=0.9, lam=0.8)
    cut = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]])
    want_adv, want_ret = response_gae(scores, cut, torch.ones(2, 4), gamma=0.9, lam=0.8)
    keep = gapped.bool()
    torch.testing.assert_close(adv[keep], want_adv.flatten())
    torch.testing.assert_close(ret[keep], want_ret.flatten())
    assert adv[~keep].abs().sum() == 0 and ret[~keep].abs().sum() == 0
