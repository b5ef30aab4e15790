"""Priority: while a run goes, the processes of some components (the foreground) get the CPU first.

On a node with fewer cores than busy threads, Linux shares the cores fairly among every runnable thread: the driver,
Ray's daemons, the channel and lock actors and the other components' workers all take slices from the one whose speed
sets the run's (e.g. SAC's learner). Under `foreground(...)`, every other process of the run on the driver's node runs
at nice 19 (`BACKGROUND_NICE`): the other workers, the driver, and, when this run's Cluster started Ray, Ray's processes
(the driver's descendants), but not the foreground's own child processes (a worker's helpers). They still run, on what
the foreground leaves. Nothing is raised above its priority, so it needs no privilege. Linux keeps a nice value per
thread, so every thread is set, and again every few seconds for the threads started since. On leaving, each changed
process gets its old value back; where the OS refuses (an unprivileged user cannot lower a nice value), a worker process
is not kept for reuse, and the driver stays at its low priority. Processes on other nodes are left as they are.

It decides nothing about placement and launches nothing (`group.py` does).
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from typing import Sequence

import ray

from .cluster import Cluster
from .group import Group

__all__ = ["foreground", "BACKGROUND_NICE", "process_nice"]

BACKGROUND_NICE = 19
REAPPLY_S = 5.0  # how often threads started since get the background priority too
log = logging.getLogger(__name__)


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # gone
        return []


def process_nice(pid: int) -> int | None:
    """The nice value of a process's main thread; None when it is gone."""
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        return None


def _descendants(root: int) -> set[int]:
    """Every live process under `root` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state"
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _set_threads(pid: int, nice: int) -> bool:
    """Set every thread of `pid` to `nice`; False when the OS refused (permission)."""
    for tid in _threads(pid):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except PermissionError:
            return False
        except OSError:  # a thread that just exited
            pass
    return True


def _local_pids(groups: Sequence[Group], here: str) -> dict[int, list]:
    """pid -> [(group, rank)] of every rank of `groups` whose process runs on this node (node ip `here`)."""
    out: dict[int, list] = {}
    for g in groups:
        for rank in range(g.world_size):
            where = g.process_of(rank)
            if where.get("node_ip") == here and "pid" in where:
                out.setdefault(where["pid"], []).append((g, rank))
    return out


@contextmanager
def foreground(cluster: Cluster, groups: Sequence[Group], components: Sequence[str], reapply_s: float = REAPPLY_S):
    """`with foreground(cluster, groups, ["actor"]):` the named components' processes keep their priority while every
    other process of the run on this node runs at nice 19 (see the module doc); a process that hosts a named
    component and others (co-hosted) is in the foreground. No components: nothing changes."""
    components = list(components)
    if not components:
        yield
        return
    unknown = sorted(set(components) - {g.component for g in groups})
    if unknown:
        raise ValueError(f"cluster.foreground names {unknown}, which this run does not launch (its components: "
                         f"{sorted(g.component for g in groups)})")
    here = ray.util.get_node_ip_address()
    ranks = _local_pids(groups, here)
    front = {pid for pid, hosted in ranks.items() if any(g.component in components for g, _ in hosted)}
    driver = os.getpid()
    old: dict[int, int] = {}  # pid -> its nice value before (of its main thread)

    def lower() -> None:
        pids = {driver} | set(ranks) | (_descendants(driver) if cluster.started_ray else set())
        keep = front.union(*(_descendants(pid) for pid in front))  # with the foreground workers' own child processes
        for pid in sorted(pids - keep, key=lambda p: p == driver):  # the driver last (so it is lowered once all are)
            nice = process_nice(pid) if pid not in old else old[pid]
            if nice is None or nice >= BACKGROUND_NICE:
                continue
            old[pid] = nice
            _set_threads(pid, BACKGROUND_NICE)

    stop = threading.Event()

    def keep_low() -> None:
        while not stop.wait(reapply_s):
            lower()

    lower()
    thread = threading.Thread(target=keep_low, daemon=True, name="m2flow-priority")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        for pid in sorted(old, key=lambda p: p != driver):  # the driver first (so it is restored before any other)
            nice = old[pid]
            if _set_threads(pid, nice):
                continue
            for g, rank in ranks.get(pid, []):  # not to host the next run at this priority
                cluster.not_for_reuse(g._actors[rank])
            if pid == driver:
                log.warning("cluster.foreground: the OS refused to give the driver process back its priority "
                            "(nice %d); it stays at nice %d until it exits", nice, BACKGROUND_NICE)
