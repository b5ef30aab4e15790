"""Weight sync between groups, driven from the driver: the actor publishes its weights once, every receiver rank
loads them in place. Flows and profilers call it; it does not know which flow it serves."""

from __future__ import annotations

import time

from m2flow.runtime import Handle, wait_all


def sync_weights(actor, receivers, check: bool, local: bool = False) -> None:
    """`actor` (a group, or `group.on([0])` when one rank's weights are everyone's) publishes its weights once (rank 0,
    gathered from every rank if sharded); every rank of every receiver group loads them in place, and when `check`ed
    must then hold them bit for bit. `local`: every receiver lives in the publishing process (co-hosted), so the
    weights stay in it."""
    if local:  # one call into that process publishes and loads: no Ray round trip per receiver group
        finish_sync(start_sync(actor, receivers, check), check)
        return
    weights = actor.publish_weights(check).wait()[0]
    _verify(weights.version, weights.digest, [d for h in wait_all([g.load_weights(weights) for g in receivers])
                                              for d in h], check)


def start_sync(actor, receivers, check: bool) -> Handle:
    """The co-hosted sync (every receiver in the publishing process) as one call, not waited for. A process runs
    its calls in the order they were made, so one made right behind the actor's update starts when the update
    ends, with no round trip to the driver in between. `finish_sync` waits for it."""
    return actor.push_weights(receivers, check)


def finish_sync(handle: Handle, check: bool) -> float:
    """Wait for a `start_sync`; returns the seconds the sync took in its process."""
    version, digest, digests, seconds = handle.wait()[0]
    _verify(version, digest, digests, check)
    return seconds


def _verify(version: int, digest, digests: list, check: bool) -> None:
    if check and any(d != digest for d in digests):
        raise RuntimeError(f"weight sync v{version}: a receiver's weights differ from the actor's")


class PublishesWeights:
    """For the workers that publish weights (`publish_weights(check, local)`; a sharded one on every rank, rank 0's
    result counting): `push_weights` is a co-hosted sync in one call, made where the receivers live."""

    def push_weights(self, receivers, check: bool) -> tuple | None:
        """Publish in this process and load into `receivers` (groups co-hosted here, so their calls run here)
        -> (version, digest, the receivers' digests, seconds); None on ranks other than 0."""
        start = time.perf_counter()
        weights = self.publish_weights(check, local=True)
        if weights is None:
            return None
        digests = [d for h in wait_all([g.load_weights(weights) for g in receivers]) for d in h]
        return weights.version, weights.digest, digests, time.perf_counter() - start
