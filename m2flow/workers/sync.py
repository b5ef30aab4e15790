"""Weight sync between groups, driven from the driver: the actor publishes its weights once, every receiver rank
loads them in place. Flows and profilers call it; it does not know which flow it serves."""

from __future__ import annotations

from m2flow.runtime import wait_all


def sync_weights(actor, receivers, check: bool, local: bool = False) -> None:
    """`actor` (a group, or `group.on([0])` when one rank's weights are everyone's) publishes its weights once (rank 0,
    gathered from every rank if sharded); every rank of every receiver group loads them in place, and when `check`ed
    must then hold them bit for bit. `local`: every receiver lives in the publishing process (co-hosted), so the
    weights stay in it."""
    weights = actor.publish_weights(check, local).wait()[0]
    digests = [d for h in wait_all([g.load_weights(weights) for g in receivers]) for d in h]
    if check and any(d != weights.digest for d in digests):
        raise RuntimeError(f"weight sync v{weights.version}: a receiver's weights differ from the actor's")
