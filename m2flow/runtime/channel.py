"""Channel: a named FIFO between processes (the driver and Ray actors): keyed sub-queues, weights, backpressure,
timeouts, async variants. Knows nothing about RL; no torch.distributed or CUDA IPC (GPU tensors go as Ray pickles them).

One async Ray actor per channel holds the queues, but only small messages. Where an item travels depends on its ends:
- same process (while no other process has used the channel): by reference. The item stays in this process's
  table, the actor holds a token, and `get` returns the very same object. Once another process uses the channel
  (the Channel object is pickled out, or someone connects), pending items are handed over to the actor.
- another process, same node or not: an item whose pickle is over INLINE_MAX goes through the Ray object store
  (shared memory on a node; Ray moves it between nodes) and the actor holds its ObjectRef. CPU tensors anywhere
  in an item are pickled as raw bytes out of band, so `ray.put` is the only copy and the consumer's tensors are
  views of shared memory (read-only by contract: clone before writing in place). Smaller items ride inline.
Ownership: an object-store item is owned by the process that put it (Ray >= 2.56 removed `ray.put(_owner=)`);
if that process exits before the item is taken, `get` raises ChannelItemLost once Ray has freed it.
Inline items survive their producer.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import pickle
import sys
import threading
import warnings

import numpy as np
import ray
import ray.cloudpickle as cloudpickle
from ray.exceptions import ObjectLostError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

__all__ = ["Channel", "ChannelClosed", "ChannelItemLost", "ChannelTimeout"]

NAMESPACE = "m2flow_channels"  # the Ray namespace of channel actors, so any job process can connect by name
INLINE_MAX = 64 * 1024  # bytes; larger items go through the object store

# message kinds; a message is (weight, kind, data, owner)
_INLINE, _STORE, _RAY, _LOCAL, _BROKEN = range(5)


class ChannelTimeout(TimeoutError):
    """A put or get waited longer than its timeout."""


class ChannelClosed(RuntimeError):
    """The channel is closed (and drained, for gets) or its actor is gone."""


class ChannelItemLost(RuntimeError):
    """An item's data left with its producer: the process that put it exited before it was taken."""


# ---------------------------------------------------------------------------------------- encoding


class _NeedsRay(Exception):
    """The item holds Ray handles or refs: let Ray serialize it, so their reference counts stay right."""


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle that turns dense CPU tensors into byte arrays, so protocol 5 ships them out of band."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")  # no torch imported here: no tensors to care about
        if torch is not None and type(obj) is torch.Tensor and _plain_cpu(obj, torch):
            flat = obj.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
            dtype = str(obj.dtype).removeprefix("torch.")
            return _tensor_from_bytes, (flat.view(torch.uint8).numpy(), dtype, tuple(obj.shape), obj.requires_grad)
        if isinstance(obj, (ray.ObjectRef, ray.actor.ActorHandle)):
            raise _NeedsRay
        return super().reducer_override(obj)


def _plain_cpu(t, torch) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and not (t.is_quantized or t.is_nested)


def _tensor_from_bytes(data: np.ndarray, dtype: str, shape: tuple, requires_grad: bool):
    import torch

    with warnings.catch_warnings():  # arrays from the object store are read-only shared memory
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(data)
    t = t.view(getattr(torch, dtype)).reshape(shape)
    return t.requires_grad_() if requires_grad else t


def _encode(item) -> tuple:
    """item -> (kind, data) of a message: inline bytes, or an object-store ref in a list (so Ray leaves it alone)."""
    buffers = []
    f = io.BytesIO()
    try:
        _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(item)
    except _NeedsRay:
        return _RAY, [ray.put((item,))]  # a tuple: ray.put refuses a bare ObjectRef
    meta, arrays = f.getvalue(), [np.frombuffer(b.raw(), np.uint8) for b in buffers]
    if len(meta) + sum(a.nbytes for a in arrays) <= INLINE_MAX:
        return _INLINE, (meta, [a.tobytes() for a in arrays])
    return _STORE, [ray.put((meta, arrays))]


def _encode_or_broken(item) -> tuple:
    try:
        return _encode(item)
    except Exception as e:  # noqa: BLE001 - reported to whoever takes the item
        return _BROKEN, f"{type(e).__name__}: {e}"


def _decode(kind, data, fetched):
    if kind == _INLINE:
        meta, buffers = data
        return pickle.loads(meta, buffers=[bytearray(b) for b in buffers])  # bytearray: writable tensors
    if kind == _STORE:
        meta, arrays = fetched
        return pickle.loads(meta, buffers=arrays)
    return fetched[0]  # _RAY


# ------------------------------------------------------------------------------ this process's side


class _Local:
    """This process's side of one channel: may another process use it yet, and the items put here by reference."""

    def __init__(self, shared: bool):
        self.shared = shared
        self.items: dict[int, object] = {}
        self.lock = threading.Lock()
        self.watching = False


_LOCALS: dict[str, _Local] = {}  # channel actor id -> this process's side
_tokens = itertools.count()


def _proc() -> str:
    return ray.get_runtime_context().get_worker_id()


def _hand_over(actor, loc: _Local) -> None:
    """Another process uses the channel now: move this process's by-reference items into the actor."""
    with loc.lock:
        loc.shared = True
        pending = dict(loc.items)
    if pending:
        payloads = {token: _encode_or_broken(item) for token, item in pending.items()}
        for token in ray.get(actor.hand_over.remote(_proc(), payloads)):
            loc.items.pop(token, None)


def _watch(actor, loc: _Local) -> None:
    """Daemon thread in a process that put items by reference: hand them over once another process shows up."""
    try:
        while not loc.shared and not ray.get(actor.wait_shared.remote(60.0)):
            pass
        _hand_over(actor, loc)
    except Exception:  # noqa: BLE001 - the channel was destroyed or Ray shut down: nothing to hand over
        pass


# ------------------------------------------------------------------------------------ the actor


def _actor_class():
    """The channel's actor class. Defined in a function so that Ray ships it by value: it uses only the
    standard library, and its process never imports m2flow (whose package pulls in torch: seconds per channel)."""
    import asyncio
    import time
    from collections import defaultdict, deque

    local_kind = _LOCAL

    def deadline_of(timeout):
        return None if timeout is None else time.monotonic() + timeout

    class ChannelActor:
        """Holds the keyed queues of one channel. Messages are small: inline bytes, [ObjectRef], or a token."""

        def __init__(self, name: str, maxsize: int):
            self.name, self.maxsize = name, maxsize
            self.queues: dict = defaultdict(deque)
            self.closed = False
            self.procs: set[str] = set()
            self.shared = False  # True once two processes used the channel: no more by-reference items
            self.cond = asyncio.Condition()  # one condition for every change; waiters re-check their predicate

        def _saw(self, proc: str) -> None:
            self.procs.add(proc)
            if len(self.procs) > 1 and not self.shared:
                self.shared = True
                self.cond.notify_all()

        async def _wait(self, ready, deadline) -> bool:
            """Wait (holding self.cond) until ready() or the deadline; return ready()."""
            if deadline is None:
                await self.cond.wait_for(ready)
            else:
                try:
                    await asyncio.wait_for(self.cond.wait_for(ready), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    pass
            return ready()

        async def put(self, key, msgs: list, timeout, proc: str, by_ref: bool):
            """Append msgs in order, each waiting for room. Returns (status, number appended)."""
            deadline = deadline_of(timeout)
            async with self.cond:
                self._saw(proc)
                q = self.queues[key]
                for n, msg in enumerate(msgs):
                    if not await self._wait(lambda: self.closed or not self.maxsize or len(q) < self.maxsize, deadline):
                        return "timeout", n
                    if self.closed:
                        return "closed", n
                    if by_ref and self.shared:
                        return "shared", n
                    q.append(msg)
                    self.cond.notify_all()
            return "ok", len(msgs)

        async def get(self, key, target, timeout, proc: str):
            """One message (target None), messages until their weights sum to >= target, or (target "all") every
            message takeable now, at least one. Returns (status, msgs)."""
            deadline = deadline_of(timeout)
            async with self.cond:
                self._saw(proc)
                q, taken, total = self.queues[key], [], 0.0

                def takeable():  # another process's by-reference item waits for its hand-over
                    return bool(q) and (q[0][1] != local_kind or q[0][3] == proc)

                while True:
                    await self._wait(lambda: takeable() or (self.closed and not q), deadline)
                    if takeable():
                        msg = q.popleft()
                        taken.append(msg)
                        total += msg[0]
                        self.cond.notify_all()
                        if target is None or (total >= target if target != "all" else not takeable()):
                            return "ok", taken
                    elif self.closed and not q:
                        return ("ok", taken) if taken else ("closed", [])
                    else:  # timed out: a partial batch goes back to the front, in order
                        q.extendleft(reversed(taken))
                        self.cond.notify_all()
                        return "timeout", []

        async def hand_over(self, proc: str, payloads: dict) -> list:
            """Replace proc's by-reference tokens with encoded items; returns the tokens replaced."""
            async with self.cond:
                self.shared = True
                replaced = []
                for q in self.queues.values():
                    for i, (weight, kind, data, owner) in enumerate(q):
                        if kind == local_kind and owner == proc and data in payloads:
                            q[i] = (weight, *payloads[data], None)
                            replaced.append(data)
                self.cond.notify_all()
                return replaced

        async def wait_shared(self, timeout: float) -> bool:
            async with self.cond:
                return await self._wait(lambda: self.shared, deadline_of(timeout))

        async def close(self) -> None:
            async with self.cond:
                self.closed = True
                self.cond.notify_all()

        async def qsize(self, key) -> int:
            return len(self.queues.get(key, ()))

        async def get_maxsize(self) -> int:
            return self.maxsize

    return ray.remote(num_cpus=0, max_concurrency=100_000)(ChannelActor)


_ChannelActor = _actor_class()


# ---------------------------------------------------------------------------------------- Channel


class Channel:
    """A named FIFO with keyed sub-queues. Small and picklable: pass it to Ray actors as an argument."""

    def __init__(self, name: str, actor, maxsize: int, shared: bool):
        """Use Channel.create or Channel.connect."""
        self.name, self.maxsize, self._actor = name, maxsize, actor
        self._loc = _LOCALS.setdefault(actor._actor_id.hex(), _Local(shared))

    @classmethod
    def create(cls, name: str, maxsize: int = 0) -> Channel:
        """A new channel; maxsize (0 = unbounded) bounds each keyed sub-queue. It lives as long as this process."""
        if not name or maxsize < 0:
            raise ValueError(f"channel {name!r}: needs a name and maxsize >= 0 (got maxsize={maxsize})")
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        try:
            actor = _ChannelActor.options(
                name=name, namespace=NAMESPACE, scheduling_strategy=here
            ).remote(name, maxsize)
        except ValueError as e:
            raise ValueError(f"channel {name!r} already exists: use Channel.connect({name!r})") from e
        return cls(name, actor, maxsize, shared=False)

    @classmethod
    def connect(cls, name: str) -> Channel:
        """The existing channel called name, from any process of the job."""
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError as e:
            raise ValueError(f"no channel named {name!r} (create it with Channel.create)") from e
        return cls(name, actor, ray.get(actor.get_maxsize.remote()), shared=True)

    def __reduce__(self):
        self._share()
        return Channel, (self.name, self._actor, self.maxsize, True)

    def __repr__(self) -> str:
        return f"Channel({self.name!r}, maxsize={self.maxsize})"

    # ----- put

    def put(self, item, key=None, weight: float = 1.0, timeout: float | None = None) -> None:
        """Append item to the key's sub-queue; blocks while it holds maxsize items."""
        self.put_many([item], key, [weight], timeout)

    def put_many(self, items, key=None, weights=None, timeout: float | None = None) -> None:
        """Append items in order (one round trip). On timeout, the items before the one that timed out are in."""
        items, weights = self._items(items, weights)
        start = 0 if items else None
        while start is not None:
            msgs, by_ref = self._messages(items[start:], weights[start:])
            result = self._wait(self._actor.put.remote(key, msgs, timeout, _proc(), by_ref))
            start = self._put_done(result, msgs, start, key, timeout)

    async def put_async(self, item, key=None, weight: float = 1.0, timeout: float | None = None) -> None:
        await self.put_many_async([item], key, [weight], timeout)

    async def put_many_async(self, items, key=None, weights=None, timeout: float | None = None) -> None:
        items, weights = self._items(items, weights)
        start = 0 if items else None
        while start is not None:
            msgs, by_ref = self._messages(items[start:], weights[start:])
            result = await self._await(self._actor.put.remote(key, msgs, timeout, _proc(), by_ref))
            start = self._put_done(result, msgs, start, key, timeout)

    # ----- get

    def get(self, key=None, timeout: float | None = None):
        """The oldest item of the key's sub-queue; waits for one."""
        msgs = self._got(self._wait(self._actor.get.remote(key, None, timeout, _proc())), key, timeout)
        return self._items_of(msgs, self._fetch(msgs, key))[0]

    def get_batch(self, target_weight: float, key=None, timeout: float | None = None) -> list:
        """Items in FIFO order until their weights sum to >= target_weight (a closed channel's last may be short)."""
        self._check_target(target_weight)
        msgs = self._got(self._wait(self._actor.get.remote(key, target_weight, timeout, _proc())), key, timeout)
        return self._items_of(msgs, self._fetch(msgs, key))

    def get_all(self, key=None, timeout: float | None = None) -> list:
        """Everything queued in the key's sub-queue, in FIFO order, in one round trip; waits for at least one item.
        For a consumer that has the sub-queue to itself (consumers sharing it would each take the others' share)."""
        msgs = self._got(self._wait(self._actor.get.remote(key, "all", timeout, _proc())), key, timeout)
        return self._items_of(msgs, self._fetch(msgs, key))

    async def get_async(self, key=None, timeout: float | None = None):
        msgs = self._got(await self._await(self._actor.get.remote(key, None, timeout, _proc())), key, timeout)
        return self._items_of(msgs, await self._fetch_async(msgs, key))[0]

    async def get_batch_async(self, target_weight: float, key=None, timeout: float | None = None) -> list:
        self._check_target(target_weight)
        msgs = self._got(await self._await(self._actor.get.remote(key, target_weight, timeout, _proc())), key, timeout)
        return self._items_of(msgs, await self._fetch_async(msgs, key))

    # ----- the rest

    def qsize(self, key=None) -> int:
        return self._wait(self._actor.qsize.remote(key))

    def close(self) -> None:
        """No more puts; gets drain what is queued, then raise ChannelClosed."""
        self._wait(self._actor.close.remote())

    def destroy(self) -> None:
        """Kill the channel's actor: queued items are dropped, and every end's calls raise ChannelClosed."""
        ray.kill(self._actor, no_restart=True)
        _LOCALS.pop(self._actor._actor_id.hex(), None)

    # ----- helpers

    def _share(self) -> None:
        """This Channel object leaves the process: items put here by reference move to the actor."""
        loc = self._loc
        with loc.lock:
            if loc.shared:
                return
            loc.shared = True
            pending = bool(loc.items)
        if pending:  # not inline: this runs inside Ray's serialization of the call that carries the channel
            threading.Thread(target=_hand_over, args=(self._actor, loc), daemon=True).start()

    def _items(self, items, weights):
        items = list(items)
        weights = [1.0] * len(items) if weights is None else [float(w) for w in weights]
        if len(weights) != len(items):
            raise ValueError(f"channel {self.name!r}: {len(items)} items but {len(weights)} weights")
        return items, weights

    def _messages(self, items, weights) -> tuple[list, bool]:
        """Messages for items: tokens while no other process uses the channel, else encoded items."""
        loc = self._loc
        with loc.lock:
            by_ref = not loc.shared
            if by_ref:
                proc, msgs = _proc(), []
                for item, weight in zip(items, weights):
                    token = next(_tokens)
                    loc.items[token] = item
                    msgs.append((weight, _LOCAL, token, proc))
                start_watch, loc.watching = not loc.watching, True
        if by_ref:
            if start_watch:
                threading.Thread(target=_watch, args=(self._actor, loc), daemon=True).start()
            return msgs, True
        return [(weight, *_encode(item), None) for item, weight in zip(items, weights)], False

    def _put_done(self, result, msgs, start, key, timeout):
        """None when every item is in; the index to resend from when by-reference puts were refused."""
        status, n = result
        for _, kind, token, _ in msgs[n:]:  # tokens of items the actor did not take
            if kind == _LOCAL:
                self._loc.items.pop(token, None)
        if status == "ok":
            return None
        if status == "shared":
            self._loc.shared = True
            return start + n
        if status == "timeout":
            raise ChannelTimeout(
                f"channel {self.name!r} key {key!r}: put timed out after {timeout}s "
                f"(sub-queue full at maxsize={self.maxsize}; {start + n} of the items went in)"
            )
        raise ChannelClosed(f"channel {self.name!r} key {key!r}: put on a closed channel")

    def _got(self, result, key, timeout) -> list:
        status, msgs = result
        if status == "timeout":
            raise ChannelTimeout(f"channel {self.name!r} key {key!r}: get timed out after {timeout}s")
        if status == "closed":
            raise ChannelClosed(f"channel {self.name!r} key {key!r} is closed and drained")
        return msgs

    def _check_target(self, target_weight):
        if not target_weight > 0:
            raise ValueError(f"channel {self.name!r}: target_weight must be > 0, got {target_weight}")

    def _fetch(self, msgs, key) -> list:
        refs = [data[0] for _, kind, data, _ in msgs if kind in (_STORE, _RAY)]
        try:
            return ray.get(refs) if refs else []
        except ObjectLostError as e:  # OwnerDiedError included
            raise self._lost(key) from e

    async def _fetch_async(self, msgs, key) -> list:
        refs = [data[0] for _, kind, data, _ in msgs if kind in (_STORE, _RAY)]
        try:
            return list(await asyncio.gather(*refs)) if refs else []
        except ObjectLostError as e:
            raise self._lost(key) from e

    def _lost(self, key) -> ChannelItemLost:
        return ChannelItemLost(
            f"channel {self.name!r} key {key!r}: an item's data is gone; the process that put it exited "
            f"before it was taken (items over {INLINE_MAX} bytes live in the object store, owned by their producer)"
        )

    def _items_of(self, msgs, fetched) -> list:
        fetched, out = iter(fetched), []
        for _, kind, data, _ in msgs:
            if kind == _LOCAL:
                out.append(self._loc.items.pop(data))
            elif kind == _BROKEN:
                raise RuntimeError(f"channel {self.name!r}: an item put by reference could not reach here: {data}")
            else:
                out.append(_decode(kind, data, next(fetched) if kind != _INLINE else None))
        return out

    def _wait(self, ref):
        try:
            return ray.get(ref)
        except RayActorError as e:
            raise ChannelClosed(f"channel {self.name!r} is gone: its actor died or was destroyed") from e

    async def _await(self, ref):
        try:
            return await ref
        except RayActorError as e:
            raise ChannelClosed(f"channel {self.name!r} is gone: its actor died or was destroyed") from e
