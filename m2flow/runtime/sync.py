"""Weight sync between groups, driven from the driver: the actor publishes its weights once, every receiver rank
loads them in place. Flows and profilers call it; it does not know which flow it serves."""

from __future__ import annotations

import time

from m2flow.runtime.group import Handle, wait_all
from m2flow.runtime.weights import WeightsRef


def sync_weights(actor, receivers, check: bool, local: bool = False, per_rank: bool = False) -> int:
    """`actor` (a group, or `group.on([0])` when one rank's weights are everyone's) publishes its weights once (rank 0,
    gathered from every rank if sharded); every rank of every receiver group loads them in place, and when `check`ed
    must then hold them bit for bit. `local`: every receiver lives in the publishing process (co-hosted), so the
    weights stay in it; with `per_rank`, see `start_sync`. Returns the bytes published (LoRA adapters only, with
    model.lora.sync: adapters)."""
    if local:  # one call into that process publishes and loads: no Ray round trip per receiver group
        return _pushed(start_sync(actor, receivers, check, per_rank), check)[0][4]
    return load_published(actor.publish_weights(check).wait()[0], receivers, check)


def load_published(weights: WeightsRef, receivers, check: bool) -> int:
    """The second half of `sync_weights`, for weights the actor published already (e.g. at the end of an update
    call, which then returns them): every rank of every receiver group loads them; checked as there."""
    _verify(weights.version, weights.digest, [d for h in wait_all([g.load_weights(weights) for g in receivers])
                                              for d in h], check)
    return weights.nbytes


def start_sync(actor, receivers, check: bool, per_rank: bool = False) -> Handle:
    """The co-hosted sync (every receiver in the publishing process) as one call, not waited for. A process runs
    its calls in the order they were made, so one made right behind the actor's update starts when the update
    ends, with no round trip to the driver in between. `finish_sync` waits for it. `per_rank`: every actor rank
    holds the same weights (data-parallel) and each receiver's rank r lives in actor rank r's process: each actor
    rank loads its own receivers, all in parallel."""
    return actor.push_weights(receivers, check, per_rank)


def finish_sync(handle: Handle, check: bool) -> float:
    """Wait for a `start_sync`; returns the seconds the sync took in its process (the slowest, per rank)."""
    return max(p[3] for p in _pushed(handle, check))


def _pushed(handle: Handle, check: bool) -> list[tuple]:
    """The publishing ranks' `push_weights` results, each checked."""
    pushed = [p for p in handle.wait() if p is not None]
    for version, digest, digests, *_ in pushed:
        _verify(version, digest, digests, check)
    return pushed


def _verify(version: int, digest, digests: list, check: bool) -> None:
    if check and any(d != digest for d in digests):
        raise RuntimeError(f"weight sync v{version}: a receiver's weights differ from the actor's")


class PublishesWeights:
    """For the workers that publish weights (`publish_weights(check, local)`; a sharded one on every rank, rank 0's
    result counting): `push_weights` is a co-hosted sync in one call, made where the receivers live."""

    def push_weights(self, receivers, check: bool, per_rank: bool = False) -> tuple | None:
        """Publish in this process and load into `receivers` (groups co-hosted here, so their calls run here; with
        `per_rank` only their rank of this rank's number) -> (version, digest, the receivers' digests, seconds,
        bytes published); None on ranks that publish nothing (a sharded actor's other ranks)."""
        start = time.perf_counter()
        weights = self.publish_weights(check, local=True)
        if weights is None:
            return None
        if per_rank:
            receivers = [g.on([self.rank]) for g in receivers]
        digests = [d for h in wait_all([g.load_weights(weights) for g in receivers]) for d in h]
        return weights.version, weights.digest, digests, time.perf_counter() - start, weights.nbytes


class WeightSync:
    """The weight sync a plan runs, as one object the driver calls at the same two points whatever the mechanism:
    `start(n)` right after handing out the n-th step's update (n counts this run's syncs, 0 the one before the first
    step), `finish(n, results)` once the update is in -> its metrics (`time/weight_sync`, `sync/checked`,
    `sync/bytes` where known). `checks(n)` says whether sync n is verified bit for bit.
    - plain: `finish` publishes from the actor (rank 0 with `per_rank`) and loads into every receiver;
    - co-hosted (`local`): every receiver lives in the actor's processes, so `start` queues the sync behind the
      update there (no round trip between) and `finish` waits for it;
    - returned (`returned`): the actor hands its published weights back with its result (`results[0]["weights"]`)
      and `finish` loads them into the receivers."""

    def __init__(self, actor, receivers: list, checks, local: bool = False, per_rank: bool = False,
                 returned: bool = False):
        self.actor, self.receivers, self.checks = actor, receivers, checks
        self.local, self.per_rank, self.returned = local, per_rank, returned
        self._queued: Handle | None = None

    def first(self) -> int:
        """The sync before the first step (sync 0): every receiver takes the actor's weights. -> bytes published."""
        publisher = self.actor if self.local or not self.per_rank else self.actor.on([0])
        return sync_weights(publisher, self.receivers, self.checks(0), self.local, self.per_rank)

    def start(self, n: int) -> None:
        if self.local:
            self._queued = start_sync(self.actor, self.receivers, self.checks(n), self.per_rank)

    def finish(self, n: int, results: list | None = None) -> dict:
        check, began = self.checks(n), time.perf_counter()
        if self._queued is not None:  # the seconds it took in its process (the slowest, per rank)
            pushed, self._queued = _pushed(self._queued, check), None
            return {"time/weight_sync": max(p[3] for p in pushed), "sync/checked": int(check),
                    "sync/bytes": pushed[0][4]}
        if self.returned:
            sent = load_published(results[0].pop("weights"), self.receivers, check)
        else:
            sent = sync_weights(self.actor.on([0]) if self.per_rank else self.actor, self.receivers, check)
        return {"time/weight_sync": time.perf_counter() - began, "sync/checked": int(check), "sync/bytes": sent}

    def after(self, n: int) -> dict:
        """`start` and `finish` at once, for an update that is already in; `time/weight_sync` is the wall time."""
        began = time.perf_counter()
        self.start(n)
        return {**self.finish(n), "time/weight_sync": time.perf_counter() - began}
