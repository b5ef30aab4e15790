"""Weight sync between groups, driven from the driver: the actor publishes its weights once, every receiver rank
loads them in place. Flows and profilers call it; it does not know which flow it serves."""

from __future__ import annotations

from m2flow.runtime import wait_all


def sync_weights(actor, receivers, check: bool, local: bool = False) -> None:
    """`actor` (a group, or `group.on([0])` when one rank's weights are everyone's) publishes its weights once (rank 0,
    gathered from every rank if sharded); every rank of every receiver group loads them in place, and when `check`ed
    must then hold them bit for bit. `local`: every receiver lives in the publishing process (co-hosted), so the
    weights stay in it."""
    if local:  # one call into that process publishes and loads: no Ray round trip per receiver group
        version, digest, digests = actor.push_weights(receivers, check).wait()[0]
    else:
        weights = actor.publish_weights(check).wait()[0]
        version, digest = weights.version, weights.digest
        digests = [d for h in wait_all([g.load_weights(weights) for g in receivers]) for d in h]
    if check and any(d != digest for d in digests):
        raise RuntimeError(f"weight sync v{version}: a receiver's weights differ from the actor's")


class PublishesWeights:
    """For the workers that publish weights (`publish_weights(check, local)`; a sharded one on every rank, rank 0's
    result counting): `push_weights` is a co-hosted sync in one call, made where the receivers live."""

    def push_weights(self, receivers, check: bool) -> tuple | None:
        """Publish in this process and load into `receivers` (groups co-hosted here, so their calls run here)
        -> (version, digest, the receivers' digests); None on ranks other than 0."""
        weights = self.publish_weights(check, local=True)
        if weights is None:
            return None
        return weights.version, weights.digest, [d for h in wait_all([g.load_weights(weights) for g in receivers])
                                                 for d in h]
