"""KL estimators and entropy vs naive formulas; k3 non-negativity; masking of padding."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m2flow.algorithms import AGG_MODES, entropy_from_logits, kl_k1, kl_k2, kl_k3, kl_loss, mean_entropy


def close(a, b, tol=1e-9):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol, rtol=tol), (a, b)


def test_estimators_match_naive_formulas():
    rng = random.Random(0)
    lp = [rng.uniform(-8, 0) for _ in range(200)]
    ref = [x + rng.gauss(0, 1) for x in lp]
    a, b = torch.tensor(lp, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    close(kl_k1(a, b), [x - y for x, y in zip(lp, ref)])
    close(kl_k2(a, b), [0.5 * (x - y) ** 2 for x, y in zip(lp, ref)])
    close(kl_k3(a, b), [min(math.exp(y - x) - 1 - (y - x), 10.0) for x, y in zip(lp, ref)], 1e-7)


def test_k3_is_unbiased_for_the_true_kl():
    # pi = softmax(z), ref = softmax(w): E_{x~pi}[k1] = E[k3] = KL(pi || ref)
    g = torch.Generator().manual_seed(1)
    z, w = torch.randn(6, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    logp, logr = z.log_softmax(0), w.log_softmax(0)
    p = logp.exp()
    true_kl = (p * (logp - logr)).sum()
    close((p * kl_k1(logp, logr)).sum(), true_kl)
    close((p * kl_k3(logp, logr)).sum(), true_kl, 1e-7)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e4, 0), st.floats(-1e4, 0)), min_size=1, max_size=30))
def test_k3_non_negative_and_finite(pairs):
    lp = torch.tensor([p[0] for p in pairs])
    ref = torch.tensor([p[1] for p in pairs])
    k = kl_k3(lp, ref)
    assert (k >= 0).all() and (k <= 10).all() and torch.isfinite(k).all()
    assert (kl_k2(lp, ref) >= 0).all()


def test_kl_loss_masks_padding_and_aggregates():
    rng = random.Random(2)
    B, T = 3, 4
    lp = [[rng.uniform(-3, 0) for _ in range(T)] for _ in range(B)]
    ref = [[rng.uniform(-3, 0) for _ in range(T)] for _ in range(B)]
    mask = [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    for name, f in (("k1", lambda x, y: x - y), ("mse", lambda x, y: 0.5 * (x - y) ** 2),
                    ("low_var_kl", lambda x, y: math.exp(y - x) - 1 - (y - x))):
        x = torch.tensor(lp, dtype=torch.float64)
        r = torch.where(torch.tensor(mask).bool(), torch.tensor(ref, dtype=torch.float64), float("nan"))
        loss, m = kl_loss(x, r, torch.tensor(mask), name, "seq-mean-token-mean")
        rows = [sum(f(lp[b][t], ref[b][t]) for t in range(T) if mask[b][t]) / sum(mask[b]) for b in (0, 1)]
        close(loss, sum(rows) / 2, 1e-7)
        close(m["kl"], loss)
    with pytest.raises(ValueError, match="valid: k1, k2, k3, low_var_kl, mse"):
        kl_loss(x, x, None, "k4")


def test_entropy_matches_naive_and_is_stable():
    rng = random.Random(3)
    for _ in range(20):
        z = [rng.gauss(0, 3) for _ in range(rng.randint(1, 9))]
        mx = max(z)
        e = [math.exp(v - mx) for v in z]
        p = [v / sum(e) for v in e]
        naive = -sum(q * math.log(q) for q in p if q > 0)
        close(entropy_from_logits(torch.tensor(z, dtype=torch.float64)), naive, 1e-9)
    close(entropy_from_logits(torch.full((2, 4), 1e4)), [math.log(4)] * 2, 1e-5)    # no overflow
    close(entropy_from_logits(torch.tensor([0.0, -1e4])), 0.0, 1e-6)


def test_mean_entropy_masks_padding_and_backprops():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    dirty = logits.clone()
    dirty[~mask] = float("nan")
    dirty.requires_grad_()
    for mode in AGG_MODES:
        ent, m = mean_entropy(dirty, mask, mode)
        h = entropy_from_logits(logits)
        expect = {"token-mean": h[mask].mean(),
                  "seq-mean-token-sum": (h[0, :2].sum() + h[1, 0]) / 2,
                  "seq-mean-token-mean": (h[0, :2].mean() + h[1, 0]) / 2}[mode]
        close(ent, expect)
        close(m["entropy"], ent)
    ent.backward()
    assert torch.isfinite(dirty.grad).all() and dirty.grad[~mask].abs().sum() == 0
