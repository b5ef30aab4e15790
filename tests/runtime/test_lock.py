"""Device locks on real Ray: collocated groups take turns, disaggregated ones overlap; FIFO, re-entrant,
and a dead holder does not block the others."""

import os
import signal
import threading
import time

import pytest
import ray

from m2flow.runtime import ComponentPlacement, Worker, WorkerError, release_all, wait_all


class Turns(Worker):
    def work(self, n, seconds):
        for i in range(n):
            with self.device_phase("work", step=i):
                time.sleep(seconds)

    def nested(self):
        with self.device_phase("outer"):
            with self.device_phase("inner"):
                return True

    def hold(self, seconds):
        with self.device_phase("hold"):
            time.sleep(seconds)

    def pid(self):
        return os.getpid()


@pytest.fixture(scope="module")
def groups(cluster):
    a = Turns.launch(cluster, ComponentPlacement("a", ((0,),)))
    b = Turns.launch(cluster, ComponentPlacement("b", ((0,),)))  # shares device 0 with a
    c = Turns.launch(cluster, ComponentPlacement("c", ((1,),)))  # device 1 only
    yield a, b, c
    release_all([a, b, c])


def _work_spans(*groups):
    return sorted((s for g in groups for s in g.spans(clear=True) if s["phase"] == "work"), key=lambda s: s["start"])


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_collocated_groups_never_overlap_on_their_device(groups):
    a, b, _ = groups
    _work_spans(a, b)
    wait_all([a.work(6, 0.05), b.work(6, 0.05)], timeout=60)
    spans = _work_spans(a, b)
    assert len(spans) == 12 and all(s["devices"] == [0] and s["locked"] for s in spans)
    for prev, nxt in zip(spans, spans[1:]):
        assert prev["end"] <= nxt["start"], f"{prev} overlaps {nxt}"
    switches = sum(p["component"] != n["component"] for p, n in zip(spans, spans[1:]))
    assert switches >= 3  # FIFO: a waiting group gets the device before the holder takes it again


def test_disaggregated_groups_overlap(groups):
    a, _, c = groups
    _work_spans(a, c)
    wait_all([a.work(4, 0.2), c.work(4, 0.2)], timeout=60)
    spans = _work_spans(a, c)
    on_a = [s for s in spans if s["component"] == "a"]
    on_c = [s for s in spans if s["component"] == "c"]
    assert any(x["start"] < y["end"] and y["start"] < x["end"] for x in on_a for y in on_c)


def test_device_phase_is_reentrant(groups):
    a, b, _ = groups
    assert a.nested().wait(timeout=30) == [True]
    b.work(1, 0).wait(timeout=30)  # the nested phase released the device completely
    phases = [s["phase"] for s in a.spans(clear=True)]
    assert phases[-2:] == ["inner", "outer"]


def test_lock_api_reentrant_timeout_and_owner_check(cluster):
    lock = cluster.device_lock(1)
    assert lock.acquire("x") and lock.acquire("x")
    assert lock.holder() == "x"
    assert lock.acquire("y", timeout=0.2) is False
    lock.release("x")
    assert lock.acquire("y", timeout=0.2) is False  # still held once
    lock.release("x")
    assert lock.acquire("y", timeout=5)
    with pytest.raises(RuntimeError, match="release by 'x', which does not hold it"):
        lock.release("x")
    lock.release("y")
    assert lock.holder() is None


def test_lock_is_fifo(cluster):
    lock = cluster.device_lock(1)
    order = []

    def take(owner):
        lock.acquire(owner, timeout=30)
        order.append(owner)
        lock.release(owner)

    lock.acquire("first")
    threads = []
    for owner in ["second", "third", "fourth"]:
        threads.append(threading.Thread(target=take, args=(owner,)))
        threads[-1].start()
        time.sleep(0.3)  # queue them in this order
    lock.release("first")
    for t in threads:
        t.join(timeout=30)
    assert order == ["second", "third", "fourth"]


def test_dead_holder_releases_the_device(cluster, groups):
    a, b, _ = groups
    lock = cluster.device_lock(0)
    (pid,) = b.pid().wait(timeout=30)
    holding = b.hold(120)
    deadline = time.monotonic() + 30
    while not (lock.holder() or "").startswith("b/") and time.monotonic() < deadline:
        time.sleep(0.05)
    waiting = a.work(1, 0)
    time.sleep(0.5)
    assert not waiting.done()
    os.kill(pid, signal.SIGKILL)
    waiting.wait(timeout=15)  # a gets the device once b's process is gone
    with pytest.raises(WorkerError, match="b rank 0: process died"):
        holding.wait(timeout=15)


def test_a_process_keeps_the_device_between_its_owners_turns_until_another_process_asks(cluster, groups):
    _, _, c = groups  # c works on device 1
    lock = cluster.device_lock(1)
    server_holder = lambda: ray.get(lock._server.holder.remote(1))  # noqa: E731 - what other processes see
    c.work(1, 0).wait(timeout=10)  # c's process holds device 1 now (this one gave back what earlier tests left)
    assert lock.acquire("p/1", timeout=10)
    lock.release("p/1")
    assert lock.holder() is None and server_holder() == "p/1"  # held between turns, for this process
    assert lock.acquire("p/2", timeout=5)  # taken here, without asking the server
    assert lock.holder() == "p/2" and server_holder() == "p/1"
    waiting = c.work(1, 0)  # another process asks: it waits for p/2's turn to end, not longer
    time.sleep(0.5)
    assert not waiting.done()
    lock.release("p/2")
    waiting.wait(timeout=10)
    assert server_holder() != "p/1"  # given back to the server, so c could take it
    assert lock.acquire("p/3", timeout=10)  # and this process asks the server again, in turn
    assert server_holder() == "p/3"
    lock.release("p/3")
    c.work(1, 0).wait(timeout=10)  # an idle hold goes back at once


DROPPED_CLUSTER = '''
import gc, sys, time
from m2flow.runtime import Cluster

kept = Cluster(cpu_devices=2)                  # starts Ray
dropped = Cluster(cpu_devices=2)               # a second Cluster on the same Ray (m2flow.train without a cluster)
dropped.device_lock(0)                         # the first to reach the node's lock server creates it
lock = kept.device_lock(0)                     # the next finds it by name
del dropped
gc.collect()
time.sleep(3)                                  # Ray ends an actor whose creating handles are all gone
assert lock.acquire("b", timeout=30), "lock not acquired"
lock.release("b")
print("LOCK OK")
kept.shutdown()
'''


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_dropping_a_cluster_object_leaves_the_device_locks_working(tmp_path):
    """A Cluster made and dropped in the driver (a run without a cluster given) must not take the node's lock server
    down under the next run: it once died "because all references to the actor were removed"."""
    from own_ray import run_script

    code, out = run_script(DROPPED_CLUSTER, tmp_path, timeout=180)
    assert code == 0 and "LOCK OK" in out, out[-3000:]


class Gang(Worker):
    """A group whose ranks meet in an all-reduce inside every device phase (as FSDP2's do)."""

    def meet(self, delays):
        import torch
        import torch.distributed as dist

        time.sleep(delays[self.rank])
        with self.device_phase("meet"):
            t = torch.ones(1)
            dist.all_reduce(t)
            time.sleep(0.2)
            return float(t)


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_two_groups_meeting_in_collectives_on_the_same_devices_take_turns_as_groups(cluster):
    # Entries ordered to close the cycle that per-rank locks allow: x0 takes device 0, y1 device 1, then x1 waits for
    # device 1 and y0 for device 0, while x0 and y1 wait in their all-reduces for x1 and y0. As groups: x holds both
    # devices from x0's entry, y1 waits for device 0, x1 joins x (same group) and y follows once x is done.
    # Then both ranks of x queue behind another tenant of device 0: when it lets go, the lock goes to both at once.
    x = Gang.launch(cluster, ComponentPlacement("x", ((0,), (1,))))
    y = Gang.launch(cluster, ComponentPlacement("y", ((0,), (1,))))
    z = Turns.launch(cluster, ComponentPlacement("z", ((0,),)))
    try:
        # Joined first: gloo's rendezvous takes a varying time under load, which once let y's entries come first.
        wait_all([x.init_process_group("gloo"), y.init_process_group("gloo")], timeout=60)
        calls = [x.meet({0: 0.0, 1: 1.5}), y.meet({0: 2.0, 1: 0.5})]
        assert wait_all(calls, timeout=60) == [[2.0, 2.0], [2.0, 2.0]]
        spans = [s for g in (x, y) for s in g.spans(clear=True) if s["phase"] == "meet"]
        on = {c: (min(s["start"] for s in spans if s["component"] == c),
                  max(s["end"] for s in spans if s["component"] == c)) for c in "xy"}
        first, then = sorted(on, key=lambda c: on[c][0])  # x's, unless a loaded machine delayed its calls by 0.5 s
        assert on[first][1] <= on[then][0], f"the groups overlapped on the devices: {on}"

        holding = z.hold(1.5)
        time.sleep(0.5)
        assert x.meet({0: 0.0, 1: 0.3}).wait(timeout=30) == [2.0, 2.0]
        holding.wait(timeout=10)
    finally:
        release_all([x, y, z])
