"""Channel: a named FIFO between processes (the driver and Ray actors): keyed sub-queues, weights, backpressure,
timeouts, async variants. Knows nothing about RL; no torch.distributed or CUDA IPC: a GPU tensor that leaves its
process travels through host memory and arrives as a CPU tensor (the receiver moves it to its own device).

One async Ray actor per channel holds the queues once two processes use it, but only small messages. Where an
item travels depends on its ends:
- one process (while no other process has put, got or asked anything): the queues live in that process, `get`
  returns the very same object, and no call leaves the process (its first use asks the actor once whether it is
  the only user). Once another process uses the channel, the queued items are handed over to the actor, in order,
  before any other call of either process is served.
- two or more processes, same node or not: an item whose pickle is over INLINE_MAX goes through the Ray object store
  (shared memory on a node; Ray moves it between nodes) and the actor holds its ObjectRef. CPU tensors anywhere
  in an item are pickled as raw bytes out of band, so `ray.put` is the only copy and the consumer's tensors are
  views of shared memory (read-only by contract: clone before writing in place). Smaller items ride inline.
Ownership: an object-store item is owned by the process that put it (Ray >= 2.56 removed `ray.put(_owner=)`);
if that process exits before the item is taken, `get` raises ChannelItemLost once Ray has freed it.
Inline items survive their producer. A channel created with `compress=True` (for ends on different nodes) pickles
uint8 arrays and tensors of 16 KiB and more (frames) compressed (runtime/compression.py).
"""

from __future__ import annotations

import asyncio
import io
import os
import pickle
import sys
import threading
import warnings
from collections import defaultdict, deque

import numpy as np
import ray
import ray.cloudpickle as cloudpickle
from ray.exceptions import ObjectLostError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import compression
from .deadline import deadline_of, seconds_left, wait

__all__ = ["Channel", "ChannelClosed", "ChannelItemLost", "ChannelTimeout"]

NAMESPACE = "m2flow_channels"  # the Ray namespace of channel actors, so any job process can connect by name
INLINE_MAX = 64 * 1024  # bytes; larger items go through the object store

# message kinds; a message is (weight, kind, data)
_INLINE, _STORE, _RAY, _BROKEN = range(4)


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
    """cloudpickle that turns dense CPU and CUDA tensors into byte arrays (CUDA ones copied to host memory first), so
    protocol 5 ships them out of band; they arrive as CPU tensors. With `compress`, uint8 arrays and tensors of at
    least compression.MIN_BYTES (frames) travel compressed and arrive inflated (writable)."""

    def __init__(self, *args, compress: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.compress = compress
        self._views: set[int] = set()  # ids of the byte views made of other dtypes' tensors: not frames

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")  # no torch imported here: no tensors to care about
        tensor = torch is not None and type(obj) is torch.Tensor and _plain(obj, torch)
        if self.compress and (tensor or type(obj) is np.ndarray) and id(obj) not in self._views \
                and compression.compressible(obj):
            array = obj.detach().contiguous().cpu().numpy() if tensor else np.ascontiguousarray(obj)
            packed = compression.compress(array)
            return _inflated, (pickle.PickleBuffer(packed.data), tuple(array.shape), tensor)
        if tensor:
            flat = obj.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).cpu()
            dtype = str(obj.dtype).removeprefix("torch.")
            raw = flat.view(torch.uint8).numpy()
            self._views.add(id(raw))  # alive while pickled: the reduction holds it
            return _tensor_from_bytes, (raw, dtype, tuple(obj.shape), obj.requires_grad)
        if isinstance(obj, (ray.ObjectRef, ray.actor.ActorHandle)):
            raise _NeedsRay
        return super().reducer_override(obj)


def _plain(t, torch) -> bool:
    return t.device.type in ("cpu", "cuda") and t.layout == torch.strided and not (t.is_quantized or t.is_nested)


def _tensor_from_bytes(data: np.ndarray, dtype: str, shape: tuple, requires_grad: bool):
    import torch

    with warnings.catch_warnings():  # arrays from the object store are read-only shared memory
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(data)
    t = t.view(getattr(torch, dtype)).reshape(shape)
    return t.requires_grad_() if requires_grad else t


def _inflated(data, shape: tuple, tensor: bool):
    """A compressed uint8 array or tensor, inflated (writable)."""
    array = compression.unpack(data, np.uint8, shape)
    if tensor:
        import torch

        return torch.from_numpy(array)
    return array


def _encode(item, compress: bool = False) -> tuple:
    """item -> (kind, data) of a message: inline bytes, or an object-store ref in a list (so Ray leaves it alone);
    `compress`: its frames compressed (`_Pickler`)."""
    buffers = []
    f = io.BytesIO()
    try:
        _Pickler(f, protocol=5, buffer_callback=buffers.append, compress=compress).dump(item)
    except _NeedsRay:
        return _RAY, [ray.put((item,))]  # a tuple: ray.put refuses a bare ObjectRef
    meta, arrays = f.getvalue(), [np.frombuffer(b.raw(), np.uint8) for b in buffers]
    if len(meta) + sum(a.nbytes for a in arrays) <= INLINE_MAX:
        return _INLINE, (meta, [a.tobytes() for a in arrays])
    return _STORE, [ray.put((meta, arrays))]


def _encode_or_broken(item, compress: bool = False) -> tuple:
    try:
        return _encode(item, compress)
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
    """This process's side of one channel. `mode`: None until this process first uses it; "local" while this process
    is its only user (the queues live here: key -> deque of (weight, item)); "remote" once it is not."""

    def __init__(self):
        self.mode: str | None = None
        self.cond = threading.Condition()
        self.queues: dict = defaultdict(deque)
        self.closed = False
        self.gone = False  # the actor died or was destroyed
        self.compress = False  # the channel's: frames compressed when its items leave this process

    def put(self, key, items, weights, maxsize: int, deadline) -> tuple[str, int]:
        """Append in order, each waiting for room (held: self.cond). (status, number appended); status "remote":
        the channel went to the actor meanwhile, the rest goes there."""
        q = self.queues[key]
        for n, (item, weight) in enumerate(zip(items, weights)):
            while not (self.mode != "local" or self.gone or self.closed or not maxsize or len(q) < maxsize):
                if not wait(self.cond, deadline):
                    return "timeout", n
            if self.mode != "local" or self.gone or self.closed:
                return ("remote" if self.mode != "local" else "gone" if self.gone else "closed"), n
            q.append((weight, item))
            self.cond.notify_all()
        return "ok", len(items)

    def get(self, key, target, deadline) -> tuple[str, list]:
        """As the actor's get (held: self.cond), waiting until the whole answer is there, so that nothing is taken
        before it returns."""
        q = self.queues[key]

        def count() -> int:  # items that answer the get now (0: wait)
            if target is None:
                return min(len(q), 1)
            if target == "all":
                return len(q)
            total = 0.0
            for i, (weight, _) in enumerate(q):
                total += weight
                if total >= target:
                    return i + 1
            return len(q) if self.closed else 0  # a closed channel's last batch may be short

        while True:
            if self.mode != "local":
                return "remote", []
            if n := count():
                taken = [q.popleft()[1] for _ in range(n)]
                self.cond.notify_all()
                return "ok", taken
            if self.gone:
                return "gone", []
            if self.closed:
                return "closed", []
            if not wait(self.cond, deadline):
                return "timeout", []


_LOCALS: dict[str, _Local] = {}  # channel actor id -> this process's side
_LOCALS_LOCK = threading.Lock()


def _proc() -> str:
    return ray.get_runtime_context().get_worker_id()


def _hand_over(actor, loc: _Local) -> None:
    """Another process uses the channel now: move the queued items to the actor. Holds loc.cond throughout, so that
    no call of this process reaches the actor before them."""
    with loc.cond:
        if loc.mode != "local":
            return
        loc.mode = "remote"
        payload = {key: [(weight, *_encode_or_broken(item, loc.compress)) for weight, item in q]
                   for key, q in loc.queues.items() if q}
        loc.queues.clear()
        try:
            ray.get(actor.hand_over.remote(payload, loc.closed))
        except Exception:  # noqa: BLE001 - the actor is gone: every call will say so
            loc.gone = True
        loc.cond.notify_all()


def _watch(actor, loc: _Local, key: str) -> None:
    """Daemon thread of the process that serves a channel locally: hand it over once another process uses it; when
    the actor dies, wake this process's waiters."""
    try:
        while not ray.get(actor.wait_shared.remote(60.0)):
            pass
    except Exception:  # noqa: BLE001 - destroyed, or Ray shut down
        with loc.cond:
            loc.gone = True
            loc.cond.notify_all()
        with _LOCALS_LOCK:
            if _LOCALS.get(key) is loc:
                del _LOCALS[key]
        return
    _hand_over(actor, loc)


# ------------------------------------------------------------------------------------ the actor


def _actor_class():
    """The channel's actor class. Defined in a function so that Ray ships it by value: it uses only the
    standard library, and its process never imports m2flow (whose package pulls in torch: seconds per channel)."""
    import asyncio
    import time
    from collections import defaultdict, deque

    def deadline_of(timeout):
        return None if timeout is None else time.monotonic() + timeout

    class ChannelActor:
        """Holds the keyed queues of one channel once two processes use it. Messages are small: inline bytes or
        [ObjectRef]. Until then one process (`owner`) may serve it locally; the actor only counts its users."""

        def __init__(self, name: str, maxsize: int):
            self.name, self.maxsize = name, maxsize
            self.queues: dict = defaultdict(deque)
            self.closed = False
            self.procs: set[str] = set()
            self.owner: str | None = None  # the process that serves the channel locally while it is the only user
            self.owner_pid: tuple | None = None  # (node id, pid) of the owner, to notice that it died
            self.shared = False  # True once two processes used the channel
            self.awaiting = False  # shared, and the owner's queued items have not arrived yet
            self.cond = asyncio.Condition()  # one condition for every change; waiters re-check their predicate

        def _saw(self, proc: str) -> None:
            self.procs.add(proc)
            if len(self.procs) > 1 and not self.shared:
                self.shared = True
                self.awaiting = self.owner is not None
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

        async def _handed_over(self, deadline) -> bool:
            """Wait (holding self.cond) for the owner's queued items, noticing an owner that died on this node."""
            import psutil
            import ray

            here = ray.get_runtime_context().get_node_id()
            while self.awaiting:
                step = 0.25 if deadline is None else min(0.25, deadline - time.monotonic())
                if step <= 0:
                    return False
                await self._wait(lambda: not self.awaiting, time.monotonic() + step)
                if self.awaiting and self.owner_pid and self.owner_pid[0] == here \
                        and not psutil.pid_exists(self.owner_pid[1]):
                    self.awaiting = False  # its items died with it
            return True

        async def claim(self, proc: str, node: str, pid: int) -> bool:
            """Whether proc is the channel's only user so far; it then serves the channel locally."""
            async with self.cond:
                self._saw(proc)
                if self.shared:
                    return False
                self.owner, self.owner_pid = proc, (node, pid)
                return True

        async def put(self, key, msgs: list, timeout, proc: str):
            """Append msgs in order, each waiting for room. Returns (status, number appended)."""
            deadline = deadline_of(timeout)
            async with self.cond:
                self._saw(proc)
                if not await self._handed_over(deadline):
                    return "timeout", 0
                q = self.queues[key]
                for n, msg in enumerate(msgs):
                    if not await self._wait(lambda: self.closed or not self.maxsize or len(q) < self.maxsize, deadline):
                        return "timeout", n
                    if self.closed:
                        return "closed", n
                    q.append(msg)
                    self.cond.notify_all()
            return "ok", len(msgs)

        async def get(self, key, target, timeout, proc: str):
            """One message (target None), messages until their weights sum to >= target, or (target "all") every
            message queued now, at least one. Returns (status, msgs)."""
            deadline = deadline_of(timeout)
            async with self.cond:
                self._saw(proc)
                if not await self._handed_over(deadline):
                    return "timeout", []
                q, taken, total = self.queues[key], [], 0.0
                while True:
                    await self._wait(lambda: bool(q) or self.closed, deadline)
                    if q:
                        msg = q.popleft()
                        taken.append(msg)
                        total += msg[0]
                        self.cond.notify_all()
                        if target is None or (total >= target if target != "all" else not q):
                            return "ok", taken
                    elif self.closed:
                        return ("ok", taken) if taken else ("closed", [])
                    else:  # timed out: a partial batch goes back to the front, in order
                        q.extendleft(reversed(taken))
                        self.cond.notify_all()
                        return "timeout", []

        async def hand_over(self, payload: dict, closed: bool) -> None:
            """The owner's queued items (key -> messages, oldest first), ahead of anything put since."""
            async with self.cond:
                for key, msgs in payload.items():
                    self.queues[key].extendleft(reversed(msgs))
                self.closed = self.closed or closed
                self.shared, self.awaiting = True, False
                self.cond.notify_all()

        async def wait_shared(self, timeout: float) -> bool:
            async with self.cond:
                return await self._wait(lambda: self.shared, deadline_of(timeout))

        async def close(self, proc: str) -> None:
            async with self.cond:
                self._saw(proc)  # another process closing: the owner's gets must come here to learn it
                self.closed = True
                self.cond.notify_all()

        async def qsize(self, key, proc: str) -> int:
            async with self.cond:
                self._saw(proc)
                await self._handed_over(None)
                return len(self.queues.get(key, ()))

        async def get_maxsize(self) -> int:
            return self.maxsize

    return ray.remote(num_cpus=0, max_concurrency=100_000)(ChannelActor)


_ChannelActor = _actor_class()


# ---------------------------------------------------------------------------------------- Channel


class Channel:
    """A named FIFO with keyed sub-queues. Small and picklable: pass it to Ray actors as an argument. It knows how
    many ranks put into it (`producers`) and take from it (`consumers`), so that a stream over it (runtime/stream.py)
    ends after the right number of END markers without the stage calls carrying those counts."""

    def __init__(self, name: str, actor, maxsize: int, producers: int = 1, consumers: int = 1,
                 compress: bool = False):
        """Use Channel.create or Channel.connect."""
        self.name, self.maxsize, self._actor = name, maxsize, actor
        self.producers, self.consumers, self.compress = producers, consumers, compress
        self._key = actor._actor_id.hex()
        with _LOCALS_LOCK:
            self._loc = _LOCALS.setdefault(self._key, _Local())
        self._loc.compress = compress

    @classmethod
    def create(cls, name: str, maxsize: int = 0, producers: int = 1, consumers: int = 1,
               compress: bool = False) -> Channel:
        """A new channel; maxsize (0 = unbounded) bounds each keyed sub-queue; `producers` and `consumers` are the
        ranks that put into it and take from it; `compress`: uint8 arrays and tensors of at least 16 KiB (frames)
        leave a process compressed (runtime/compression.py; for channels between nodes). It lives as long as this
        process."""
        if not name or maxsize < 0 or producers < 1 or consumers < 1:
            raise ValueError(f"channel {name!r}: needs a name, maxsize >= 0 and at least one producer and consumer "
                             f"(got maxsize={maxsize}, producers={producers}, consumers={consumers})")
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        try:
            actor = _ChannelActor.options(
                name=name, namespace=NAMESPACE, scheduling_strategy=here
            ).remote(name, maxsize)
        except ValueError as e:
            raise ValueError(f"channel {name!r} already exists: use Channel.connect({name!r})") from e
        return cls(name, actor, maxsize, producers, consumers, compress)

    @classmethod
    def connect(cls, name: str, producers: int = 1, consumers: int = 1, compress: bool = False) -> Channel:
        """The existing channel called name, from any process of the job (with the counts and compression given
        here)."""
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError as e:
            raise ValueError(f"no channel named {name!r} (create it with Channel.create)") from e
        return cls(name, actor, ray.get(actor.get_maxsize.remote()), producers, consumers, compress)

    def __reduce__(self):
        return Channel, (self.name, self._actor, self.maxsize, self.producers, self.consumers, self.compress)

    def __repr__(self) -> str:
        return (f"Channel({self.name!r}, maxsize={self.maxsize}, producers={self.producers}, "
                f"consumers={self.consumers})")

    # ----- put

    def put(self, item, key=None, weight: float = 1.0, timeout: float | None = None) -> None:
        """Append item to the key's sub-queue; blocks while it holds maxsize items."""
        self.put_many([item], key, [weight], timeout)

    def put_many(self, items, key=None, weights=None, timeout: float | None = None) -> None:
        """Append items in order (one round trip, none while this process is the only user). On timeout, the items
        before the one that timed out are in."""
        items, weights = self._items(items, weights)
        deadline = deadline_of(timeout)
        n = 0
        if self._serves_locally():
            with self._loc.cond:
                status, n = self._loc.put(key, items, weights, self.maxsize, deadline)
            if status != "remote":
                return self._put_done(status, n, key, timeout)
        if n < len(items):
            msgs = [(w, *_encode(item, self.compress)) for item, w in zip(items[n:], weights[n:])]
            status, m = self._wait(self._actor.put.remote(key, msgs, seconds_left(deadline), _proc()))
            self._put_done(status, n + m, key, timeout)

    async def put_async(self, item, key=None, weight: float = 1.0, timeout: float | None = None) -> None:
        await self.put_many_async([item], key, [weight], timeout)

    async def put_many_async(self, items, key=None, weights=None, timeout: float | None = None) -> None:
        items, weights = self._items(items, weights)
        self._go_remote()
        msgs = [(w, *_encode(item, self.compress)) for item, w in zip(items, weights)]
        status, n = await self._await(self._actor.put.remote(key, msgs, timeout, _proc()))
        self._put_done(status, n, key, timeout)

    # ----- get

    def get(self, key=None, timeout: float | None = None):
        """The oldest item of the key's sub-queue; waits for one."""
        return self._get(key, None, timeout)[0]

    def get_batch(self, target_weight: float, key=None, timeout: float | None = None) -> list:
        """Items in FIFO order until their weights sum to >= target_weight (a closed channel's last may be short)."""
        self._check_target(target_weight)
        return self._get(key, target_weight, timeout)

    def get_all(self, key=None, timeout: float | None = None) -> list:
        """Everything queued in the key's sub-queue, in FIFO order, in one round trip; waits for at least one item.
        For a consumer that has the sub-queue to itself (consumers sharing it would each take the others' share)."""
        return self._get(key, "all", timeout)

    async def get_async(self, key=None, timeout: float | None = None):
        return (await self._get_async(key, None, timeout))[0]

    async def get_batch_async(self, target_weight: float, key=None, timeout: float | None = None) -> list:
        self._check_target(target_weight)
        return await self._get_async(key, target_weight, timeout)

    # ----- the rest

    def qsize(self, key=None) -> int:
        if self._serves_locally():
            with self._loc.cond:
                if self._loc.mode == "local":
                    return len(self._loc.queues.get(key, ()))
        return self._wait(self._actor.qsize.remote(key, _proc()))

    def close(self) -> None:
        """No more puts; gets drain what is queued, then raise ChannelClosed."""
        with self._loc.cond:
            self._loc.closed = True
            self._loc.cond.notify_all()
        self._wait(self._actor.close.remote(_proc()))

    def destroy(self) -> None:
        """Kill the channel's actor: queued items are dropped, and every end's calls raise ChannelClosed."""
        ray.kill(self._actor, no_restart=True)
        with self._loc.cond:
            self._loc.gone = True
            self._loc.cond.notify_all()
        with _LOCALS_LOCK:
            _LOCALS.pop(self._key, None)

    # ----- helpers

    def _serves_locally(self) -> bool:
        """Whether this process serves the channel (its first use asks the actor whether it is the only user)."""
        loc = self._loc
        with loc.cond:
            if loc.mode is None:
                ctx = ray.get_runtime_context()
                mine = self._wait(self._actor.claim.remote(_proc(), ctx.get_node_id(), os.getpid()))
                loc.mode = "local" if mine else "remote"
                if mine:
                    threading.Thread(target=_watch, args=(self._actor, loc, self._key), daemon=True,
                                     name=f"m2flow-channel-{self.name}").start()
            return loc.mode == "local"

    def _go_remote(self) -> None:
        """Async calls always go to the actor: hand over first if this process served the channel locally."""
        loc = self._loc
        with loc.cond:
            if loc.mode is None:
                loc.mode = "remote"
        if loc.mode == "local":
            _hand_over(self._actor, loc)

    def _get(self, key, target, timeout) -> list:
        deadline = deadline_of(timeout)
        if self._serves_locally():
            with self._loc.cond:
                status, items = self._loc.get(key, target, deadline)
            if status != "remote":
                return self._got(status, items, key, timeout)
        msgs = self._got(*self._wait(self._actor.get.remote(key, target, seconds_left(deadline), _proc())), key, timeout)
        return self._items_of(msgs, self._fetch(msgs, key))

    async def _get_async(self, key, target, timeout) -> list:
        self._go_remote()
        msgs = self._got(*await self._await(self._actor.get.remote(key, target, timeout, _proc())), key, timeout)
        return self._items_of(msgs, await self._fetch_async(msgs, key))

    def _items(self, items, weights):
        items = list(items)
        weights = [1.0] * len(items) if weights is None else [float(w) for w in weights]
        if len(weights) != len(items):
            raise ValueError(f"channel {self.name!r}: {len(items)} items but {len(weights)} weights")
        return items, weights

    def _put_done(self, status, n, key, timeout) -> None:
        if status == "ok":
            return
        if status == "timeout":
            raise ChannelTimeout(
                f"channel {self.name!r} key {key!r}: put timed out after {timeout}s "
                f"(sub-queue full at maxsize={self.maxsize}; {n} of the items went in)"
            )
        if status == "gone":
            raise self._gone()
        raise ChannelClosed(f"channel {self.name!r} key {key!r}: put on a closed channel")

    def _got(self, status, msgs, key, timeout) -> list:
        if status == "timeout":
            raise ChannelTimeout(f"channel {self.name!r} key {key!r}: get timed out after {timeout}s")
        if status == "closed":
            raise ChannelClosed(f"channel {self.name!r} key {key!r} is closed and drained")
        if status == "gone":
            raise self._gone()
        return msgs

    def _gone(self) -> ChannelClosed:
        return ChannelClosed(f"channel {self.name!r} is gone: its actor died or was destroyed")

    def _check_target(self, target_weight):
        if not target_weight > 0:
            raise ValueError(f"channel {self.name!r}: target_weight must be > 0, got {target_weight}")

    def _fetch(self, msgs, key) -> list:
        refs = [data[0] for _, kind, data in msgs if kind in (_STORE, _RAY)]
        try:
            return ray.get(refs) if refs else []
        except ObjectLostError as e:  # OwnerDiedError included
            raise self._lost(key) from e

    async def _fetch_async(self, msgs, key) -> list:
        refs = [data[0] for _, kind, data in msgs if kind in (_STORE, _RAY)]
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
        for _, kind, data in msgs:
            if kind == _BROKEN:
                raise RuntimeError(f"channel {self.name!r}: an item queued in its producer's process could not be "
                                   f"handed over to another process: {data}")
            out.append(_decode(kind, data, next(fetched) if kind != _INLINE else None))
        return out

    def _wait(self, ref):
        try:
            return ray.get(ref)
        except RayActorError as e:
            raise self._gone() from e

    async def _await(self, ref):
        try:
            return await ref
        except RayActorError as e:
            raise self._gone() from e
