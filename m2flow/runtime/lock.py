"""Device locks: one per device, so that components sharing a device take turns (fair FIFO, re-entrant per owner).

Backed by one small async Ray actor per node, pinned to that node so it can tell when a holder's process has
died (the lock is then passed on, so nothing hangs). It moves no state; `offload.py` does that.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

__all__ = ["DeviceLock"]

_CHECK_S = 0.25  # how often a lock with waiters checks that its holder is still alive


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

    def pass_on(self):
        """Give the lock to the oldest live waiter, or free it."""
        self.holder, self.count = None, 0
        while self.waiters:
            owner, pid, ctime, fut = self.waiters.popleft()
            if fut.done() or not _alive(pid, ctime):
                continue
            self.holder, self.count = (owner, pid, ctime), 1
            fut.set_result(True)
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
            return True
        fut = asyncio.get_running_loop().create_future()
        lock.waiters.append((owner, pid, ctime, fut))
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


class DeviceLock:
    """The lock of device `index`. Picklable; every copy talks to the same named actor
    (`m2flow/device_locks/{node_id}` in namespace `m2flow`), so pass it to workers as an argument.

    The caller's process (pid) is recorded as the holder's, so acquire from the process that does the work.
    """

    def __init__(self, index: int, node_id: str | None = None):
        self.index = index
        node_id = node_id or ray.get_runtime_context().get_node_id()
        self._server = _LockServer.options(
            name=f"m2flow/device_locks/{node_id}", namespace="m2flow", get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), max_concurrency=1000,
        ).remote()

    def acquire(self, owner_id: str, timeout: float | None = None) -> bool:
        """Block until `owner_id` holds the lock (True) or `timeout` seconds pass (False). Re-entrant per owner."""
        pid = os.getpid()
        ctime = psutil.Process(pid).create_time()
        return ray.get(self._server.acquire.remote(self.index, owner_id, pid, ctime, timeout))

    def release(self, owner_id: str) -> None:
        if not ray.get(self._server.release.remote(self.index, owner_id)):
            raise RuntimeError(f"device {self.index} lock: release by {owner_id!r}, which does not hold it")

    def holder(self) -> str | None:
        """The owner id holding the lock now, or None."""
        return ray.get(self._server.holder.remote(self.index))

    def __repr__(self):
        return f"DeviceLock({self.index})"
