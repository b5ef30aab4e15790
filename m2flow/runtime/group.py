"""Workers and groups: one Ray actor per rank, bound to its devices by environment; a group call runs a method on
every rank and returns a Handle, whose errors name the component, the rank and the remote traceback.

A group can also be co-hosted (`host_with=`): its ranks live in another group's processes, rank r beside that
group's rank r on the same devices. A call from a worker to a co-hosted worker in its own process is then a plain
function call in the caller's thread (no Ray hop; arguments are passed by reference, not copied); every other call
goes through Ray as usual. Co-hosted groups share their processes' fate: killing one kills both.

A group ends in one of two ways. `kill()` ends its processes (after a failure, or to stop it mid-call).
`release_all(groups)`, after a run that went well, ends only its workers: each worker's `close()` runs, and a process
left with no worker goes back to its Cluster idle, to host the next group launched on its node (`Cluster`'s
`reuse_processes`). It is reset first: a clean environment, a new torch seed, no process group, no compiled code.

It does not choose placements (`placement.py`) and moves no data between groups (`channel.py`).
"""

from __future__ import annotations

import copy
import os
import socket
import tempfile
import threading
import time
import traceback
import uuid
from contextlib import contextmanager, nullcontext
from typing import Iterable, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .cluster import Cluster, Device
from .lock import DeviceLock
from .offload import offloadable_bytes, offload_state, onload_state
from .placement import ComponentPlacement
from .tracer import Tracer

__all__ = ["WorkerError", "Worker", "Group", "Handle", "wait_all", "launch_all", "release_all", "running",
           "gather_spans", "concurrent"]

_DEPTH_LOCK = threading.Lock()
_HOSTED: dict[tuple[str, int], "Worker"] = {}  # in a worker process: its workers by (group uid, rank)


class WorkerError(RuntimeError):
    """A worker call failed (remote exception) or its process died; names component, rank and remote traceback."""

    def __init__(self, component: str, rank: int, message: str, remote_traceback: str | None = None,
                 exc_type: str | None = None):
        self.component, self.rank, self.message = component, rank, message
        self.remote_traceback, self.exc_type = remote_traceback, exc_type
        text = f"{component} rank {rank}: {message}"
        if remote_traceback:
            text += f"\n--- remote traceback ({component} rank {rank}) ---\n{remote_traceback.rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        return WorkerError, (self.component, self.rank, self.message, self.remote_traceback, self.exc_type)


def concurrent(method):
    """Mark a Worker method to run alongside the others (e.g. `stop`, `status`) instead of one at a time."""
    method._m2flow_concurrent = True
    return method


class Worker:
    """Subclass this; its public methods become callable on every rank through a Group.

    Before the subclass's `__init__` runs, these are set: `component`, `rank`, `world_size`, `devices`
    (list[Device]), `run_dir`; the process has RANK, WORLD_SIZE, LOCAL_RANK, M2FLOW_COMPONENT (and
    CUDA_VISIBLE_DEVICES on GPUs) in its environment, and on CPU devices it is pinned to the devices' cores
    with `torch.set_num_threads(len(cores))`. Methods run one at a time, in call order, unless marked
    `@concurrent`. A Worker made directly (`MyWorker()`) is a plain local object: rank 0 of 1, no devices.
    """

    component: str = "local"
    rank: int = 0
    world_size: int = 1
    devices: list[Device] = []
    run_dir: str | None = None
    context_switch: bool = False  # device_phase onloads state on entry, offloads it on exit (collocated turns)
    _m2flow_locks: list[DeviceLock] = []
    _m2flow_group_locks: list[DeviceLock] = []  # every device of the group on this rank's node, by index
    _m2flow_group_id: str = ""

    @classmethod
    def launch(cls, cluster: Cluster, placement: ComponentPlacement, *args, **kwargs) -> "Group":
        """`Group.launch(cls, cluster, placement, *args, **kwargs)`."""
        return Group.launch(cls, cluster, placement, *args, **kwargs)

    @property
    def tracer(self) -> Tracer:
        if "_m2flow_tracer" not in self.__dict__:
            self._m2flow_tracer = Tracer(self.component, self.rank, [d.index for d in self.devices])
        return self._m2flow_tracer

    @property
    def _owner(self) -> str:
        return f"{self.component}/{self.rank}@{os.getpid()}"

    @contextmanager
    def device_phase(self, phase: str, step: int | None = None):
        """Hold the locks of all this rank's devices (sorted order, re-entrant) while the block runs; trace it.
        A rank that joined a torch.distributed group of several ranks (`init_process_group`) holds every device of
        its group instead, as the group (see `lock.py`): its phases wait in collectives for the other ranks.
        With `context_switch` on, the outermost phase also onloads the registered state and offloads it after."""
        taken, start = [], time.time()
        if self.__dict__.get("_m2flow_collective", False):
            locks, owner = self._m2flow_group_locks, self._m2flow_group_id
            take, give = DeviceLock.acquire_for_group, DeviceLock.release_for_group
        else:
            locks, owner, take, give = self._m2flow_locks, self._owner, DeviceLock.acquire, DeviceLock.release
        try:
            for lock in locks:
                take(lock, owner)
                taken.append(lock)
            with self.tracer.span(phase, step, locked=True, wait=time.time() - start):
                with _DEPTH_LOCK:  # phases in flight in this worker (nested, or from @concurrent methods)
                    depth = self._m2flow_depth = self.__dict__.get("_m2flow_depth", 0) + 1
                try:
                    if depth == 1 and self.context_switch:
                        self.onload()
                    yield
                finally:
                    with _DEPTH_LOCK:
                        self._m2flow_depth -= 1
                        last = self._m2flow_depth == 0
                    if last and self.context_switch:
                        self.offload()
        finally:
            for lock in reversed(taken):
                give(lock, owner)

    def set_context_switch(self, enabled: bool = True) -> None:
        """Turn on (or off) onload-on-entry / offload-on-exit around each outermost `device_phase`."""
        self.context_switch = enabled

    def holding(self, phase: str, step: int | None = None):
        """A `device_phase` where context switching is on (work that reads the registered state, e.g. publishing
        weights or a checkpoint, needs it on the device), else nothing: the state is resident anyway."""
        return self.device_phase(phase, step) if self.context_switch else nullcontext()

    def state_bytes(self) -> int:
        """Bytes of the state `offload()` moves (registered modules and optimizers, gradients included) that are on
        the device now (0 while offloaded)."""
        return offloadable_bytes(self.__dict__.get("_m2flow_offloadables", {}))

    def span(self, phase: str, step: int | None = None):
        """Trace the block as a span (takes no lock)."""
        return self.tracer.span(phase, step)

    def close(self) -> None:
        """Called when the group is released (`release_all`) and the process lives on for other workers: free what
        outlives this object otherwise (subprocesses, open files). The default does nothing."""

    def init_process_group(self, backend: str | None = None) -> None:
        """Join torch.distributed among this group's ranks (gloo on CPU, nccl on GPU; MASTER_ADDR/PORT are set)."""
        import datetime

        import torch.distributed as dist

        if dist.is_initialized():
            return
        gpu = bool(self.devices) and self.devices[0].kind == "gpu"
        dist.init_process_group(backend or ("nccl" if gpu else "gloo"), init_method="env://", rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(minutes=10))
        self._m2flow_collective = self.world_size > 1  # device_phase now locks as the group

    def register_offloadable(self, name: str, obj) -> None:
        """Have `offload()` / `onload()` move this nn.Module or Optimizer."""
        self.__dict__.setdefault("_m2flow_offloadables", {})[name] = obj

    def offload(self) -> None:
        """Move the registered state off the device (CPU devices: to disk, freeing RAM). No-op if already off."""
        if self.__dict__.get("_m2flow_offloaded"):
            return
        with self.span("offload"):
            offload_state(self.__dict__.get("_m2flow_offloadables", {}), self._device_kind, self._offload_dir)
        self._m2flow_offloaded = True

    def onload(self) -> None:
        """Bring the registered state back, bit-identical. No-op if it is not offloaded."""
        if not self.__dict__.get("_m2flow_offloaded"):
            return
        with self.span("onload"):
            onload_state(self.__dict__.get("_m2flow_offloadables", {}), self._device_kind, self._offload_dir)
        self._m2flow_offloaded = False

    @property
    def _device_kind(self) -> str:
        return self.devices[0].kind if self.devices else "cpu"

    @property
    def torch_device(self):
        """The torch device this rank computes on: on GPU devices its first GPU (`cuda:0`, as CUDA_VISIBLE_DEVICES
        lists only this rank's GPUs), else the CPU. Workers place their models here, move what they compute on in,
        and hand on CPU tensors (channels and the object store carry host memory)."""
        import torch

        return torch.device("cuda", 0) if self._device_kind == "gpu" else torch.device("cpu")

    def device_memory_gb(self) -> float | None:
        """The most memory this rank's GPU has held for this process's tensors so far, in GiB (torch's caching
        allocator, `max_memory_allocated`); None on CPU devices."""
        import torch

        if self.torch_device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.torch_device) / 2**30

    @property
    def _offload_dir(self) -> str:
        base = self.run_dir or os.path.join(tempfile.gettempdir(), "m2flow")
        return os.path.join(base, "offload", f"{self.component}-{self.rank}-{os.getpid()}")

    @concurrent
    def info(self) -> dict:
        """Where and how this rank runs: pid, node, devices, cores, torch threads."""
        import torch

        return dict(component=self.component, rank=self.rank, world_size=self.world_size, pid=os.getpid(),
                    node_id=ray.get_runtime_context().get_node_id(), node_ip=ray.util.get_node_ip_address(),
                    devices=[d.index for d in self.devices], cores=sorted(os.sched_getaffinity(0)),
                    num_threads=torch.get_num_threads(),
                    env={k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "M2FLOW_COMPONENT",
                                                         "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT")})


_NOT_REMOTE = {"launch", "device_phase", "span", "tracer", "close"}


def _run(fn, *args, **kwargs) -> tuple:
    """Run fn in the worker: ("ok", result, seconds) or ("err", exc type name, message, traceback, seconds, nested):
    `nested` is the WorkerError itself when fn failed because a worker it called failed (else None)."""
    start = time.perf_counter()
    try:
        return "ok", fn(*args, **kwargs), time.perf_counter() - start
    except BaseException as e:  # noqa: BLE001 - everything goes back to the driver
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        # by name: Ray may run this function from a by-value copy of the module, with its own WorkerError class
        nested = e if type(e).__name__ == "WorkerError" and hasattr(e, "component") else None
        return "err", type(e).__name__, f"{type(e).__name__}: {e}", tb, time.perf_counter() - start, nested


def _pin_process(cores: Sequence[int]) -> None:
    """Pin every thread of this process (and so the threads they start later) to `cores`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that just exited
            pass


def _register_hosted(uid: str, rank: int, worker: Worker | None) -> None:
    """Record a worker built in this process (None: forget it). A module function, not inline in _Host: Ray ships
    the actor class by value, with its own copy of this module's globals; `_submit` reads the module's real
    `_HOSTED`."""
    if worker is None:
        _HOSTED.pop((uid, rank), None)
    else:
        _HOSTED[(uid, rank)] = worker


def _reset_process() -> bool:
    """Undo what the workers of a released process may have left behind for the next ones: torch.distributed's
    process group, torch.compile's caches, the global RNG's state (a new random seed, as a new process gets), freed
    memory. Returns whether the process may host another group: not after it joined a torch.distributed group
    (FSDP2's device-mesh state outlives `destroy_process_group`: a later group's ranks saw each other's shards)."""
    import ctypes
    import gc
    import sys

    import torch

    joined = torch.distributed.is_available() and torch.distributed.is_initialized()
    if joined:
        torch.distributed.destroy_process_group()
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    torch.seed()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the freed heap back to the OS
    except (OSError, AttributeError):
        pass
    return not joined


# Keys every worker process starts with (placeholders until `construct` sets them), so that setting them later
# replaces a value in place. Adding a key to a running process reallocates libc's environ array, and Ray's own
# threads read it (getenv) at any time: a read of the freed array crashed a worker with SIGSEGV.
_LATE_ENV = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def _start_env(env: dict[str, str]) -> dict:
    """The runtime_env of a new worker process: it starts with `env` (and `_LATE_ENV`) in its environment."""
    return {"env_vars": _LATE_ENV | env}


def _set_environ(target: dict[str, str]) -> None:
    """Make os.environ equal `target`, touching only the keys that differ (never `os.environ.clear()`: see
    `_LATE_ENV`)."""
    for key in [k for k in os.environ if k not in target]:
        del os.environ[key]
    for key, value in target.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _role_title(workers: dict) -> str:
    """A worker process's title: `m2flow:actor:0`, co-hosted workers joined (`m2flow:rollout:0+reward:0`),
    `m2flow:idle` for a process kept between runs."""
    roles = "+".join(f"{w.component}:{w.rank}" for w in list(workers.values()))
    return f"m2flow:{roles or 'idle'}"


def _keep_title(workers: dict) -> None:
    """Keep the process titled by its role (what `ps` and `top` show): Ray retitles it `ray::_Host...` around every
    call, so a daemon thread puts the role back twice a second."""
    try:
        from ray._raylet import getproctitle, setproctitle
    except ImportError:  # a Ray without its title functions: the title stays Ray's
        return
    while True:
        try:
            title = _role_title(workers)
            if getproctitle() != title:
                setproctitle(title)
        except RuntimeError:  # the dict changed while it was read: next time
            pass
        time.sleep(0.5)


@ray.remote(num_cpus=0, concurrency_groups={"user": 1, "system": 16})
class _Host:
    """The Ray actor of one rank: binds the process to its devices, then hosts the Worker objects (one per
    group placed here: the group that started the process and any co-hosted with it), keyed by group uid."""

    def __init__(self, env: dict[str, str], cores: list[int], pin: bool):
        self.base_env = dict(os.environ)  # `env` is in it already: the process started with it (_start_env)
        self.workers: dict[str, Worker] = {}
        self._bind(env, cores, pin)
        threading.Thread(target=_keep_title, args=(self.workers,), daemon=True, name="m2flow-title").start()

    def _bind(self, env: dict[str, str], cores: list[int], pin: bool) -> None:
        import torch

        _set_environ(self.base_env | env)
        if pin:
            _pin_process(cores)
        torch.set_num_threads(max(len(cores), 1))

    @ray.method(concurrency_group="user")
    def rebind(self, env: dict[str, str], cores: list[int], pin: bool) -> bool:
        """Take this idle process for a new rank (as `__init__` did for the first)."""
        assert not self.workers, f"rebind: the process still hosts {list(self.workers)}"
        self._bind(env, cores, pin)
        return True

    @ray.method(concurrency_group="user")
    def release(self, uid: str) -> tuple:
        """End this process's worker of group `uid` (its `close()` runs); when no worker is left, reset the process
        for reuse. -> ("ok", workers left, seconds) or a `_run` error."""
        def end() -> int:
            worker = self.workers.pop(uid, None)
            if worker is not None:
                _register_hosted(uid, worker.rank, None)
                worker.close()
            del worker
            if not self.workers and not _reset_process():
                return -1  # not to be reused: the caller ends the process
            return len(self.workers)

        return _run(end)

    @ray.method(concurrency_group="system")
    def where(self) -> dict:
        """pid and a free TCP port on this node (for MASTER_PORT)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return dict(pid=os.getpid(), node_ip=ray.util.get_node_ip_address(), port=port)

    @ray.method(concurrency_group="system")
    def alive(self) -> bool:
        return True

    @ray.method(concurrency_group="user")
    def construct(self, uid: str, worker_cls, attrs: dict, env: dict[str, str], args, kwargs) -> tuple:
        _set_environ(dict(os.environ) | env)
        worker = worker_cls.__new__(worker_cls)
        worker.__dict__.update(attrs)
        out = _run(worker.__init__, *args, **kwargs)
        self.workers[uid] = worker
        _register_hosted(uid, attrs["rank"], worker)
        return out

    def _method(self, uid: str, name: str):
        def method(*args, **kwargs):
            if uid not in self.workers:
                raise RuntimeError("the group was released (release_all): its workers are gone")
            return getattr(self.workers[uid], name)(*args, **kwargs)

        return method

    @ray.method(concurrency_group="user")
    def call(self, uid: str, name: str, args, kwargs) -> tuple:
        return _run(self._method(uid, name), *args, **kwargs)

    @ray.method(concurrency_group="system")
    def call_concurrent(self, uid: str, name: str, args, kwargs) -> tuple:
        return _run(self._method(uid, name), *args, **kwargs)

    @ray.method(concurrency_group="system")
    def spans(self, uid: str, clear: bool) -> tuple:
        return _run(lambda: self.workers[uid].tracer.spans(clear) if uid in self.workers else [])


class Handle:
    """The pending results of one group call; `wait()` gives them in rank order."""

    def __init__(self, group: "Group", method: str, ranks: list[int], refs: list,
                 local: dict[int, tuple] | None = None):
        """refs: one per rank (None where `local` holds the outcome of an in-process call already made)."""
        self.group, self.method, self.ranks, self._refs = group, method, ranks, refs
        self._outcomes: dict[int, tuple] = {}  # position -> ("ok", value, wall) once fetched
        self._failures: dict[int, WorkerError] = {}  # position -> its error, once fetched
        self.wall_times: list[float] = []
        for pos, out in (local or {}).items():
            try:
                self._settle(pos, out)
            except WorkerError:
                pass  # kept in self._failures: raised by wait(), like a remote failure

    @property
    def error(self) -> WorkerError | None:
        """The error this call raises, once any rank has failed: the lowest failing rank's, and when several ranks
        failed it says how many (`calc rank 0: process died ... (2 of 2 ranks failed)`)."""
        if not self._failures:
            return None
        first = self._failures[min(self._failures, key=lambda pos: self.ranks[pos])]
        if len(self._failures) == 1:
            return first
        return WorkerError(first.component, first.rank,
                           f"{first.message} ({len(self._failures)} of {len(self.ranks)} ranks failed)",
                           first.remote_traceback, first.exc_type)

    def done(self) -> bool:
        refs = [r for i, r in enumerate(self._refs) if i not in self._outcomes and i not in self._failures]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        return len(ready) == len(refs)

    def wait(self, timeout: float | None = None) -> list:
        """Per-rank results in rank order. Raises WorkerError (see `error`) or TimeoutError."""
        return wait_all([self], timeout)[0]

    def _fetch(self, pos: int) -> None:
        """Resolve one rank's ref; raise WorkerError if it failed."""
        rank = self.ranks[pos]
        try:
            out = ray.get(self._refs[pos])
        except ray.exceptions.RayActorError as e:
            where = self.group.process_of(rank)
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            error = WorkerError(self.group.component, rank,
                                f"process died (pid {where.get('pid', '?')} on {where.get('node_ip', '?')}) during "
                                f"{self.method}(): {cause}", exc_type="ProcessDied")
        except ray.exceptions.RayError as e:
            error = WorkerError(self.group.component, rank, f"{self.method}() failed in Ray: {type(e).__name__}",
                                remote_traceback=str(e), exc_type=type(e).__name__)
        else:
            return self._settle(pos, out)
        self._failures[pos] = error
        raise error

    def _settle(self, pos: int, out: tuple) -> None:
        """Keep one rank's outcome (a `_run` tuple); raise WorkerError if it is an error."""
        if out[0] == "ok":
            self._outcomes[pos] = out
            return
        _, exc_type, message, tb, _wall, nested = out
        if nested is not None:  # it failed because a worker it called failed: name that one, the root cause
            error = WorkerError(nested.component, nested.rank, f"{nested.message} (while {self.group.component} rank "
                                f"{self.ranks[pos]} waited on it in {self.method}())", nested.remote_traceback,
                                nested.exc_type)
        else:
            error = WorkerError(self.group.component, self.ranks[pos], f"{self.method}() raised {message}", tb,
                                exc_type)
        self._failures[pos] = error
        raise error

    def _settle_failed_peers(self, grace: float) -> None:
        """After one rank failed: give this call's other ranks `grace` seconds to finish or fail too (a kill or a
        crash takes them all at about the same time), so the error names the lowest failing rank, not the one Ray
        happened to report first. A rank still running after that (e.g. blocked on a peer) is left running."""
        pending = {r: i for i, r in enumerate(self._refs) if i not in self._outcomes and i not in self._failures}
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace) if pending else ([], [])
        for ref in ready:
            try:
                self._fetch(pending[ref])
            except WorkerError:
                pass  # kept in self._failures

    def _results(self) -> list:
        outs = [self._outcomes[i] for i in range(len(self._refs))]
        self.wall_times = [o[2] for o in outs]
        return [o[1] for o in outs]

    def __repr__(self):
        return f"Handle({self.group.component}.{self.method} on ranks {self.ranks})"


_PEER_GRACE_S = 1.0  # after a rank fails, how long its call's other ranks get to report before the error is raised


def wait_all(handles: Iterable[Handle], timeout: float | None = None, drain: float = 0.0) -> list[list]:
    """Wait on all handles at once; the first failure anywhere raises (a WorkerError, see `Handle.error`) within
    about a second, even while other calls are still blocked, e.g. on data that a dead producer will never send.
    `drain`: on a failure, first give the other calls up to that many seconds to end, for calls that share
    something the caller cleans up after an error (ranks writing one checkpoint folder, which is then removed).
    Returns each handle's results."""
    handles = list(handles)
    for h in handles:
        if h.error is not None:
            raise h.error
    pending = {h._refs[i]: (h, i) for h in handles for i in range(len(h._refs)) if i not in h._outcomes}
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        if not ready:
            waiting = sorted({f"{h.group.component}.{h.method} rank {h.ranks[i]}" for h, i in pending.values()})
            raise TimeoutError(f"wait: timed out after {timeout}s; still running: {', '.join(waiting)}")
        for ref in ready:
            h, i = pending.pop(ref)
            try:
                h._fetch(i)
            except WorkerError:
                h._settle_failed_peers(_PEER_GRACE_S)
                rest = [r for r, (other, j) in pending.items() if j not in other._outcomes and j not in other._failures]
                if drain and rest:
                    ray.wait(rest, num_returns=len(rest), timeout=drain)
                raise h.error from None
    return [h._results() for h in handles]



class _PerRank:
    """`group.per_rank`: a method of the group's worker, called with one tuple of positional args per rank."""

    def __init__(self, group: "Group"):
        self._group = group

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        getattr(self._group, name)  # a remote method of the worker, else AttributeError naming it

        def call(args_per_rank: Sequence[tuple], **kwargs) -> Handle:
            return self._group.call_per_rank(name, args_per_rank, **kwargs)

        call.__name__ = name
        return call


def gather_spans(groups: Sequence["Group"], clear: bool = False) -> list[dict]:
    """The tracer spans of every selected rank of every group, fetched concurrently; `clear` forgets them there."""
    handles = [Handle(g, "spans", g.ranks, [g._actors[r].spans.remote(g._uid, clear) for r in g.ranks]) for g in groups]
    return [s for per_group in wait_all(handles) for per_rank in per_group for s in per_rank]


def launch_all(cluster: Cluster, specs: Sequence[tuple], run_dir: str | None = None,
               env: dict[str, str] | None = None, host_with: Sequence["Group | None"] | None = None,
               started: Sequence["Group | None"] | None = None) -> list["Group"]:
    """Launch several groups at once: every process starts, then every constructor runs, concurrently (a flow's
    start-up costs its slowest group, not the sum). `specs`: (worker_cls, placement, args[, kwargs]) per group;
    `host_with[i]`, where given, is a running group whose processes host group i (see the module doc);
    `started[i]`, where given, is group i's processes asked for earlier (`Group.start`), e.g. while the caller built
    what its constructor needs. Returns the groups in that order; if any rank fails to start or construct, all are
    killed and that WorkerError (naming the component and rank) is raised."""
    hosts = list(host_with) if host_with is not None else [None] * len(specs)
    early = list(started) if started is not None else [None] * len(specs)
    if len(hosts) != len(specs) or len(early) != len(specs):
        raise ValueError(f"launch_all: host_with and started need one entry per spec ({len(specs)}), got "
                         f"{len(hosts)} and {len(early)}")
    groups: list[Group] = []
    try:
        for spec, host, group in zip(specs, hosts, early):
            if group is not None and (group.worker_cls is not spec[0] or group.placement != spec[1] or host):
                raise ValueError(f"launch_all: the started group {group} is not {spec[0].__name__} on "
                                 f"{spec[1].component}'s placement, or is also given a host")
            groups.append(group or Group.start(spec[0], cluster, spec[1], env, host))
        handles = [g._construct(cluster, run_dir, tuple(spec[2]), dict(spec[3]) if len(spec) > 3 else {})
                   for g, spec in zip(groups, specs)]
        wait_all(handles)
    except BaseException:
        for g in dict.fromkeys([*groups, *(g for g in early if g is not None)]):
            g.kill()
        raise
    return groups


def launch_cohosted(cluster: Cluster, specs: Sequence[tuple], run_dir: str | None = None) -> list["Group"]:
    """Launch `specs[0]`, then every other group co-hosted in its processes (`launch_all(..., host_with=...)`);
    if any fails, all are killed and the error is raised."""
    (first,) = launch_all(cluster, specs[:1], run_dir=run_dir)
    try:
        return [first, *launch_all(cluster, specs[1:], run_dir=run_dir, host_with=[first] * (len(specs) - 1))]
    except BaseException:
        first.kill()
        raise


class Group:
    """All ranks of one component. `group.method(*args)` calls it on every rank and returns a Handle;
    `group.on(ranks)` selects ranks; `group.per_rank.method([args_rank0, args_rank1, ...])` gives each its own."""

    def __init__(self, worker_cls: type, placement: ComponentPlacement, actors: list, where: dict[int, dict],
                 uid: str | None = None, cluster: Cluster | None = None):
        self.worker_cls, self.placement, self._actors, self._where = worker_cls, placement, actors, where
        self._cluster = cluster
        self._ranks = list(range(placement.world_size))
        self._uid = uid or uuid.uuid4().hex  # names this group's workers in their host processes

    @property
    def component(self) -> str:
        return self.placement.component

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def ranks(self) -> list[int]:
        return list(self._ranks)

    def process_of(self, rank: int) -> dict:
        """Where `rank`'s process runs, as found when it was placed: {pid, node_ip, port}; {} before that. Read
        here, not asked of the worker, so it answers while the worker is busy or dead."""
        return dict(self._where.get(rank, {}))

    @classmethod
    def launch(cls, worker_cls: type, cluster: Cluster, placement: ComponentPlacement, *args,
               run_dir: str | None = None, env: dict[str, str] | None = None, host_with: "Group | None" = None,
               **kwargs) -> "Group":
        """Start one actor per rank on its devices' node (or, with `host_with`, use that group's: see the module
        doc), then build `worker_cls(*args, **kwargs)` in each. Raises WorkerError (naming the rank) if a
        constructor fails; the group is then killed."""
        return launch_all(cluster, [(worker_cls, placement, args, kwargs)], run_dir=run_dir, env=env,
                          host_with=[host_with])[0]

    @classmethod
    def start(cls, worker_cls: type, cluster: Cluster, placement: ComponentPlacement,
              env: dict[str, str] | None = None, host_with: "Group | None" = None) -> "Group":
        """Ask Ray for one process per rank on its devices' node and return at once: nothing is constructed yet
        (`launch_all(..., started=[group])` does that). The processes start while the caller goes on."""
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"Group.launch: worker_cls must be a Worker subclass, got {worker_cls!r}")
        if not isinstance(placement, ComponentPlacement):
            raise TypeError(f"Group.launch: placement must be a ComponentPlacement (e.g. parse_placement(...)"
                            f"['{getattr(worker_cls, '__name__', '?')}']), got {placement!r}")
        if host_with is not None:
            if host_with.placement.rank_devices != placement.rank_devices or len(host_with._ranks) != len(
                    host_with._actors):
                raise ValueError(f"Group.launch: {placement.component} (devices per rank "
                                 f"{placement.rank_devices}) cannot be co-hosted with all of {host_with.component} "
                                 f"(devices per rank {host_with.placement.rank_devices}): they must match rank by rank")
            return cls(worker_cls, placement, list(host_with._actors), {}, cluster=cluster)
        ranks = [[cluster.device(i) for i in devs] for devs in placement.rank_devices]
        for rank, devs in enumerate(ranks):
            if len({d.node_id for d in devs}) != 1:
                raise ValueError(f"Group.launch: {placement.component} rank {rank} spans devices "
                                 f"{[d.index for d in devs]} on different nodes; a process lives on one node")
        name = placement.component
        actors = []
        for rank, devs in enumerate(ranks):
            node = devs[0].node_id
            same_node = [r for r, ds in enumerate(ranks) if ds[0].node_id == node]
            proc_env = dict(RANK=str(rank), WORLD_SIZE=str(len(ranks)), LOCAL_RANK=str(same_node.index(rank)),
                            LOCAL_WORLD_SIZE=str(len(same_node)), M2FLOW_COMPONENT=name)
            cores = sorted({c for d in devs for c in d.cores})
            proc_env["OMP_NUM_THREADS"] = str(max(len(cores), 1))  # for the processes this worker starts
            if devs[0].kind == "gpu":
                proc_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d.gpu_id) for d in devs)
            proc_env.update(env or {})
            actor = _reused_host(cluster, _process_key(devs), (name, rank), proc_env, cores, devs[0].kind == "cpu")
            if actor is None:
                actor = (_Host.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                                       max_restarts=0, name=f"m2flow:{name}:{rank}:{uuid.uuid4().hex[:8]}",
                                       runtime_env=_start_env(proc_env))
                         .remote(proc_env, cores, devs[0].kind == "cpu"))
                cluster.started_process(actor, (name, rank))
            actors.append(actor)
        return cls(worker_cls, placement, actors, {}, cluster=cluster)

    def _construct(self, cluster: Cluster, run_dir: str | None, args, kwargs) -> Handle:
        """Wait for the processes to be up, then build the Worker in each (returns the constructors' handle)."""
        name, ranks = self.component, [[cluster.device(i) for i in devs] for devs in self.placement.rank_devices]
        for rank, actor in enumerate(self._actors):
            try:
                self._where[rank] = ray.get(actor.where.remote())
            except ray.exceptions.RayError as e:
                raise WorkerError(name, rank, f"process failed to start: {e}") from None
        master = dict(MASTER_ADDR=self._where[0]["node_ip"], MASTER_PORT=str(self._where[0]["port"]))
        refs, every = [], sorted({d.index: d for devs in ranks for d in devs}.values(), key=lambda d: d.index)
        for rank, (actor, devs) in enumerate(zip(self._actors, ranks)):
            attrs = dict(component=name, rank=rank, world_size=len(ranks), devices=devs, run_dir=run_dir,
                         _m2flow_locks=[cluster.device_lock(d.index) for d in sorted(devs, key=lambda d: d.index)],
                         _m2flow_group_locks=[cluster.device_lock(d.index) for d in every
                                              if d.node_id in {mine.node_id for mine in devs}],
                         _m2flow_group_id=f"{name}@{self._uid}")
            refs.append(actor.construct.remote(self._uid, self.worker_cls, attrs, master, args, kwargs))
        return Handle(self, "__init__", self.ranks, refs)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self.worker_cls, name, None)
        if name in _NOT_REMOTE or not callable(attr):
            raise AttributeError(f"{self.worker_cls.__name__} ({self.component}) has no remote method {name!r}")

        def call(*args, **kwargs) -> Handle:
            return self._submit(name, [(args, kwargs)] * len(self._ranks))

        call.__name__ = name
        return call

    def on(self, ranks: int | Iterable[int]) -> "Group":
        """A view of this group that calls only `ranks` (results come back in that order)."""
        ranks = [ranks] if isinstance(ranks, int) else list(ranks)
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad or not ranks:
            raise ValueError(f"{self.component}.on({ranks}): ranks must be in 0..{self.world_size - 1}")
        view = copy.copy(self)
        view._ranks = ranks
        return view

    @property
    def per_rank(self) -> "_PerRank":
        """Calls with other positional args per rank, by method: `group.per_rank.add([(1,), (2,)], **kwargs)` is
        `call_per_rank("add", [(1,), (2,)], **kwargs)`."""
        return _PerRank(self)

    def call_per_rank(self, method: str, args_per_rank: Sequence[tuple], **kwargs) -> Handle:
        """Call `method` with different positional args per rank: `args_per_rank[i]` goes to the i-th rank, with
        the same `kwargs` to every rank."""
        if len(args_per_rank) != len(self._ranks):
            raise ValueError(f"{self.component}.call_per_rank({method!r}): got {len(args_per_rank)} argument tuples "
                             f"for {len(self._ranks)} rank(s)")
        if any(not isinstance(a, (tuple, list)) for a in args_per_rank):
            raise TypeError(f"{self.component}.call_per_rank({method!r}): each rank's args must be a tuple")
        getattr(self, method)  # validates the name
        return self._submit(method, [(tuple(a), kwargs) for a in args_per_rank])

    def _submit(self, name: str, calls: list[tuple]) -> Handle:
        parallel = getattr(getattr(self.worker_cls, name), "_m2flow_concurrent", False)
        refs, local = [], {}
        for pos, (rank, (args, kwargs)) in enumerate(zip(self._ranks, calls)):
            if (worker := _HOSTED.get((self._uid, rank))) is not None:  # co-hosted in this process: call it here
                refs.append(None)
                local[pos] = _run(getattr(worker, name), *args, **kwargs)
                continue
            actor = self._actors[rank]
            refs.append((actor.call_concurrent if parallel else actor.call).remote(self._uid, name, args, kwargs))
        return Handle(self, name, list(self._ranks), refs, local)

    def spans(self, clear: bool = False) -> list[dict]:
        """Tracer spans recorded so far on the selected ranks (all by default); `clear` forgets them there."""
        return gather_spans([self], clear)

    def kill(self, timeout: float = 60.0) -> None:
        """Kill the selected ranks' processes and return once they are dead, so that every call made after it (on
        this group or on a group co-hosted in them) fails with WorkerError. Pending calls fail the same way.
        `ray.kill` only asks for the kill; here each process is pinged until Ray reports it dead."""
        actors = [self._actors[rank] for rank in self._ranks]
        for actor in actors:
            if self._cluster is not None:
                self._cluster.end_process(actor)
                continue
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        deadline = time.monotonic() + timeout
        for rank, actor in zip(self._ranks, actors):
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{self.component} rank {rank}: still alive {timeout:.0f}s after kill()")
                try:
                    ray.get(actor.alive.remote(), timeout=min(left, 1.0))
                except ray.exceptions.GetTimeoutError:
                    continue  # busy going down: ask again
                except ray.exceptions.RayActorError:
                    break  # dead
                time.sleep(0.005)  # the kill is on its way

    def _process_keys(self) -> list[tuple]:
        return [_process_key([self._cluster.device(i) for i in devs]) for devs in self.placement.rank_devices]

    def __repr__(self):
        devices = [self.placement.rank_devices[r] for r in self._ranks]
        return f"Group({self.component}, {self.worker_cls.__name__}, ranks {self._ranks}, devices {devices})"



def _process_key(devs: Sequence[Device]) -> tuple:
    """Which idle processes can host a rank on `devs`: any on their node, on the same GPUs (CUDA_VISIBLE_DEVICES is
    fixed once CUDA starts; cores are re-pinned)."""
    return devs[0].node_id, tuple(d.gpu_id for d in devs if d.kind == "gpu")


def _reused_host(cluster: Cluster, key: tuple, role: tuple[str, int], env: dict[str, str], cores: list[int],
                 pin: bool):
    """An idle process of `cluster` under `key` started for `role`, bound to a new rank; None if there is none (or
    none alive)."""
    while (actor := cluster.take_idle_process(key, role)) is not None:
        try:
            ray.get(actor.rebind.remote(env, cores, pin), timeout=60)
            return actor
        except ray.exceptions.RayError:  # died while idle (or hung): forget it
            cluster.end_process(actor)
    return None


def release_all(groups: Sequence[Group], timeout: float = 60.0) -> None:
    """End the groups' workers after a run that went well (their calls all done): each worker's `close()` runs, and
    every process left with no worker is kept by its Cluster for the next group (killed when the Cluster does not
    reuse processes). A group whose release fails, or a process that does not answer within `timeout`, is killed."""
    calls = [(g, rank, g._actors[rank], g._actors[rank].release.remote(g._uid)) for g in groups for rank in g.ranks]
    keys = {id(g): g._process_keys() for g in groups}
    failed: list[Group] = []
    for g, rank, actor, ref in calls:
        try:
            out = ray.get(ref, timeout=timeout)
        except ray.exceptions.RayError:
            out = ("err",)
        if out[0] != "ok":
            failed.append(g)
        elif out[1] == 0:
            g._cluster.keep_idle_process(keys[id(g)][rank], actor)
        elif out[1] < 0:  # it joined a torch.distributed group: ended, not kept
            g._cluster.end_process(actor)
    for g in dict.fromkeys(failed):
        g.kill()


@contextmanager
def running(groups: list[Group]):
    """`with running(groups):` the block uses the groups (it may append more); they are released after it
    (`release_all`), or killed if it raises."""
    try:
        yield groups
    except BaseException:
        for g in groups:
            g.kill()
        raise
    release_all(groups)
