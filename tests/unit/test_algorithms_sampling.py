"""DAPO dynamic sampling and overlong shaping vs naive loops."""

import random

import pytest
import torch

from m2flow.algorithms import filter_groups, overlong_filter, overlong_penalty


def naive_filter(scores, ids, max_groups):
    order, members = [], {}
    for i, g in enumerate(ids):
        if g not in members:
            order.append(g)
            members[g] = []
        members[g].append(i)
    kept = [g for g in order if len({scores[i] for i in members[g]}) > 1]
    chosen = set(kept if max_groups is None else kept[:max_groups])
    idx = [i for i, g in enumerate(ids) if g in chosen]
    return idx, {"groups": len(order), "kept_groups": len(kept), "dropped_groups": len(order) - len(kept),
                 "selected_groups": len(chosen)}


def test_filter_groups_matches_naive():
    rng = random.Random(0)
    for _ in range(40):
        B = rng.randint(1, 20)
        ids = [rng.randint(0, 5) * 3 for _ in range(B)]
        scores = [float(rng.random() < 0.5) for _ in range(B)]
        max_groups = rng.choice([None, 0, 1, 2, 10])
        idx, info = filter_groups(torch.tensor(scores), torch.tensor(ids), max_groups)
        nidx, ninfo = naive_filter(scores, ids, max_groups)
        assert idx.tolist() == nidx and info == ninfo


def test_filter_groups_hand_worked_and_refill():
    # groups of 2: [1,1] all solved, [0,1] mixed, [0,0] all failed, [1,0] mixed
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    idx, info = filter_groups(scores, 2)
    assert idx.tolist() == [2, 3, 6, 7]
    assert info == {"groups": 4, "kept_groups": 2, "dropped_groups": 2, "selected_groups": 2}
    # the flow needs 3 groups: first batch gives 2, a second batch is cut to the 1 still missing
    have = info["selected_groups"]
    idx2, info2 = filter_groups(torch.tensor([0.0, 1.0, 1.0, 0.0]), 2, max_groups=3 - have)
    assert idx2.tolist() == [0, 1] and info2["selected_groups"] == 1 and info2["kept_groups"] == 2
    with pytest.raises(ValueError):
        filter_groups(torch.zeros(2, 2), 2)


def test_overlong_penalty_matches_naive():
    max_len, cache, factor = 20, 4, 0.5
    lengths = list(range(0, 26))
    got = overlong_penalty(torch.tensor(lengths), max_len, cache, factor)
    for L, p in zip(lengths, got.tolist()):
        if L <= max_len - cache:
            ref = 0.0
        elif L <= max_len:
            ref = factor * ((max_len - cache) - L) / cache
        else:
            ref = -factor
        assert abs(p - ref) < 1e-6, (L, p, ref)
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), 4, 8)


def test_overlong_filter_masks_truncated_responses():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    out = overlong_filter(mask, torch.tensor([True, False, True]))
    assert out.tolist() == [[0, 0, 0], [1, 1, 0], [0, 0, 0]] and out.dtype == mask.dtype
