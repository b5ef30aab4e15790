"""Device locks: one per device, so that components sharing a device take turns (fair FIFO, re-entrant per owner).

Two levels. Across processes: one small async Ray actor per node, pinned to that node so it can tell when a
holder's process has died (the lock is then passed on, so nothing hangs). Within a process: a lease. The owners in
one process queue in that process (FIFO, no Ray call); the process takes the node's lock for them and keeps it
between their turns until another process asks for it, then gives it back as soon as its current owner is done.
So a device whose tenants all live in one process (co-hosted groups) costs no round trip per phase, and tenants in
different processes still take turns in FIFO order. A group whose ranks meet in collectives (torch.distributed)
takes every device of the group, in index order, under one id shared by its ranks (`acquire_for_group`): holding only
its own device, each rank of two such groups on the same devices could wait in a collective for a peer that waits for
a device the other group holds. It moves no state; `offload.py` does that.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections import deque

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .deadline import deadline_of, seconds_left, wait

__all__ = ["DeviceLock"]

_CHECK_S = 0.25  # how often a lock with waiters checks that its holder is still alive


@functools.cache
def _identity(pid: int) -> tuple[int, float]:
    """(pid, its start time): how the lock server tells this process from a later one with the same pid. Keyed by
    the pid, so a forked child gets its own."""
    return pid, psutil.Process(pid).create_time()


def _alive(pid: int, create_time: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - create_time) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class _Lock:
    def __init__(self):
        self.holder: tuple | None = None  # (owner_id, pid, create_time)
        self.count = 0
        self.waiters: deque = deque()  # (owner_id, pid, create_time, future)
        self.changed = asyncio.Event()  # set (and replaced) when a waiter queues or the holder changes

    def notify(self):
        self.changed.set()
        self.changed = asyncio.Event()

    def pass_on(self):
        """Give the lock to the oldest live waiter, and to every other waiter under the same owner id (the ranks of
        a group, `acquire_for_group`, which meet in a collective once they hold it), or free it."""
        self.holder, self.count = None, 0
        self.notify()
        while self.waiters:
            owner, pid, ctime, fut = self.waiters.popleft()
            if fut.done() or not _alive(pid, ctime):
                continue
            self.holder, self.count = (owner, pid, ctime), 1
            fut.set_result(True)
            for waiter in [w for w in self.waiters if w[0] == owner]:
                self.waiters.remove(waiter)
                if not waiter[3].done():
                    self.count += 1
                    waiter[3].set_result(True)
            return


@ray.remote(num_cpus=0)
class _LockServer:
    """All device locks of one node (an asyncio actor: waiting costs no thread)."""

    def __init__(self):
        self.locks: dict[int, _Lock] = {}
        self.watcher = None

    async def _watch(self):
        """While anyone waits, pass a dead holder's lock on. Ends when no one waits (a task left pending at Ray's
        shutdown would be reported as destroyed)."""
        while any(lock.waiters for lock in self.locks.values()):
            await asyncio.sleep(_CHECK_S)
            for lock in self.locks.values():
                if lock.holder and lock.waiters and not _alive(*lock.holder[1:]):
                    lock.pass_on()
        self.watcher = None

    async def acquire(self, index: int, owner: str, pid: int, ctime: float, timeout: float | None) -> bool:
        lock = self.locks.setdefault(index, _Lock())
        if lock.holder and lock.holder[0] == owner:
            lock.count += 1
            return True
        if lock.holder and not _alive(*lock.holder[1:]):
            lock.pass_on()
        if lock.holder is None and not lock.waiters:
            lock.holder, lock.count = (owner, pid, ctime), 1
            lock.notify()
            return True
        fut = asyncio.get_running_loop().create_future()
        lock.waiters.append((owner, pid, ctime, fut))
        lock.notify()  # a holding process's lease watcher learns that someone waits
        if self.watcher is None:
            self.watcher = asyncio.ensure_future(self._watch())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            if fut.done():  # granted in the same instant as the timeout
                return True
            fut.cancel()  # pass_on skips it
            return False

    async def release(self, index: int, owner: str) -> bool:
        lock = self.locks.get(index)
        if lock is None or lock.holder is None or lock.holder[0] != owner:
            return False
        lock.count -= 1
        if lock.count == 0:
            lock.pass_on()
        return True

    async def holder(self, index: int) -> str | None:
        lock = self.locks.get(index)
        return lock.holder[0] if lock and lock.holder else None

    async def wait_contended(self, index: int, owner: str, timeout: float) -> bool:
        """True once `owner` holds the lock and someone waits for it; False if `owner` stops holding it or after
        `timeout` seconds."""
        lock = self.locks.setdefault(index, _Lock())
        deadline = time.monotonic() + timeout
        while lock.holder and lock.holder[0] == owner:
            if any(not w[3].done() for w in lock.waiters):
                return True
            try:
                await asyncio.wait_for(lock.changed.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return False
        return False


class _Lease:
    """This process's side of one device lock. Owners in this process queue here (FIFO, re-entrant per owner); the
    first to find the process without the node's lock takes it from the server under its own owner id (the
    process's token) and the process keeps it after that owner is done: the next owner here needs no Ray call. A
    watcher thread waits on the server for another process to queue; the lock then goes back to the server as soon
    as no owner here holds it, and the owners here queue at the server like everyone else."""

    def __init__(self, server, index: int):
        self.server, self.index = server, index
        self.cond = threading.Condition()
        self.owner: str | None = None  # the owner in this process holding the device now
        self.count = 0
        self.queue: deque = deque()  # owners of this process waiting, oldest first
        self.held = False  # this process holds the server's lock
        self.token: str | None = None  # the owner id the server knows this process's hold by
        self.hold = 0  # counts the holds this process took from the server
        self.revoked = False  # another process waits: give the server's lock back once no owner here holds it
        self.busy = False  # a thread is talking to the server for this process (taking or giving back the lock)
        self.watching = False

    def acquire(self, owner: str, timeout: float | None) -> bool:
        deadline = deadline_of(timeout)
        with self.cond:
            if self.owner == owner:
                self.count += 1
                return True
            self.queue.append(owner)
            while not (self.queue[0] == owner and self.owner is None and not self.busy):
                if not wait(self.cond, deadline):
                    self._leave(owner)
                    return False
            if self.held and not self.revoked:
                return self._take(owner)
            self.busy = True  # not held (a revoked hold is always given back before busy clears): ask the server
        left = seconds_left(deadline)
        try:
            ok = ray.get(self.server.acquire.remote(self.index, owner, *_identity(os.getpid()), left))
        except BaseException:
            with self.cond:
                self.busy = False
                self._leave(owner)
            raise
        with self.cond:
            self.busy = False
            if not ok:
                self._leave(owner)
                return False
            self.held, self.token, self.revoked, self.hold = True, owner, False, self.hold + 1
            if not self.watching:
                self.watching = True
                threading.Thread(target=self._watch, daemon=True, name=f"m2flow-lease-{self.index}").start()
            return self._take(owner)

    def release(self, owner: str) -> None:
        with self.cond:
            if self.owner != owner:
                raise RuntimeError(f"device {self.index} lock: release by {owner!r}, which does not hold it")
            self.count -= 1
            if self.count:
                return
            self.owner = None
            give_back = self.held and self.revoked
            if give_back:
                self.held, self.busy = False, True
            self.cond.notify_all()
        if give_back:
            self._give_back()

    def holder_here(self) -> tuple[bool, str | None]:
        """(this process holds the device, the owner here holding it or None when it is held between turns)."""
        with self.cond:
            return self.held or self.owner is not None, self.owner

    def _take(self, owner: str) -> bool:
        self.queue.popleft()
        self.owner, self.count = owner, 1
        return True

    def _leave(self, owner: str) -> None:
        self.queue.remove(owner)
        self.cond.notify_all()

    def _give_back(self) -> None:
        """Return the server's lock (called with busy set and held cleared)."""
        try:
            ray.get(self.server.release.remote(self.index, self.token))
        finally:
            with self.cond:
                self.busy = False
                self.cond.notify_all()

    def _watch(self) -> None:
        """While this process holds the server's lock: when another process queues for it, give it back now if no
        owner here holds it, else mark it to go back at that owner's release (and wait for that)."""
        while True:
            with self.cond:
                if not self.held:
                    self.watching = False
                    return
                token, hold = self.token, self.hold
            try:
                contended = ray.get(self.server.wait_contended.remote(self.index, token, 30.0))
            except Exception:  # noqa: BLE001 - Ray shut down or the server is gone: nothing left to give back
                with self.cond:
                    self.watching = False
                return
            if not contended:
                continue
            with self.cond:
                if not self.held or self.hold != hold:
                    continue
                if self.owner is not None:  # (while held, busy is never set)
                    self.revoked = True
                    while self.held and self.hold == hold:
                        self.cond.wait()
                    continue
                self.held, self.busy = False, True
            self._give_back()


_LEASES: dict[tuple[str, int], _Lease] = {}  # (lock server actor id, device index) -> this process's lease
_LEASES_LOCK = threading.Lock()


_SERVERS: dict[str, object] = {}  # node id -> the node's lock server, as this process first reached it
_SERVERS_LOCK = threading.Lock()


def _server_of(node_id: str):
    """The lock server of `node_id`, created on first use. The handle is kept for the life of the process: Ray ends
    an actor (not detached) once its creator drops every handle, and one Cluster object made and dropped (a run
    without a cluster given) would otherwise take the node's locks down under the next. A node id is new with every
    Ray start, so a handle of an earlier Ray instance is never reused."""
    with _SERVERS_LOCK:
        if node_id not in _SERVERS:
            _SERVERS[node_id] = _LockServer.options(
                name=f"m2flow/device_locks/{node_id}", namespace="m2flow", get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), max_concurrency=1000,
            ).remote()
        return _SERVERS[node_id]


class DeviceLock:
    """The lock of device `index`. Picklable; every copy talks to the same named actor
    (`m2flow/device_locks/{node_id}` in namespace `m2flow`), so pass it to workers as an argument.

    The caller's process (pid) is recorded as the holder's, so acquire from the process that does the work. Every
    copy in one process shares that process's lease (see the module docstring).
    """

    def __init__(self, index: int, node_id: str | None = None):
        self.index = index
        self._server = _server_of(node_id or ray.get_runtime_context().get_node_id())

    @property
    def _lease(self) -> _Lease:
        key = (self._server._actor_id.hex(), self.index)
        with _LEASES_LOCK:
            if key not in _LEASES:
                _LEASES[key] = _Lease(self._server, self.index)
            return _LEASES[key]

    def acquire(self, owner_id: str, timeout: float | None = None) -> bool:
        """Block until `owner_id` holds the lock (True) or `timeout` seconds pass (False). Re-entrant per owner."""
        return self._lease.acquire(owner_id, timeout)

    def release(self, owner_id: str) -> None:
        self._lease.release(owner_id)

    def acquire_for_group(self, group_id: str, timeout: float | None = None) -> bool:
        """Block until the group `group_id` holds the lock (True) or `timeout` seconds pass (False), asking the node's
        server directly (no lease). Every rank of a group that meets in collectives takes its group's devices under
        one id: the lock is re-entrant across their processes, so the group holds all of them or waits as one, and
        two such groups on the same devices cannot each hold a part while their ranks wait in a collective."""
        return ray.get(self._server.acquire.remote(self.index, group_id, *_identity(os.getpid()), timeout))

    def release_for_group(self, group_id: str) -> None:
        if not ray.get(self._server.release.remote(self.index, group_id)):
            raise RuntimeError(f"device {self.index} lock: release by group {group_id!r}, which does not hold it")

    def holder(self) -> str | None:
        """The owner id holding the lock now, or None. Asked from the holding process, that is the owner in it (None
        between its owners' turns); from another process, the owner that took the device for its process."""
        held_here, owner = self._lease.holder_here()
        return owner if held_here else ray.get(self._server.holder.remote(self.index))

    def __repr__(self):
        return f"DeviceLock({self.index})"
