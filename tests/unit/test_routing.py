"""Routing a batch across the ranks of a data-parallel consumer group: contiguous, near-equal shares, and a
zero-weight filler for a rank a small batch cannot feed."""

import pytest
import torch

from m2flow.runtime.stream import split_for_ranks
from m2flow.types import Batch


def _batch(n: int) -> Batch:
    return Batch({"x": torch.arange(n).view(n, 1)}, {"step": 4})


def test_shares_are_contiguous_and_near_equal():
    shares = split_for_ranks(_batch(10), 3)
    assert [s["x"].view(-1).tolist() for s in shares] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert all(s.meta == {"step": 4} for s in shares)


def test_a_rank_without_samples_gets_a_zero_weight_filler():
    shares = split_for_ranks(_batch(1), 3)
    assert [len(s) for s in shares] == [1, 1, 1]
    assert [s.meta.get("weight", 1) for s in shares] == [1, 0, 0]


def test_empty_batch_is_an_error():
    with pytest.raises(ValueError, match="empty batch"):
        split_for_ranks(Batch({"x": torch.zeros(0, 1)}), 2)
