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
