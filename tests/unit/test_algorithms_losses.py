"""Policy/value losses and aggregation vs naive Python loops, plus hand-worked clip branches and masks."""

import math
import random

import pytest
import torch

from m2flow.algorithms import (AGG_MODES, aggregate, gspo_loss, policy_loss, sample_policy_loss, sample_value_loss,
                               value_loss)


# ---------------------------------------------------------------- naive references

def naive_agg(vals, mask, mode):
    B, T = len(mask), len(mask[0])
    if mode == "token-mean":
        n = sum(mask[b][t] for b in range(B) for t in range(T))
        return sum(vals[b][t] for b in range(B) for t in range(T) if mask[b][t]) / max(n, 1)
    rows = []
    for b in range(B):
        valid = [vals[b][t] for t in range(T) if mask[b][t]]
        if valid:
            rows.append(sum(valid) if mode == "seq-mean-token-sum" else sum(valid) / len(valid))
    return sum(rows) / max(len(rows), 1)


def naive_policy(lp, old, adv, mask, cl, ch, c, level):
    """Per-token loss values and ratios from the textbook formulas, on Python floats."""
    B, T = len(mask), len(mask[0])
    loss = [[0.0] * T for _ in range(B)]
    ratio = [[1.0] * T for _ in range(B)]
    for b in range(B):
        valid = [t for t in range(T) if mask[b][t]]
        seq = math.exp(sum(lp[b][t] - old[b][t] for t in valid) / len(valid)) if valid else 1.0
        for t in valid:
            r = seq if level == "sequence" else math.exp(lp[b][t] - old[b][t])
            a = adv[b][t]
            clipped = min(max(r, 1 - cl), 1 + ch)
            l = max(-a * r, -a * clipped)
            if c is not None and a < 0:
                l = min(l, -a * c)
            loss[b][t], ratio[b][t] = l, r
    return loss, ratio


def rand_case(rng, B, T, scale=0.3):
    lp = [[rng.gauss(-1, 1) for _ in range(T)] for _ in range(B)]
    old = [[x + rng.gauss(0, scale) for x in row] for row in lp]
    adv = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]
    mask = [[1 if t < rng.randint(0, T) or t == 0 else 0 for t in range(T)] for _ in range(B)]
    if B > 2:
        mask[-1] = [0] * T                                        # a pure padding row
    return lp, old, adv, mask


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def close(a, b, tol=1e-9):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol, rtol=tol), (a, b)


# ---------------------------------------------------------------- aggregation

def test_aggregate_matches_naive():
    rng = random.Random(0)
    for _ in range(30):
        B, T = rng.randint(1, 5), rng.randint(1, 6)
        vals = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]
        mask = [[rng.random() < 0.6 for _ in range(T)] for _ in range(B)]
        for mode in AGG_MODES:
            close(aggregate(t64(vals), torch.tensor(mask), mode), naive_agg(vals, mask, mode))


def test_aggregate_denominator_makes_micro_batches_sum_to_the_batch_loss():
    g = torch.Generator().manual_seed(0)
    vals, mask = torch.randn(6, 5, generator=g), torch.rand(6, 5, generator=g) < 0.7
    for mode in AGG_MODES:
        whole = aggregate(vals, mask, mode)
        denom = mask.sum().item() if mode == "token-mean" else mask.any(-1).sum().item()
        parts = sum(aggregate(vals[i:i + 2], mask[i:i + 2], mode, denom) for i in range(0, 6, 2))
        close(parts, whole, 1e-6)


def test_aggregate_all_masked_is_zero_not_nan():
    vals = torch.full((2, 3), float("nan"), requires_grad=True)
    for mode in AGG_MODES:
        out = aggregate(vals, torch.zeros(2, 3), mode)
        out.backward()
        assert out.item() == 0.0 and torch.isfinite(vals.grad).all()
    with pytest.raises(ValueError, match="valid: token-mean"):
        aggregate(vals, None, "token-sum")


# ---------------------------------------------------------------- policy loss vs naive

@pytest.mark.parametrize("level", ["token", "sequence"])
def test_policy_loss_matches_naive(level):
    rng = random.Random(1 if level == "token" else 2)
    for _ in range(25):
        B, T = rng.randint(1, 5), rng.randint(1, 6)
        lp, old, adv, mask = rand_case(rng, B, T)
        cl, ch = rng.choice([(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
        c = rng.choice([None, 3.0])
        mode = rng.choice(AGG_MODES)
        loss, m = policy_loss(t64(lp), t64(old), t64(adv), torch.tensor(mask), cl, ch, c, mode, level)
        ref, ratio = naive_policy(lp, old, adv, mask, cl, ch, c, level)
        close(loss, naive_agg(ref, mask, mode))
        valid = [(b, t) for b in range(B) for t in range(T) if mask[b][t]]
        n = len(valid)
        close(m["clipfrac_low"], sum(adv[b][t] < 0 and ratio[b][t] < 1 - cl for b, t in valid) / n)
        close(m["clipfrac_high"], sum(adv[b][t] > 0 and ratio[b][t] > 1 + ch for b, t in valid) / n)
        if c is not None:
            close(m["dual_clipfrac"], sum(adv[b][t] < 0 and ratio[b][t] > c for b, t in valid) / n)
        close(m["approx_kl"], sum(ratio[b][t] - 1 - math.log(ratio[b][t]) for b, t in valid) / n)
        close(m["ratio_mean"], sum(ratio[b][t] for b, t in valid) / n)
        close(m["ratio_max"], max(ratio[b][t] for b, t in valid))
        close(m["ratio_min"], min(ratio[b][t] for b, t in valid))
        rows = [[ratio[b][t] for t in range(T) if mask[b][t]] for b in range(B)]
        spreads = [max(r) - min(r) for r in rows if r]
        close(m["ratio_spread"], sum(spreads) / max(len(spreads), 1))
        if level == "sequence":
            assert float(m["ratio_spread"]) == 0.0  # GSPO: one ratio per response


def test_policy_loss_gradient_matches_autograd_of_naive_formula():
    rng = random.Random(3)
    for _ in range(10):
        B, T = rng.randint(1, 4), rng.randint(1, 5)
        lp, old, adv, mask = rand_case(rng, B, T, scale=0.2)
        mode = rng.choice(AGG_MODES)
        x = t64(lp).requires_grad_()
        policy_loss(x, t64(old), t64(adv), torch.tensor(mask), 0.2, 0.28, 3.0, mode)[0].backward()
        y = t64(lp).requires_grad_()
        per = [[torch.zeros((), dtype=torch.float64)] * T for _ in range(B)]
        for b in range(B):
            for t in range(T):
                if mask[b][t]:
                    r, a = torch.exp(y[b, t] - old[b][t]), adv[b][t]
                    l = torch.maximum(-a * r, -a * r.clamp(0.8, 1.28))
                    per[b][t] = torch.minimum(l, torch.tensor(-a * 3.0, dtype=torch.float64)) if a < 0 else l
        naive_agg(per, mask, mode).backward()
        close(x.grad, y.grad)


def test_gspo_gradient_equals_sequence_level_objective():
    """GSPO-token with per-sequence advantages must equal the paper's sequence objective exactly."""
    rng = random.Random(4)
    B, T = 4, 6
    lp, old, _, mask = rand_case(rng, B, T, scale=0.001)
    seq_adv = [rng.gauss(0, 1) for _ in range(B)]
    adv = [[seq_adv[b]] * T for b in range(B)]
    x = t64(lp).requires_grad_()
    loss, _ = gspo_loss(x, t64(old), t64(adv), torch.tensor(mask))
    loss.backward()
    y = t64(lp).requires_grad_()
    terms = []
    for b in range(B):
        valid = [t for t in range(T) if mask[b][t]]
        if valid:
            s = torch.exp(sum(y[b, t] - old[b][t] for t in valid) / len(valid))
            a = seq_adv[b]
            terms.append(torch.maximum(-a * s, -a * s.clamp(1 - 3e-4, 1 + 4e-4)))
    ref = sum(terms) / len(terms)
    close(loss, ref)
    ref.backward()
    close(x.grad, y.grad)


# ---------------------------------------------------------------- hand-worked branches

def test_clip_higher_chooses_the_right_branch():
    # tokens: (A, ratio) = (+1, 1.25), (+1, 1.30), (-1, 0.75), (-1, 1.25)
    ratio = torch.tensor([[1.25, 1.30, 0.75, 1.25]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    old = torch.zeros(1, 4, dtype=torch.float64)
    lp = ratio.log().requires_grad_()
    loss, m = policy_loss(lp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28,
                          agg="seq-mean-token-sum")
    # 1.25 < 1.28: unclipped (-1.25); 1.30 -> 1.28 (-1.28); A<0, .75 < .8 -> .8; A<0, 1.25 unclipped
    close(loss, -1.25 - 1.28 + 0.8 + 1.25)
    loss.backward()
    close(lp.grad, [[-1.25, 0.0, 0.0, 1.25]])                  # d(-A r)/d logp = -A r where live
    close(m["clipfrac_high"], 0.25)
    close(m["clipfrac_low"], 0.25)
    # symmetric 0.2 would have clipped the first token too
    _, sym = policy_loss(ratio.log(), old, adv, torch.ones(1, 4), clip_low=0.2)
    close(sym["clipfrac_high"], 0.5)


def test_dual_clip_caps_negative_advantage_loss():
    lp = torch.tensor([[math.log(5.0), math.log(2.0)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    loss, m = policy_loss(lp, old, adv, None, 0.2, dual_clip=3.0, agg="seq-mean-token-sum")
    close(loss, 3.0 + 2.0)                                     # ratio 5 capped at c=3; ratio 2 < 3 kept
    loss.backward()
    close(lp.grad, [[0.0, 2.0]])
    close(m["dual_clipfrac"], 0.5)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(lp, old, adv, None, 0.2, dual_clip=0.5)


def test_masks_exclude_padding_in_loss_gradient_and_metrics():
    g = torch.Generator().manual_seed(5)
    lp, old, adv = (torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    garbage = lambda x, v: torch.where(mask, x, torch.full_like(x, v))  # noqa: E731
    for level in ("token", "sequence"):
        for mode in AGG_MODES:
            a = lp.clone().requires_grad_()
            la, ma = policy_loss(a, old, adv, mask, 0.2, 0.28, 3.0, mode, level)
            la.backward()
            b = garbage(lp, 1e4).requires_grad_()
            lb, mb = policy_loss(b, garbage(old, float("nan")), garbage(adv, float("inf")), mask,
                                 0.2, 0.28, 3.0, mode, level)
            lb.backward()
            close(la, lb)
            close(a.grad, b.grad)
            assert b.grad[~mask].abs().sum() == 0
            for k in ma:
                close(ma[k], mb[k])


def test_metrics_are_detached_zero_dim_tensors_and_empty_mask_is_safe():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, m = policy_loss(lp, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert loss.item() == 0.0
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    assert m["ratio_min"].item() == m["ratio_max"].item() == 1.0 and m["clipfrac"].item() == 0.0


def test_policy_loss_rejects_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ratio_level"):
        policy_loss(x, x, x, None, ratio_level="seq")
    with pytest.raises(ValueError, match="shape"):
        policy_loss(x, x, torch.zeros(2), None)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(x, x, x, None, agg="sum")
    with pytest.raises(ValueError, match="mask shape"):
        policy_loss(x, x, x, torch.ones(2, 1))


# ---------------------------------------------------------------- value loss

def naive_value(v, old, ret, mask, clip, delta):
    def f(e):
        if delta is None or abs(e) <= delta:
            return 0.5 * e * e
        return delta * (abs(e) - 0.5 * delta)
    out = [[0.0] * len(v[0]) for _ in v]
    for b in range(len(v)):
        for t in range(len(v[0])):
            if mask[b][t]:
                l = f(v[b][t] - ret[b][t])
                if clip is not None:
                    vc = old[b][t] + min(max(v[b][t] - old[b][t], -clip), clip)
                    l = max(l, f(vc - ret[b][t]))
                out[b][t] = l
    return out


def test_value_loss_matches_naive():
    rng = random.Random(6)
    for _ in range(30):
        B, T = rng.randint(1, 4), rng.randint(1, 5)
        v = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]
        old = [[x + rng.gauss(0, 0.5) for x in row] for row in v]
        ret = [[rng.gauss(0, 2) for _ in range(T)] for _ in range(B)]
        mask = [[rng.random() < 0.7 for _ in range(T)] for _ in range(B)]
        clip, delta = rng.choice([None, 0.2]), rng.choice([None, 1.0])
        mode = rng.choice(AGG_MODES)
        loss, m = value_loss(t64(v), t64(old), t64(ret), torch.tensor(mask), clip, delta, mode)
        close(loss, naive_agg(naive_value(v, old, ret, mask, clip, delta), mask, mode))


def test_value_loss_hand_worked_clip_and_metrics():
    v = torch.tensor([[2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0]])
    ret = torch.tensor([[3.0, 1.0]])
    loss, m = value_loss(v, old, ret, None, clip=0.5, agg="seq-mean-token-sum")
    # token 0: unclipped .5*1 = .5, clipped v=.5 -> .5*2.5^2 = 3.125 (wins, no grad); token 1: .5
    close(loss, 3.125 + 0.5)
    loss.backward()
    close(v.grad, [[0.0, -1.0]])
    close(m["vf_clipfrac"], 0.5)
    _, m2 = value_loss(ret.clone(), old, ret)
    close(m2["explained_var"], 1.0)
    close(m2["vf_clipfrac"], 0.0)


def test_value_loss_time_major_without_mask():
    v, old, ret = torch.zeros(4, 3), torch.zeros(4, 3), torch.ones(4, 3)
    loss, _ = value_loss(v, old, ret)                          # [T, N], every element valid
    close(loss, 0.5)


@pytest.mark.parametrize("clip", [0.2, torch.tensor(0.1)])
def test_sample_losses_equal_the_masked_losses_on_every_sample_with_their_gradients(clip):
    """The embodied actor's lean losses: the same loss, approx_kl, clipfrac and gradients as policy_loss with no
    mask on [B, 1], and the same value loss as value_loss (with and without value clipping)."""
    torch.manual_seed(7)
    old = torch.randn(64) * 0.5
    new = (old + torch.randn(64) * 0.3).requires_grad_()
    adv = torch.randn(64)
    loss, kl, cf = sample_policy_loss(new, old, adv, clip)
    ref, m = policy_loss(new[:, None], old[:, None], adv[:, None], None, clip_low=clip)
    assert 0 < float(cf) < 1  # both clip branches taken
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(kl, m["approx_kl"])
    torch.testing.assert_close(cf, m["clipfrac"])
    (g,) = torch.autograd.grad(loss, new)
    (g_ref,) = torch.autograd.grad(ref, new)
    torch.testing.assert_close(g, g_ref)
    assert not kl.requires_grad and not cf.requires_grad

    values, old_v, returns = (torch.randn(64) for _ in range(3))
    values.requires_grad_()
    for vclip in (None, 0.2):
        mine = sample_value_loss(values, old_v, returns, vclip)
        theirs = value_loss(values, old_v, returns, clip=vclip)[0]
        torch.testing.assert_close(mine, theirs)
        torch.testing.assert_close(torch.autograd.grad(mine, values)[0], torch.autograd.grad(theirs, values)[0])
    with torch.no_grad():
        assert float(sample_value_loss(values, old_v, returns, 0.2)) > float(sample_value_loss(values, old_v, returns))
    with pytest.raises(ValueError, match=r"one \[B\] shape"):
        sample_policy_loss(new[:, None], old[:, None], adv[:, None], 0.2)
    with pytest.raises(ValueError, match="value clip must be > 0"):
        sample_value_loss(values, old_v, returns, 0.0)


def test_behaviour_weights_are_truncated_importance_ratios():
    from m2flow.algorithms import behaviour_weights

    prox = torch.tensor([[0.0, math.log(2.0), math.log(5.0), 3.0]])
    behaviour = torch.tensor([[0.0, 0.0, 0.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding: ignored, weight 1
    w, m = behaviour_weights(prox, behaviour, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 2.0, 1.0]]))
    assert not w.requires_grad
    assert float(m["behaviour_weight_mean"]) == pytest.approx(5.0 / 3.0)
    assert float(m["behaviour_weight_max"]) == pytest.approx(5.0)  # before the cap
    assert float(m["behaviour_capfrac"]) == pytest.approx(1.0 / 3.0)  # 2.0 sits on the cap, 5.0 is over it
    with pytest.raises(ValueError, match="cap must be >= 1"):
        behaviour_weights(prox, behaviour, mask, cap=0.5)
    with pytest.raises(ValueError, match="share one shape"):
        behaviour_weights(prox, behaviour[:, :2], mask)


# ---------------------------------------------------------------- direction of the GRPO gradient

@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_grpo_gradient_points_along_the_exact_gradient_of_expected_reward(estimator):
    """A tiny problem solved exactly: 4 prompts, responses of 2 tokens from 3 (each token its own softmax), a fixed
    reward per (prompt, response). The loss gradient averaged over 2,000 sampled batches of 4 prompts x 8 responses
    (group advantages, PPO loss at ratio 1, token mean) must point along the exact gradient of E[reward]: a sign or
    baseline slip breaks this."""
    from m2flow.algorithms import get_advantage_fn

    g = torch.Generator().manual_seed(0)
    P, T, V, n, batches = 4, 2, 3, 8, 2000
    theta = (torch.randn(P, T, V, generator=g) * 0.5).requires_grad_()
    reward = torch.rand(P, V, V, generator=g).round()  # 0/1 outcome of each (prompt, a1, a2)

    logp = torch.log_softmax(theta, -1)  # [P, T, V]
    joint = logp[:, 0, :, None] + logp[:, 1, None, :]  # [P, V, V]
    exact = torch.autograd.grad((joint.exp() * reward).sum(-1).sum(-1).mean(), theta)[0]

    probs = logp.detach().exp()  # sample [batches, P, n, T] tokens
    tokens = torch.multinomial(probs.repeat(batches * n, 1, 1).reshape(-1, V), 1, generator=g)
    tokens = tokens.view(batches, n, P, T).transpose(1, 2)
    scores = reward[torch.arange(P)[None, :, None], tokens[..., 0], tokens[..., 1]].reshape(-1)  # [batches*P*n]
    logp = torch.log_softmax(theta, -1)
    token_lp = logp[torch.arange(P)[None, :, None, None], torch.arange(T), tokens].reshape(-1, T)
    mask = torch.ones_like(token_lp)
    advantages = get_advantage_fn(estimator)(scores, mask, n)
    loss, _ = policy_loss(token_lp, token_lp.detach(), advantages, mask)
    ascent = -torch.autograd.grad(loss, theta)[0]
    cosine = torch.nn.functional.cosine_similarity(ascent.flatten(), exact.flatten(), dim=0)
    assert cosine > 0.9, f"{estimator}: cosine {cosine:.3f} between the sampled GRPO gradient and the exact one"
