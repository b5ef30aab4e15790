"""Weight sync: a state dict published in buckets comes back bit-identical (also bf16), loads in place into another
module, and its digest is the receiver's `state_digest`; a worker on another process receives it the same way."""

import pytest
import torch

from m2flow.runtime import ComponentPlacement, Worker, WorkerError, release_all
from m2flow.runtime.weights import WeightsRef, fetch, load_into, loaded_digest, publish, state_digest


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 32))
    m.register_buffer("scale", torch.randn(5).to(torch.bfloat16))
    return m


def test_buckets_round_trip_bit_identical(cluster):
    src = _model(0)
    state = src.state_dict()
    one = publish(state, version=3)
    many = publish(state, version=3, bucket_bytes=1024)  # each tensor over 1 KB closes a bucket
    assert len(one.ref) == 1 and len(many.ref) >= 3
    assert one.digest == many.digest == state_digest(state)
    got = fetch(many)
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], state[k]) and got[k].dtype == state[k].dtype for k in state)

    dst = _model(1)
    assert state_digest(dst.state_dict()) != many.digest
    load_into(dst, many)
    assert state_digest(dst.state_dict()) == many.digest


def test_unchecked_weights_carry_no_digest_and_receivers_compute_none(cluster):
    """`rollout.check_weight_sync=false`: neither side hashes the weights; the tensors still arrive bit-identical."""
    state = _model(0).state_dict()
    weights = publish(state, version=1, digest=False)
    dst = _model(1)
    load_into(dst, weights)
    assert weights.digest is None and loaded_digest(dst, weights) is None
    assert state_digest(dst.state_dict()) == state_digest(state)
    assert loaded_digest(dst, publish(state, version=1)) == state_digest(state)


def test_streamed_items_must_be_sorted(cluster):
    state = _model(0).state_dict()
    items = iter(sorted(state.items()))
    assert publish(items, 0, bucket_bytes=512).digest == state_digest(state)
    with pytest.raises(ValueError, match="sorted name order"):
        publish(iter(sorted(state.items(), reverse=True)), 0)


def test_missing_tensors_are_named(cluster):
    state = dict(_model(0).state_dict())
    state.pop("1.bias")
    with pytest.raises(ValueError, match=r"lack 1 tensors, e.g. \['1.bias'\]"):
        load_into(_model(1), publish(state, 7))


class Receiver(Worker):
    def __init__(self):
        self.model = _model(5)

    def load(self, weights: WeightsRef) -> str:
        load_into(self.model, weights)
        return state_digest(self.model.state_dict())


def test_other_processes_receive_the_buckets(cluster):
    group = Receiver.launch(cluster, ComponentPlacement("receiver", ((0,), (1,))))
    try:
        weights = publish(_model(0).state_dict(), 1, bucket_bytes=4096)
        assert group.load(weights).wait() == [weights.digest, weights.digest]
    finally:
        release_all([group])


def test_local_publication_stays_in_the_process_and_other_processes_are_refused(cluster):
    src = _model(0)
    weights = publish(src.state_dict(), 2, local=True)
    assert weights.ref == [] and weights.local is not None  # nothing went to the object store
    dst = _model(1)
    load_into(dst, weights)
    assert state_digest(dst.state_dict()) == weights.digest == state_digest(src.state_dict())
    group = Receiver.launch(cluster, ComponentPlacement("receiver", ((0,),)))
    try:
        with pytest.raises(WorkerError, match="published for receivers in the publishing process only"):
            group.load(weights).wait()
    finally:
        release_all([group])
    newer = publish(src.state_dict(), 3, local=True)
    with pytest.raises(RuntimeError, match="a newer version replaced them"):
        load_into(dst, weights)  # only the latest publication is kept
    load_into(dst, newer)
