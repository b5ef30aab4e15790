"""Channel on real Ray: FIFO, keys, weights, backpressure, timeouts, close, transports and tensor fidelity."""

import asyncio
import dataclasses
import gc
import re
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import ray
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m2flow.runtime.channel import INLINE_MAX, Channel, ChannelClosed, ChannelItemLost, ChannelTimeout


@ray.remote(num_cpus=0)
class Proc:
    """A plain worker process: runs the function it is given."""

    def run(self, fn, *args):
        return fn(*args)


@ray.remote(num_cpus=0)
class AsyncProc:
    """An async actor: awaits the coroutine function it is given."""

    async def run(self, fn, *args):
        return await fn(*args)


@pytest.fixture(scope="module")
def helpers(cluster):
    """Two workers, one to kill, one async actor: started together, each having imported this module."""
    ps = [Proc.remote(), Proc.remote(), Proc.remote(), AsyncProc.remote()]
    ray.get([p.run.remote(_warm) for p in ps[:3]] + [ps[3].run.remote(_warm_async)])
    yield ps
    for p in ps:
        ray.kill(p)


def _warm():
    return torch.zeros(1).sum().item()


async def _warm_async():
    return _warm()


@pytest.fixture
def procs(helpers):
    return helpers[:2]


@pytest.fixture(scope="module")
def shared(helpers):
    """One channel that other processes already use, for tests that only need a fresh key."""
    c = Channel.create(f"test-shared-{uuid.uuid4().hex[:8]}")
    ray.get(helpers[0].run.remote(lambda ch: ch.qsize(), c))
    yield c
    c.destroy()


@pytest.fixture
def key():
    return uuid.uuid4().hex[:8]


@pytest.fixture
def chan(cluster):
    """A fresh channel that only this process has used so far."""
    c = Channel.create(f"test-{uuid.uuid4().hex[:8]}")
    yield c
    c.destroy()


@dataclasses.dataclass
class Sample:
    tokens: torch.Tensor
    reward: float


def payload(big: bool) -> dict:
    """Every tensor kind the channel must carry bit-identically, nested in dicts, lists, tuples, a dataclass."""
    g = torch.Generator().manual_seed(0)
    n = 200_000 if big else 100
    f32 = torch.randn(n, generator=g)
    f32[:3] = torch.tensor([float("nan"), -0.0, float("inf")])
    return {
        "f32": f32,
        "bf16": torch.randn(n, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (n,), generator=g),
        "strided": torch.randn(8, n // 4, generator=g).t()[::3],  # transposed and sliced: not contiguous
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.int8),
        "mask": torch.rand(n, generator=g) > 0.5,
        "nested": [(torch.arange(6, dtype=torch.int16).reshape(2, 3), "meta"),
                   {"deep": torch.ones(2, 2, dtype=torch.float16)}],
        "sample": Sample(torch.arange(n, dtype=torch.int32), 0.5),
        "grad": torch.ones(3, requires_grad=True),
        "array": np.arange(n, dtype=np.float32),
    }


def same_bits(a, b) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
            and torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                            b.detach().contiguous().reshape(-1).view(torch.uint8)))


def assert_payload_equal(got, want):
    for k in ("f32", "bf16", "i64", "strided", "scalar", "empty", "mask", "grad"):
        assert same_bits(got[k], want[k]), k
    assert same_bits(got["nested"][0][0], want["nested"][0][0]) and got["nested"][0][1] == "meta"
    assert same_bits(got["nested"][1]["deep"], want["nested"][1]["deep"])
    assert same_bits(got["sample"].tokens, want["sample"].tokens) and got["sample"].reward == 0.5
    assert np.array_equal(got["array"], want["array"])


# ------------------------------------------------------------------------------------ queue semantics


def test_same_process_fifo_by_reference(chan):
    items = [{"x": torch.arange(3)}, [1, 2], "three", torch.randn(1000, 1000), None]
    chan.put(items[0])  # the first use asks the actor once whether this process is the only user
    actor, chan._actor = chan._actor, None  # from here on no call may reach the actor
    try:
        for it in items[1:]:
            chan.put(it)
        assert chan.qsize() == 5
        got = [chan.get(timeout=5) for _ in items]
        assert all(g is it for g, it in zip(got, items))  # the very same objects, never serialized
        chan.put_many(list("abcd"), key="k", weights=[1, 2, 1, 5])
        assert chan.get_batch(3, key="k", timeout=5) == ["a", "b"]
        with pytest.raises(ChannelTimeout, match="get timed out after 0.1s"):
            chan.get_batch(7, key="k", timeout=0.1)  # only 6 of weight: nothing is taken
        assert chan.get_all(key="k", timeout=5) == ["c", "d"]
    finally:
        chan._actor = actor


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_hand_over_keeps_each_producers_order(chan, procs):
    chan.put_many([1, 2])  # queued in this process
    later = procs[0].run.remote(lambda ch: ch.put(3), chan)  # another process: the channel moves to the actor
    ray.get(later, timeout=20)
    chan.put(4)
    got = ray.get(procs[1].run.remote(lambda ch: [ch.get(timeout=10) for _ in range(4)], chan), timeout=30)
    assert got == [1, 2, 3, 4]  # the queued items first, then what came after, in order
    assert chan.qsize() == 0


def test_keys_are_independent_sub_queues(shared, key):
    a, b = ("a", key), ("b", key)
    shared.put_many(["a0", "a1"], key=a)
    shared.put("b0", key=b)
    assert (shared.qsize(a), shared.qsize(b), shared.qsize(key)) == (2, 1, 0)
    assert shared.get(key=b, timeout=5) == "b0"
    assert shared.get(key=a, timeout=5) == "a0"
    with pytest.raises(ChannelTimeout):
        shared.get(key=b, timeout=0.1)  # "a" still holds an item, "b" does not
    assert shared.get(key=a, timeout=5) == "a1"


def test_get_batch_by_weight(shared, key):
    shared.put_many(list("abcdef"), key=key, weights=[1, 2, 1, 5, 0.5, 0.25])
    assert shared.get_batch(3, key=key, timeout=5) == ["a", "b"]  # 1 + 2 reaches 3
    assert shared.get_batch(2, key=key, timeout=5) == ["c", "d"]  # one heavy item ends a batch early
    with pytest.raises(ChannelTimeout):
        shared.get_batch(1, key=key, timeout=0.2)  # only 0.75 of weight left: nothing is taken ...
    assert shared.qsize(key) == 2  # ... and the partial batch went back in order
    assert shared.get_batch(0.75, key=key, timeout=5) == ["e", "f"]
    with pytest.raises(ValueError, match="target_weight"):
        shared.get_batch(0, key=key)


def test_get_all_takes_everything_queued_in_one_call(shared, key, procs):
    with pytest.raises(ChannelTimeout):
        shared.get_all(key=key, timeout=0.2)  # waits for at least one item
    shared.put_many(["a", torch.arange(3), "c"], key=key, weights=[1, 5, 0.5])
    got = shared.get_all(key=key, timeout=5)
    assert got[0] == "a" and torch.equal(got[1], torch.arange(3)) and got[2] == "c" and shared.qsize(key) == 0
    later = procs[0].run.remote(lambda ch, k: ch.get_all(key=k, timeout=20), shared, key)  # waiting when items come
    time.sleep(0.3)
    shared.put_many([1, 2], key=key)
    assert ray.get(later, timeout=20) == [1, 2]  # one put_many appends both before a waiter wakes


def test_backpressure_blocks_put_until_a_get(procs):
    chan = Channel.create(f"test-{uuid.uuid4().hex[:8]}", maxsize=2)
    try:
        def put_three(ch):
            for i in range(3):
                ch.put(i, key="a")
            return time.monotonic()

        pending = procs[0].run.remote(put_three, chan)
        deadline = time.monotonic() + 20
        while chan.qsize("a") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not ray.wait([pending], timeout=0.5)[0]  # two are in; the third put waits for room
        assert chan.qsize("a") == 2
        chan.put("other key", key="b", timeout=2)  # maxsize is per key: "b" has room
        t_get = time.monotonic()
        assert chan.get(key="a", timeout=5) == 0
        assert ray.get(pending, timeout=10) >= t_get - 0.05  # it went on only after the get
        assert chan.get_batch(2, key="a", timeout=5) == [1, 2]
        chan.put_many([5, 6], key="a")
        t0 = time.monotonic()
        with pytest.raises(ChannelTimeout, match=rf"channel '{chan.name}' key 'a': put timed out after 0.3s"):
            chan.put(7, key="a", timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 3
        assert chan.get_batch(2, key="a", timeout=1) == [5, 6]
    finally:
        chan.destroy()


def test_get_timeout_names_channel_key_and_timeout(shared, key):
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout, match=rf"channel '{shared.name}' key '{key}': get timed out after 0.3s"):
        shared.get(key=key, timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 3
    assert isinstance(ChannelTimeout("x"), TimeoutError)


def test_close_drains_then_raises(chan, procs):
    blocked = procs[0].run.remote(lambda ch: ch.get(key="idle", timeout=30), chan)
    chan.put_many([1, 2, 3], weights=[1, 1, 1])
    time.sleep(0.3)
    chan.close()
    with pytest.raises(ChannelClosed):
        chan.put(4)
    assert chan.get(timeout=5) == 1
    assert chan.get_batch(5, timeout=5) == [2, 3]  # closed: the last batch may be short
    with pytest.raises(ChannelClosed, match="closed and drained"):
        chan.get(timeout=5)
    with pytest.raises(ChannelClosed):
        ray.get(blocked, timeout=10)  # a get that was waiting when the channel closed


def test_destroy_wakes_waiters(procs):
    chan = Channel.create(f"test-{uuid.uuid4().hex[:8]}")
    blocked = procs[0].run.remote(lambda ch: ch.get(timeout=30), chan)
    time.sleep(0.5)
    chan.destroy()
    with pytest.raises(ChannelClosed, match="gone"):
        ray.get(blocked, timeout=20)


def test_create_and_connect_errors(shared):
    with pytest.raises(ValueError, match="already exists"):
        Channel.create(shared.name)
    with pytest.raises(ValueError, match="no channel named"):
        Channel.connect("no-such-channel")
    with pytest.raises(ValueError, match="maxsize >= 0"):
        Channel.create("negative", maxsize=-1)
    with pytest.raises(ValueError, match="weights"):
        shared.put_many([1, 2], weights=[1])


def test_a_stream_ends_after_the_ends_of_the_producers_the_channel_names(procs):
    """A channel made with its producer and consumer counts carries them wherever it goes: two worker-side
    producers `finish` (one END per consumer the channel names) and a drain with no counts given stops after both
    producers' ENDs, with every item."""
    from m2flow.runtime.stream import drain, finish

    ch = Channel.create(f"counts-{uuid.uuid4().hex}", producers=2, consumers=1)
    try:
        def produce(c, i):
            c.put_many([i, i + 10])
            finish(c)  # the channel's consumers: 1
            return (c.producers, c.consumers)

        assert ray.get([procs[0].run.remote(produce, ch, 1), procs[1].run.remote(produce, ch, 2)],
                       timeout=60) == [(2, 1), (2, 1)]
        assert sorted(drain(ch, timeout=20)) == [1, 2, 11, 12]
        assert repr(ch).endswith("producers=2, consumers=1)")
        with pytest.raises(ValueError, match="at least one producer and consumer"):
            Channel.create(f"none-{uuid.uuid4().hex}", producers=0)
    finally:
        ch.destroy()


# ------------------------------------------------------------------------------------ transports


def test_driver_to_worker_and_back(chan, procs):
    chan.put_many(["hello", {"n": 1}])  # by reference: nobody else has the channel yet
    got = ray.get(procs[0].run.remote(lambda ch: [ch.get(timeout=10), ch.get(timeout=10)], chan), timeout=30)
    assert got == ["hello", {"n": 1}]  # handed over when the channel left the driver
    ray.get(procs[0].run.remote(lambda ch: ch.put(("from", "worker")), chan))
    assert chan.get(timeout=10) == ("from", "worker")


def test_worker_connects_by_name_while_driver_holds_items(chan, procs):
    chan.put(torch.arange(5))  # by reference; the worker never receives this Channel object
    got = ray.get(procs[1].run.remote(lambda name: Channel.connect(name).get(timeout=20), chan.name), timeout=40)
    assert torch.equal(got, torch.arange(5))


@pytest.mark.parametrize("big", [False, True], ids=["inline", "object-store"])
def test_worker_to_worker_tensors_bit_identical(shared, key, procs, big):
    producer, consumer = procs
    taken = consumer.run.remote(lambda ch, k: ch.get(key=k, timeout=30), shared, key)
    ray.get(producer.run.remote(lambda ch, k, big: ch.put(payload(big), key=k), shared, key, big))
    assert_payload_equal(ray.get(taken, timeout=30), payload(big))


def test_large_tensor_arrives_as_shared_memory_view(shared, key, procs):
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/maps")

    def where(ch, k):
        t = ch.get(key=k, timeout=30)["w"]
        p = t.data_ptr()
        for line in open("/proc/self/maps"):
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= p < hi:
                return line.split()[5] if len(line.split()) > 5 else "anonymous", t.sum().item()
        return "?", None

    taken = procs[1].run.remote(where, shared, key)
    ray.get(procs[0].run.remote(lambda ch, k: ch.put({"w": torch.ones(4 << 20)}, key=k), shared, key))
    mapping, total = ray.get(taken, timeout=30)
    assert "plasma" in mapping and total == 4 << 20  # a view of the object store: no copy on the way in


def test_item_holding_ray_refs(shared, key, procs):
    ref = ray.put(41)
    ray.get(procs[0].run.remote(lambda ch, k, box: ch.put({"ref": box[0]}, key=k), shared, key, [ref]))
    assert ray.get(shared.get(key=key, timeout=10)["ref"]) == 41


def _plasma_mib() -> int:
    from ray._private.internal_api import memory_summary

    text = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
    return int(re.search(r"Plasma memory usage (\d+) MiB", text).group(1))


def _settled_plasma_mib() -> int:
    """Usage once Ray has finished freeing what earlier tests dropped."""
    last = _plasma_mib()
    for _ in range(30):
        time.sleep(0.3)
        now = _plasma_mib()
        if now == last:
            return now
        last = now
    return last


def test_consumed_items_free_the_object_store(shared, key, procs):
    base = _settled_plasma_mib()

    def put16(ch, k):
        for i in range(16):
            ch.put(torch.full((1 << 20,), float(i)), key=k)

    ray.get(procs[0].run.remote(put16, shared, key))
    assert _plasma_mib() >= 60  # 16 x 4 MiB wait in the store (base may shrink meanwhile: earlier tests free theirs)
    got = [shared.get(key=key, timeout=10) for _ in range(16)]
    assert [t[0].item() for t in got] == list(range(16))
    del got
    gc.collect()
    deadline = time.monotonic() + 10
    while _plasma_mib() > base + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _plasma_mib() <= base + 2


def test_producer_exit_small_items_survive_large_may_be_lost(shared, key, helpers):
    victim = helpers[2]
    ray.get(victim.run.remote(lambda ch, k: ch.put_many(["small", torch.zeros(INLINE_MAX)], key=k), shared, key))
    ray.kill(victim)
    deadline = time.monotonic() + 30
    while True:  # ray.kill is asynchronous: a call right after it may still be answered
        try:
            ray.get(victim.run.remote(len, ""), timeout=30)
        except ray.exceptions.RayActorError:
            break  # it is gone
        assert time.monotonic() < deadline, "the killed producer still answers after 30 s"
        time.sleep(0.1)
    time.sleep(1.0)
    assert shared.get(key=key, timeout=10) == "small"  # inline: the channel's actor holds it
    try:  # object store: owned by the producer; Ray frees a dead owner's objects, but not at once
        assert torch.equal(shared.get(key=key, timeout=10), torch.zeros(INLINE_MAX))
    except ChannelItemLost as e:
        assert "exited before it was taken" in str(e)  # a clear error, never a hang or wrong data


def test_async_variants_in_an_async_actor(shared, key, helpers):
    async def consume(ch, k):
        first = await ch.get_async(key=k, timeout=20)
        batch = await ch.get_batch_async(2, key=k, timeout=20)
        try:
            await ch.get_async(key="none", timeout=0.2)
        except ChannelTimeout as e:
            late = str(e)
        return first, batch, late

    async def produce(ch, k):
        await ch.put_async(torch.arange(3), key=k)
        await ch.put_many_async(["b", "c"], key=k, weights=[1, 1])
        return await asyncio.gather(ch.put_async("k1", key=(k, 1)), ch.put_async("k2", key=(k, 1)))

    actor = helpers[3]
    taken = actor.run.remote(consume, shared, key)  # the same actor keeps serving while this get waits
    ray.get(actor.run.remote(produce, shared, key), timeout=30)
    first, batch, late = ray.get(taken, timeout=30)
    assert torch.equal(first, torch.arange(3)) and batch == ["b", "c"]
    assert "get timed out after 0.2s" in late
    assert sorted(shared.get_batch(2, key=(key, 1), timeout=5)) == ["k1", "k2"]


def test_threads_share_one_process_side(chan):
    out = []
    consumer = threading.Thread(target=lambda: out.extend(chan.get(timeout=10) for _ in range(50)))
    consumer.start()
    items = [object() for _ in range(50)]
    for it in items:
        chan.put(it)
    consumer.join(20)
    assert len(out) == 50 and all(a is b for a, b in zip(out, items))


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool,
                           torch.complex64, torch.float64]),
    shape=st.lists(st.integers(0, 5), max_size=3),
    transpose=st.booleans(),
)
def test_encode_roundtrip_is_bit_identical(cluster, dtype, shape, transpose):
    from m2flow.runtime.channel import _decode, _encode

    g = torch.Generator().manual_seed(len(shape))
    if dtype.is_complex:
        t = torch.randn(shape, dtype=dtype, generator=g)
    else:
        t = (torch.randn(shape, generator=g) * 100).to(dtype)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)
    for pad in (0, INLINE_MAX):  # inline and through the object store
        kind, data = _encode({"t": t, "pad": torch.zeros(pad // 4)})
        fetched = ray.get(data[0]) if isinstance(data, list) else None
        assert same_bits(_decode(kind, data, fetched)["t"], t)


def frames(n: int = 64) -> np.ndarray:
    """n 64x64 RGB frames of a flat-shaded scene with a cube somewhere: what a simulator's camera gives."""
    g = np.random.default_rng(0)
    yy, xx = np.mgrid[0:64, 0:64]
    out = np.repeat(np.stack([xx // 8 * 20, yy // 16 * 40, np.full_like(xx, 90)], 0)[None], n, 0).astype(np.uint8)
    for i, (y, x) in enumerate(g.integers(0, 58, (n, 2))):
        out[i, :, y:y + 6, x:x + 6] = np.array([200, 30, 30], np.uint8)[:, None, None]
    return out


def test_a_compressing_channel_moves_frames_compressed_and_everything_else_as_it_is(cluster):
    from m2flow.runtime.channel import _INLINE, _decode, _encode

    item = {"frames": frames(), "tensor_frames": torch.from_numpy(frames(32)), "f32": torch.randn(100_000),
            "small": np.arange(100, dtype=np.uint8)}
    sizes = {}
    for compress in (False, True):
        kind, data = _encode(item, compress)
        meta, arrays = fetched = ray.get(data[0])
        sizes[compress] = sorted(a.nbytes for a in arrays)
        got = _decode(kind, data, fetched)
        assert np.array_equal(got["frames"], item["frames"]) and got["frames"].dtype == np.uint8
        assert same_bits(got["tensor_frames"], item["tensor_frames"]) and same_bits(got["f32"], item["f32"])
        assert np.array_equal(got["small"], item["small"])
    raw, packed = sizes[False], sizes[True]
    assert len(raw) == len(packed) and 400_000 in raw and 400_000 in packed  # the float tensor: not compressed
    assert sum(packed) < sum(raw) - (frames().nbytes + frames(32).nbytes) / 2  # the frames: more than 2x smaller
    got["frames"][0, 0, 0, 0] = 7  # inflated frames are writable (the last decode's: compressed)
    kind, data = _encode({"frames": frames(8)}, True)  # 96 kB of frames, small once compressed: they ride inline
    assert kind == _INLINE and np.array_equal(_decode(kind, data, None)["frames"], frames(8))


def test_frames_through_a_compressing_channel_between_workers(procs):
    c = Channel.create(f"test-z-{uuid.uuid4().hex[:8]}", compress=True)
    try:
        taken = procs[1].run.remote(lambda ch: ch.get(timeout=30), c)
        ray.get(procs[0].run.remote(lambda ch: ch.put({"obs": torch.from_numpy(frames())}), c))
        assert torch.equal(ray.get(taken, timeout=30)["obs"], torch.from_numpy(frames()))
    finally:
        c.destroy()
