"""Cluster: start (or join) Ray and list the devices that placements refer to: GPUs, else slots of CPU cores.

It launches no workers (`group.py` does) and decides no placement (`placement.py` does). It keeps the idle worker
processes that `group.py` hands back for reuse, so that a later group on the same node starts without a new Python.
"""

from __future__ import annotations

import logging
import os
from itertools import accumulate
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .lock import DeviceLock

__all__ = ["Device", "Cluster"]


@dataclass(frozen=True)
class Device:
    """One schedulable compute unit: a GPU, or a slot of CPU cores (workers on it are pinned to `cores`)."""

    index: int
    node_id: str
    node_ip: str
    kind: str  # "cpu" | "gpu"
    cores: tuple[int, ...]
    gpu_id: int | None = None


@ray.remote(num_cpus=0)
def _probe_node() -> dict:
    """What a worker process on this node sees: its usable cores and the GPUs it may address."""
    return {"cores": sorted(os.sched_getaffinity(0)), "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _slices(cores: list[int], n: int | list[int]) -> list[tuple[int, ...]]:
    """Split `cores` into `n` contiguous slices of near-equal size; with more slices than cores, cores are shared.
    A list of sizes instead of `n`: contiguous slices of those sizes, from the first core on (cores beyond their sum
    are left unused)."""
    if isinstance(n, list):
        if sum(n) > len(cores):
            raise ValueError(f"Cluster: cpu_devices {n} asks for {sum(n)} cores, but a node has {len(cores)} "
                             f"usable cores ({cores}): give sizes that sum to at most {len(cores)}")
        return [tuple(cores[end - size:end]) for size, end in zip(n, accumulate(n))]
    if n <= len(cores):
        return [tuple(cores[i * len(cores) // n:(i + 1) * len(cores) // n]) for i in range(n)]
    return [(cores[i * len(cores) // n],) for i in range(n)]


def _gpu_ids(cuda_visible: str | None, count: int) -> list[int]:
    try:
        ids = [int(x) for x in (cuda_visible or "").split(",") if x.strip()]
    except ValueError:  # UUIDs: address GPUs by position
        ids = []
    return ids[:count] if len(ids) >= count else list(range(count))


def node_devices(gpus: int, cores: int, cpu_devices: int | list[int] | None) -> int:
    """How many devices a node gives: one per GPU, else `cpu_devices` CPU devices (a count, or a list of each
    device's cores), else one per core."""
    if isinstance(cpu_devices, list):
        return gpus or len(cpu_devices)
    return gpus or cpu_devices or cores


def check_cpu_devices(cpu_devices: Any, where: str) -> None:
    """`cpu_devices` is None, a count >= 1, or a non-empty list of core counts >= 1 (one per device)."""
    if cpu_devices is None:
        return
    if isinstance(cpu_devices, list):
        if not cpu_devices or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in cpu_devices):
            raise ValueError(f"{where} must be a count >= 1 or a list of each device's cores (each >= 1, e.g. "
                             f"[1, 3]), got {cpu_devices}")
    elif isinstance(cpu_devices, bool) or not isinstance(cpu_devices, int) or cpu_devices < 1:
        raise ValueError(f"{where} must be a count >= 1 (or None for one per core) or a list of each device's "
                         f"cores, got {cpu_devices!r}")


class _DropTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def _quiet_token_notice() -> None:
    """A local instance m2flow starts keeps Ray's default, token authentication, without Ray's notice of it on every
    run ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out"), which
    concerns no m2flow user; Ray's other messages, its warning that authentication is off included, still show."""
    notices = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropTokenNotice) for f in notices.filters):
        notices.addFilter(_DropTokenNotice())


class Cluster:
    """Start a local Ray instance (or join `address`, or use the one already initialized) and list its devices.

    Per node: one device per GPU; on nodes without GPUs (or with `use_gpus=False`), `cpu_devices` CPU devices
    (default: one per core), each owning a contiguous slice of the node's cores. Devices are numbered
    node by node, the driver's node first.

    With `reuse_processes` (the default), a group released after a run that went well (`release_all`) leaves its
    worker processes idle here, and the next group launched on the same node (and the same GPUs) is built in one of
    them instead of a new process: no Python start-up and no torch / transformers import (seconds per process). A
    process is reused only by the role it was started for (component and rank), so its Ray actor name
    (`m2flow:<component>:<rank>:<id>`) stays true; at most `max_idle_processes` are kept (the oldest kept is ended
    first). A killed group's processes are never reused.
    """

    def __init__(self, address: str | None = None, cpu_devices: int | list[int] | None = None,
                 num_cpus: int | None = None, use_gpus: bool = True, reuse_processes: bool = True,
                 max_idle_processes: int = 16):
        cpu_devices = list(cpu_devices) if isinstance(cpu_devices, tuple) else cpu_devices
        check_cpu_devices(cpu_devices, "Cluster: cpu_devices")
        self._started = not ray.is_initialized()
        if self._started:
            # address="local": start a new instance, never attach to a stray one (RAY_ADDRESS, `ray start`)
            args = dict(address=address) if address else dict(address="local", num_cpus=num_cpus)
            if not address:  # Ray starts workers at nice 15: beside any other busy process they would barely run
                os.environ.setdefault("RAY_worker_niceness", "0")
                _quiet_token_notice()
            try:
                ray.init(include_dashboard=False, logging_level=logging.WARNING, **args)
            except Exception as e:  # Ray gives a local node 30 s to start; an overloaded machine may need a retry
                if address or "timed out during startup" not in str(e):
                    raise
                ray.shutdown()
                ray.init(include_dashboard=False, logging_level=logging.WARNING, **args)
        self._locks: dict[int, DeviceLock] = {}
        self.reuse_processes = reuse_processes
        self.max_idle_processes = max_idle_processes
        self._kept: list[tuple] = []  # ((node id, GPU ids, role), actor handle) of every idle process, oldest first
        self._roles: dict = {}  # actor id -> (component, rank) of the role a worker process was started for
        self.devices: list[Device] = []
        self.nodes: list[dict] = []
        here = ray.get_runtime_context().get_node_id()
        alive = [n for n in ray.nodes() if n["Alive"]]
        alive.sort(key=lambda n: (n["NodeID"] != here, n["NodeManagerAddress"], n["NodeID"]))
        pinned = [NodeAffinitySchedulingStrategy(n["NodeID"], soft=False) for n in alive]
        probes = ray.get([_probe_node.options(scheduling_strategy=p).remote() for p in pinned])
        for node, probe in zip(alive, probes):
            res = node["Resources"]
            cores = probe["cores"][:int(res["CPU"])] if res.get("CPU", 0) >= 1 else probe["cores"]
            num_gpus = int(res.get("GPU", 0)) if use_gpus else 0
            if num_gpus:
                kinds = [("gpu", g) for g in _gpu_ids(probe["cuda_visible"], num_gpus)]
            else:
                kinds = [("cpu", None)] * node_devices(0, len(cores), cpu_devices)
            first = len(self.devices)
            sizes = cpu_devices if isinstance(cpu_devices, list) and not num_gpus else len(kinds)
            for (kind, gpu), slot in zip(kinds, _slices(cores, sizes)):
                ip = node["NodeManagerAddress"]
                self.devices.append(Device(len(self.devices), node["NodeID"], ip, kind, slot, gpu))
            self.nodes.append(dict(node_id=node["NodeID"], node_ip=node["NodeManagerAddress"], cores=cores,
                                   num_gpus=num_gpus, devices=list(range(first, len(self.devices)))))

    @property
    def started_ray(self) -> bool:
        """Whether this Cluster started the Ray instance it uses (a local one, ended by `shutdown`)."""
        return self._started

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def device(self, index: int) -> Device:
        if not 0 <= index < len(self.devices):
            raise IndexError(f"device {index} does not exist; the cluster has {len(self.devices)} device(s)")
        return self.devices[index]

    def device_lock(self, index: int) -> DeviceLock:
        """The (shared, named) lock of device `index`; workers on that device take it in `device_phase`."""
        if index not in self._locks:
            self._locks[index] = DeviceLock(index, self.device(index).node_id)
        return self._locks[index]

    def started_process(self, actor, role: tuple[str, int]) -> None:
        """Note the role (component, rank) a new worker process was started (and Ray-named) for."""
        self._roles[actor._actor_id] = role

    def not_for_reuse(self, actor) -> None:
        """Have this worker process ended, not kept, when its group is released (e.g. left at a low priority)."""
        self._roles.pop(actor._actor_id, None)

    def take_idle_process(self, key: tuple, role: tuple[str, int]):
        """An idle worker process kept under `key` (see `keep_idle_process`) that was started for `role`, or None."""
        full = (*key, role)
        for i in range(len(self._kept) - 1, -1, -1):  # the newest kept first
            if self._kept[i][0] == full:
                return self._kept.pop(i)[1]
        return None

    def keep_idle_process(self, key: tuple, actor) -> None:
        """Keep a worker process that no group uses any more, for the next group launched under `key` in the role it
        was started for; killed instead when `reuse_processes` is off, and the oldest kept one is killed when more
        than `max_idle_processes` would be kept."""
        role = self._roles.get(actor._actor_id)
        if not self.reuse_processes or role is None or self.max_idle_processes < 1:
            self.end_process(actor)
            return
        self._kept.append(((*key, role), actor))
        while len(self._kept) > self.max_idle_processes:
            self.end_process(self._kept.pop(0)[1])

    def end_process(self, actor) -> None:
        """Kill a worker process (already gone is fine) and forget its role."""
        self._roles.pop(actor._actor_id, None)
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    @property
    def idle_processes(self) -> int:
        """How many idle worker processes are kept for reuse."""
        return len(self._kept)

    def shutdown(self) -> None:
        """Stop Ray if this Cluster started it (a joined or pre-initialized Ray is left running, less the idle
        worker processes this Cluster kept)."""
        for _, actor in self._kept:
            self.end_process(actor)
        self._kept.clear()
        self._locks.clear()
        if self._started and ray.is_initialized():
            ray.shutdown()
        self._started = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __repr__(self):
        kinds = ", ".join(f"{d.index}:{d.kind}@{d.node_ip}{list(d.cores)}" for d in self.devices)
        return f"Cluster({len(self.nodes)} node(s), devices [{kinds}])"
