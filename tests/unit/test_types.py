import pytest
import torch

from m2flow.types import Batch


def test_split_concat_roundtrip_pads_ragged_width():
    a = Batch({"ids": torch.arange(6).view(2, 3), "r": torch.tensor([1.0, 2.0])})
    b = Batch({"ids": torch.arange(10).view(2, 5), "r": torch.tensor([3.0, 4.0])})
    c = Batch.concat([a, b], pad_value={"ids": -1})
    assert c["ids"].shape == (4, 5)
    assert c["ids"][0].tolist() == [0, 1, 2, -1, -1]
    assert [len(x) for x in c.split(3)] == [3, 1]
    assert c.select([3, 0])["r"].tolist() == [4.0, 1.0]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="leading dimension"):
        Batch({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(KeyError, match="has no tensor 'x'"):
        Batch({"a": torch.zeros(2)})["x"]
