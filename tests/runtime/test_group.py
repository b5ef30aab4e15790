"""Worker groups on real Ray: calls, per-rank args, rank views, device binding, errors, dead workers, gloo."""

import os
import signal
import threading
import time

import pytest
import ray
import torch

from m2flow.runtime import (
    Cluster,
    ComponentPlacement,
    Group,
    Worker,
    WorkerError,
    concurrent,
    launch_all,
    parse_placement,
    release_all,
    running,
    wait_all,
)


class Calc(Worker):
    def __init__(self, base):
        self.base = base
        self.seen_at_init = (self.component, self.rank, self.world_size, [d.index for d in self.devices])
        self.log = []
        self.stopped = threading.Event()

    def add(self, x):
        return self.base + x + self.rank

    def whoami(self):
        return self.rank

    def niceness(self):
        return os.nice(0)

    def init_seen(self):
        return self.seen_at_init

    def nap(self, seconds):
        time.sleep(seconds)
        return seconds

    def append(self, i):
        self.log.append(i)

    def get_log(self):
        return self.log

    def fail(self, message):
        raise ValueError(message)

    def fail_if(self, fail, message):
        if fail:
            raise ValueError(message)
        return message

    def traced(self, step):
        with self.span("work", step=step):
            time.sleep(0.01)

    def run_until_stopped(self, limit):
        return self.stopped.wait(limit)

    @concurrent
    def stop(self):
        self.stopped.set()

    def allreduce(self, x):
        import torch.distributed as dist

        self.init_process_group()
        t = torch.tensor([float(x)])
        dist.all_reduce(t)
        return t.item()


class Victim(Worker):
    def pid(self):
        return os.getpid()

    def block(self, seconds):
        time.sleep(seconds)
        return "woke"


class Caller(Worker):
    def ask(self, other, x):
        return other.add(x).wait()[0]


class BadInit(Worker):
    def __init__(self):
        raise RuntimeError(f"cannot start on rank {self.rank}")


@pytest.fixture(scope="module")
def calc(cluster):
    group = Calc.launch(cluster, parse_placement("calc: 0-1", cluster.num_devices)["calc"], 100)
    yield group
    release_all([group])


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_calls_return_per_rank_results_in_rank_order(calc):
    assert calc.world_size == 2 and calc.component == "calc"
    assert calc.add(1).wait(timeout=30) == [101, 102]
    assert calc.init_seen().wait() == [("calc", 0, 2, [0]), ("calc", 1, 2, [1])]


def test_workers_run_at_the_drivers_priority(calc):
    """Ray's default starts workers at nice 15: beside one busy process per core they got almost no CPU, and a run
    (or this suite) crawled for minutes per step. A local cluster starts them at nice 0."""
    assert calc.niceness().wait(timeout=30) == [os.nice(0)] * 2


def test_wall_times_are_measured_in_the_worker(calc):
    h = calc.nap(0.2)
    assert h.wait(timeout=30) == [0.2, 0.2]
    assert len(h.wall_times) == 2 and all(0.2 <= w < 2.0 for w in h.wall_times)
    assert h.done()


def test_on_ranks_and_per_rank_args(calc):
    assert calc.on(1).whoami().wait() == [1]
    assert calc.on([1, 0]).whoami().wait() == [1, 0]
    assert calc.call_per_rank("add", [(10,), (20,)]).wait() == [110, 121]
    assert calc.on([1]).call_per_rank("add", [(5,)]).wait() == [106]
    assert calc.per_rank.add([(10,), (20,)]).wait() == [110, 121]  # the same calls, the method by attribute
    assert calc.on([1]).per_rank.add([(5,)]).wait() == [106]
    assert calc.per_rank.fail_if([(False,), (False,)], message="to all").wait() == ["to all", "to all"]
    with pytest.raises(AttributeError, match="no remote method 'nope'"):
        calc.per_rank.nope
    with pytest.raises(ValueError, match="2 argument tuples for 1 rank"):
        calc.on(0).call_per_rank("add", [(1,), (2,)])
    with pytest.raises(ValueError, match="ranks must be in 0..1"):
        calc.on(2)


def test_unknown_method_is_an_attribute_error(calc):
    with pytest.raises(AttributeError, match="has no remote method 'nope'"):
        calc.nope()
    with pytest.raises(AttributeError):
        calc.device_phase("x")


def test_calls_run_in_order(calc):
    handles = [calc.append(i) for i in range(20)]
    wait_all(handles, timeout=30)
    assert calc.get_log().wait() == [list(range(20))] * 2


def test_process_is_bound_to_its_device(cluster, calc):
    for rank, info in enumerate(calc.info().wait()):
        device = cluster.device(rank)
        assert info["cores"] == list(device.cores)
        assert info["num_threads"] == len(device.cores)
        assert info["env"]["RANK"] == str(rank) and info["env"]["WORLD_SIZE"] == "2"
        assert info["env"]["LOCAL_RANK"] == str(rank) and info["env"]["M2FLOW_COMPONENT"] == "calc"
        assert info["pid"] != os.getpid()
        assert calc.process_of(rank)["pid"] == info["pid"] and calc.process_of(rank)["node_ip"] == info["node_ip"]
        assert calc.process_of(7) == {}
        assert info["env"]["MASTER_ADDR"] == calc.info().wait()[0]["node_ip"]
        # the process started with every key m2flow sets (set later, a new key reallocates libc's environ array while
        # Ray's threads read it: a worker died of SIGSEGV in getenv)
        started_with = {kv.split(b"=", 1)[0].decode() for kv in open(f"/proc/{info['pid']}/environ", "rb").read()
                        .split(b"\0") if kv}
        assert {"RANK", "WORLD_SIZE", "LOCAL_RANK", "M2FLOW_COMPONENT", "OMP_NUM_THREADS", "MASTER_ADDR",
                "MASTER_PORT"} <= started_with


def title_of(pid: int, want: str, within: float = 5.0) -> str:
    """The process's title once it is `want` (Ray retitles a process around every call; m2flow puts the role back)."""
    deadline = time.monotonic() + within
    while True:
        title = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
        if title == want or time.monotonic() > deadline:
            return title
        time.sleep(0.1)


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_worker_processes_are_titled_by_role(cluster, calc):
    """`ps` and `top` tell the workers apart: m2flow:<component>:<rank>, co-hosted ones joined."""
    for rank, info in enumerate(calc.info().wait()):
        assert title_of(info["pid"], f"m2flow:calc:{rank}") == f"m2flow:calc:{rank}"
    place = parse_placement("asker,calc: 0", cluster.num_devices, ["asker", "calc"])
    asker = Asker.launch(cluster, place["asker"])
    try:
        Keeper.launch(cluster, place["calc"], 5, host_with=asker)
        pid = asker.pid().wait()[0]
        assert title_of(pid, "m2flow:asker:0+calc:0") == "m2flow:asker:0+calc:0"
    finally:
        asker.kill()


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_ray_names_every_worker_process_by_its_role(cluster):
    """`ray list actors` tells the processes apart too: m2flow:<component>:<rank>:<id>. A released process is reused
    only by the role it was started for, so the name stays true for a later group; another role starts its own."""
    def names(group):
        group.pid().wait()
        by_id = {ray.get_actor(n)._actor_id: n for n in ray.util.list_named_actors() if n.startswith("m2flow:")}
        return [by_id[group._actors[rank]._actor_id].rsplit(":", 1)[0] for rank in group.ranks]

    first = Asker.launch(cluster, parse_placement("asker: 0-1", cluster.num_devices, ["asker"])["asker"])
    assert names(first) == ["m2flow:asker:0", "m2flow:asker:1"]
    pids = first.pid().wait()
    release_all([first])
    other = Asker.launch(cluster, parse_placement("teller: 0-1", cluster.num_devices, ["teller"])["teller"])
    again = Asker.launch(cluster, parse_placement("asker: 1", cluster.num_devices, ["asker"])["asker"])
    try:
        assert names(other) == ["m2flow:teller:0", "m2flow:teller:1"]
        assert not set(other.pid().wait()) & set(pids)  # not the asker's processes
        assert names(again) == ["m2flow:asker:0"] and again.pid().wait() == [pids[0]]  # asker rank 0's, on device 1
    finally:
        other.kill()
        again.kill()


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_at_most_max_idle_processes_are_kept_the_oldest_ended_first(cluster):
    saved = cluster.max_idle_processes, cluster._kept
    cluster.max_idle_processes, cluster._kept = 1, []  # the suite's idle processes set aside
    try:
        first = Asker.launch(cluster, parse_placement("older: 0-1", cluster.num_devices, ["older"])["older"])
        pids = first.pid().wait()
        release_all([first])  # rank 0 is kept first, so rank 1 pushes it out
        assert cluster.idle_processes == 1
        assert _gone(pids[0]) and os.path.exists(f"/proc/{pids[1]}")
    finally:
        for _, actor in cluster._kept:
            cluster.end_process(actor)
        cluster.max_idle_processes, cluster._kept = saved


def test_remote_exception_names_component_rank_and_traceback(calc):
    with pytest.raises(WorkerError) as err:
        calc.on(1).fail("bad input 42").wait(timeout=30)
    e = err.value
    assert (e.component, e.rank, e.exc_type) == ("calc", 1, "ValueError")
    text = str(e)
    assert "calc rank 1" in text and "fail() raised ValueError: bad input 42" in text
    assert "remote traceback" in text and "test_group.py" in text and "raise ValueError(message)" in text
    assert calc.whoami().wait() == [0, 1]  # the worker survives its exception


def test_concurrent_method_runs_beside_a_long_call(calc):
    running = calc.run_until_stopped(20)
    queued = calc.whoami()  # a plain method waits for the running one
    assert [i["rank"] for i in calc.info().wait(timeout=10)] == [0, 1]  # info() is @concurrent
    time.sleep(0.2)
    assert not running.done() and not queued.done()
    calc.stop().wait(timeout=10)
    assert running.wait(timeout=10) == [True, True]
    assert queued.wait(timeout=10) == [0, 1]


def test_spans_are_gathered_from_all_ranks(calc):
    calc.traced(7).wait()
    spans = [s for s in calc.spans() if s["phase"] == "work" and s["step"] == 7]
    assert sorted((s["rank"], tuple(s["devices"])) for s in spans) == [(0, (0,)), (1, (1,))]
    assert all(s["component"] == "calc" and s["end"] > s["start"] for s in spans)


def test_gloo_all_reduce_across_two_ranks(calc):
    assert calc.call_per_rank("allreduce", [(1,), (2,)]).wait(timeout=60) == [3.0, 3.0]


def test_constructor_error_fails_launch(cluster):
    with pytest.raises(WorkerError, match="bad rank 0: __init__\\(\\) raised RuntimeError: cannot start on rank 0"):
        Group.launch(BadInit, cluster, ComponentPlacement("bad", ((1,),)))


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_launch_all_builds_groups_together_and_names_a_failing_rank(cluster):
    a, b = launch_all(cluster, [(Calc, ComponentPlacement("a", ((0,),)), (10,)),
                                (Calc, ComponentPlacement("b", ((0,), (1,))), (), {"base": 20})])
    try:
        assert a.add(1).wait() == [11] and b.add(1).wait() == [21, 22]
        assert b.init_seen().wait()[1] == ("b", 1, 2, [1])
    finally:
        release_all([a, b])
    with pytest.raises(WorkerError, match="bad rank 0: __init__\\(\\) raised RuntimeError"):
        launch_all(cluster, [(Calc, ComponentPlacement("ok", ((0,),)), (1,)),
                             (BadInit, ComponentPlacement("bad", ((1,),)), ())])


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_a_group_started_early_is_built_in_the_processes_it_started(cluster):
    """Group.start asks for the processes at once; launch_all(started=...) builds the workers in them, and refuses a
    started group of another class or placement (ending it and the others)."""
    early = Group.start(Calc, cluster, ComponentPlacement("early", ((0,), (1,))))
    (group,) = launch_all(cluster, [(Calc, ComponentPlacement("early", ((0,), (1,))), (5,))], started=[early])
    try:
        assert group is early and group.add(1).wait() == [6, 7]
        assert [i["pid"] for i in group.info().wait()] == [group.process_of(r)["pid"] for r in (0, 1)]
    finally:
        release_all([group])
    other = Group.start(Calc, cluster, ComponentPlacement("other", ((0,),)))
    with pytest.raises(ValueError, match="the started group .* is not Calc on wrong's placement"):
        launch_all(cluster, [(Calc, ComponentPlacement("wrong", ((1,),)), (1,))], started=[other])
    with pytest.raises(WorkerError, match="process died"):
        other.add(1).wait(timeout=30)


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_foreground_lowers_the_other_groups_processes_for_the_block_only(cluster):
    from m2flow.runtime import foreground

    front, back = launch_all(cluster, [(Calc, ComponentPlacement("front", ((0,),)), (0,)),
                                       (Calc, ComponentPlacement("back", ((1,),)), (0,))])
    try:
        with pytest.raises(ValueError, match=r"cluster.foreground names \['middle'\], which this run does not launch"):
            with foreground(cluster, [front, back], ["middle"]):
                pass
        with foreground(cluster, [front, back], ["front"]):
            assert front.niceness().wait() == [0] and back.niceness().wait() == [19]
            assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == 19  # the driver
        assert front.niceness().wait() == [0] and back.niceness().wait() == [0]
        assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == 0
    finally:
        release_all([front, back])


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_sigkill_surfaces_as_worker_error_and_wait_all_fails_fast(cluster):
    victims = Victim.launch(cluster, ComponentPlacement("victim", ((0,), (1,))))
    try:
        pids = victims.pid().wait(timeout=30)
        blocked = victims.on(0).block(60)  # stands in for a consumer whose producer will never send
        dying = victims.on(1).block(60)
        time.sleep(0.2)
        start = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError) as err:
            wait_all([blocked, dying], timeout=60)
        assert time.monotonic() - start < 30
        assert err.value.rank == 1 and err.value.component == "victim"
        assert "process died" in str(err.value) and str(pids[1]) in str(err.value)
        assert not blocked.done()
        with pytest.raises(WorkerError, match="victim rank 1: process died"):
            victims.on(1).pid().wait(timeout=30)  # later calls fail at once too
        with pytest.raises(WorkerError):
            dying.wait()  # the same error again, no hang
    finally:
        victims.kill()
    with pytest.raises(WorkerError, match="victim rank 0: process died"):
        blocked.wait(timeout=30)


def test_a_worker_that_fails_because_a_worker_it_called_failed_names_that_one(cluster, calc):
    """A worker's call into another group fails there: the driver's error names the root cause (component, rank,
    what it raised, its traceback) and says who was waiting on it, instead of the caller's wrapped error."""
    caller = Caller.launch(cluster, ComponentPlacement("caller", ((0,),)))
    try:
        assert caller.ask(calc.on(1), 1).wait()[0] == 102
        with pytest.raises(WorkerError) as err:
            caller.ask(calc.on(1), "x").wait()
        e = err.value
        assert (e.component, e.rank, e.exc_type) == ("calc", 1, "TypeError"), str(e)
        assert e.message.startswith("add() raised TypeError") and e.message.endswith(
            "(while caller rank 0 waited on it in ask())"), e.message
        assert "in add" in e.remote_traceback
    finally:
        release_all([caller])


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_kill_returns_once_the_processes_are_dead(cluster):
    # ray.kill only asks; a call made right after Group.kill() must fail every time, never reach a live process
    for attempt in range(3):
        group = Victim.launch(cluster, ComponentPlacement("victim", ((0,), (1,))))
        assert len(set(group.pid().wait(timeout=30))) == 2
        group.kill()
        with pytest.raises(WorkerError, match="victim rank 0: process died"):
            group.pid().wait(timeout=30)
        group.kill()  # again: a no-op on dead processes


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_when_several_ranks_fail_the_error_names_the_lowest_and_counts_them(cluster, calc):
    with pytest.raises(WorkerError, match=r"^calc rank 0: fail\(\) raised ValueError: both \(2 of 2 ranks failed\)") as err:
        calc.fail("both").wait(timeout=30)
    assert err.value.rank == 0 and "ValueError: both" in err.value.remote_traceback
    with pytest.raises(WorkerError, match=r"^calc rank 1: fail_if\(\) raised ValueError: one\n") as err:
        calc.on([0, 1]).call_per_rank("fail_if", [(False, "one"), (True, "one")]).wait(timeout=30)
    assert "ranks failed" not in str(err.value)
    victims = Victim.launch(cluster, ComponentPlacement("victim", ((0,), (1,))))
    try:
        pids = victims.pid().wait(timeout=30)
        blocked = victims.block(60)
        time.sleep(0.2)
        for pid in reversed(pids):  # rank 1 dies first: Ray is likely to report it first
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match=rf"^victim rank 0: process died \(pid {pids[0]} .*\(2 of 2 ranks failed\)"):
            blocked.wait(timeout=30)
    finally:
        victims.kill()


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_wait_all_with_drain_lets_the_other_calls_end_before_it_raises(calc):
    """Writers of one checkpoint folder: when one fails, the caller removes the folder, so the others must have
    stopped writing first (`drain`). Without it the error comes at once, the other call still running."""
    for drain, still_running in ((0.0, True), (30.0, False)):
        napping = calc.on(1).nap(3)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"^calc rank 0: fail\(\) raised ValueError: disk full"):
            wait_all([calc.on(0).fail("disk full"), napping], timeout=30, drain=drain)
        took = time.monotonic() - start
        assert (not napping.done()) == still_running, (drain, took)
        assert (took < 2.5) == still_running, (drain, took)
        assert napping.wait(timeout=30) == [3]


class Asker(Worker):
    """Calls another group from inside a worker: in-process when that group is co-hosted here."""

    def pid(self):
        return os.getpid()

    def ask(self, other, x):
        h = other.on(self.rank).add(x)
        local = h._refs == [None]
        return h.wait()[0], local

    def ask_failing(self, other):
        try:
            other.on(self.rank).fail("boom").wait()
        except WorkerError as e:
            return e.component, e.rank, e.message, "ValueError: boom" in (e.remote_traceback or "")
        return None

    def share(self, other, payload):
        return other.on(self.rank).identity(payload).wait()[0] is payload


class Keeper(Calc):
    def identity(self, payload):
        return payload


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_cohosted_group_lives_in_its_hosts_processes_and_is_called_in_process(cluster):
    place = parse_placement("asker,calc: 0-1", cluster.num_devices, ["asker", "calc"])
    asker = Asker.launch(cluster, place["asker"])
    try:
        calc = Keeper.launch(cluster, place["calc"], 5, host_with=asker)
        separate = Keeper.launch(cluster, place["calc"], 7)
        assert calc.init_seen().wait() == [("calc", 0, 2, [0]), ("calc", 1, 2, [1])]
        assert calc.add(1).wait() == [6, 7]  # from the driver: through Ray, as any group
        assert [i["pid"] for i in calc.info().wait()] == asker.pid().wait()
        assert separate.info().wait()[0]["pid"] != asker.pid().wait()[0]
        # from a host worker: a function call in its process (no ref), same results as through Ray
        assert asker.ask(calc, 10).wait() == [(15, True), (16, True)]
        assert asker.ask(separate, 10).wait() == [(17, False), (18, False)]
        assert asker.share(calc, [1, 2]).wait() == [True, True]  # by reference, not copied
        assert asker.share(separate, [1, 2]).wait() == [False, False]
        # an in-process failure names the callee's component and rank, with its traceback
        assert asker.ask_failing(calc).wait() == [("calc", r, "fail() raised ValueError: boom", True) for r in (0, 1)]
        calc.traced(3).wait()
        assert {(s["component"], s["rank"]) for s in calc.spans()} == {("calc", 0), ("calc", 1)}
        assert asker.spans() == []
        with pytest.raises(ValueError, match=r"calc \(devices per rank \(\(0,\),\)\) cannot be co-hosted with all "
                                             r"of asker"):
            Keeper.launch(cluster, ComponentPlacement("calc", ((0,),)), 1, host_with=asker)
        separate.kill()
        asker.kill()  # co-hosted groups share their processes' fate
        with pytest.raises(WorkerError, match="calc rank 0: process died"):
            calc.add(1).wait(timeout=30)
    finally:
        asker.kill()


class Residue(Worker):
    """Leaves behind what a worker may: an environment variable, a process group, a used global RNG, a file it
    closes."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def dirty(self, join: bool = False):
        import torch.distributed as dist

        os.environ["M2FLOW_TEST_LEFTOVER"] = self.component
        if join:
            self.init_process_group()
        return dist.is_initialized(), torch.rand(3).tolist()

    def state(self):
        import torch.distributed as dist

        return dict(pid=os.getpid(), leftover=os.environ.get("M2FLOW_TEST_LEFTOVER"), rank=os.environ["RANK"],
                    component=os.environ["M2FLOW_COMPONENT"], cores=sorted(os.sched_getaffinity(0)),
                    threads=torch.get_num_threads(), dist=dist.is_initialized(), seed=torch.initial_seed())

    def close(self):
        open(os.path.join(self.out_dir, f"closed-{self.component}-{self.rank}"), "w").close()


def _gone(pid, timeout=30.0):
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(f"/proc/{pid}")


def test_a_released_group_leaves_clean_processes_that_the_next_group_reuses(cluster, tmp_path):
    first = Residue.launch(cluster, parse_placement("a: 0-1", cluster.num_devices, ["a"])["a"], str(tmp_path))
    fresh = first.state().wait()
    assert not any(initialized for initialized, _ in first.dirty().wait())
    idle = cluster.idle_processes
    release_all([first])
    assert cluster.idle_processes == idle + 2
    assert sorted(os.listdir(tmp_path)) == ["closed-a-0", "closed-a-1"]  # each worker's close() ran
    with pytest.raises(WorkerError, match="a rank 0: state\\(\\) raised RuntimeError: the group was released"):
        first.state().wait(timeout=30)

    # one rank over both devices: the idle process of this role (a, rank 0) takes it, re-pinned to both cores
    second = Residue.launch(cluster, parse_placement("a: 0-1:0", cluster.num_devices, ["a"])["a"], str(tmp_path))
    try:
        (got,) = second.state().wait(timeout=30)
        assert got["pid"] == fresh[0]["pid"]
        assert (got["component"], got["rank"], got["leftover"], got["dist"]) == ("a", "0", None, False)
        assert got["cores"] == sorted({c for d in cluster.devices for c in d.cores}) and got["threads"] == len(got["cores"])
        assert got["seed"] not in {s["seed"] for s in fresh}  # the global RNG got a new seed, as in a new process
        assert second.dirty(True).wait(timeout=30)[0][0]  # a process group can be made
    finally:
        release_all([second])
    # a process that joined a torch.distributed group is ended, not kept: FSDP2's device-mesh state outlives
    # destroy_process_group (a later sharded group in such processes wrote a checkpoint with half of each tensor)
    assert _gone(got["pid"]) and cluster.idle_processes == idle + 1


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_a_failed_run_kills_its_groups_and_reuse_can_be_turned_off(cluster, tmp_path):
    place = parse_placement("a: 0-1", cluster.num_devices, ["a"])["a"]
    idle = cluster.idle_processes
    with pytest.raises(WorkerError, match="boom"):
        with running([Residue.launch(cluster, place, str(tmp_path))]) as groups:
            pids = [s["pid"] for s in groups[0].state().wait(timeout=30)]
            raise WorkerError("a", 0, "boom")
    assert all(_gone(pid) for pid in pids) and not os.listdir(tmp_path)  # killed: no close(), not kept
    assert cluster.idle_processes <= idle  # it may have taken idle processes, it gave none back

    cluster.reuse_processes = False
    try:
        with running([Residue.launch(cluster, place, str(tmp_path))]) as groups:
            pids = [s["pid"] for s in groups[0].state().wait(timeout=30)]
        assert sorted(os.listdir(tmp_path)) == ["closed-a-0", "closed-a-1"]
        assert all(_gone(pid) for pid in pids) and cluster.idle_processes <= idle
    finally:
        cluster.reuse_processes = True


@pytest.mark.parametrize("sizes", [[1], [2]])
def test_cpu_devices_of_given_sizes_pin_their_ranks_to_those_cores(cluster, tmp_path, sizes):
    """`cluster.cpu_devices: [n, ...]`: each CPU device owns that many cores, from the first core on; a rank on it is
    pinned to them with as many torch threads (a 1-core rollout device beside a 3-core actor device, say)."""
    sized = Cluster(cpu_devices=sizes)  # on the Ray instance the session's cluster started
    group = Residue.launch(sized, parse_placement("a: 0", sized.num_devices, ["a"])["a"], str(tmp_path))
    try:
        assert [d.cores for d in sized.devices] == [tuple(range(sizes[0]))]
        (got,) = group.state().wait(timeout=60)
        assert got["cores"] == list(range(sizes[0])) and got["threads"] == sizes[0]
    finally:
        release_all([group])
        sized.shutdown()


def test_cpu_device_sizes_beyond_a_nodes_cores_are_refused(cluster):
    with pytest.raises(ValueError, match=r"cpu_devices \[1, 4096\] asks for 4097 cores, but a node has \d+ usable"):
        Cluster(cpu_devices=[1, 4096])
    with pytest.raises(ValueError, match="list of each device's cores"):
        Cluster(cpu_devices=[0, 1])
