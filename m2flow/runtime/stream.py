"""Streams over channels: the end-of-stream marker, draining a stream, and routing a batch over consumer ranks.

Channels carry items until a producer rank puts END; a consumer stops after one END per producer rank. Several
consumer ranks either share one queue (work sharing: each producer puts one END per consumer) or, for a data-parallel
group that must see equal work per rank (a sharded actor), get their own keyed share of every batch (`route`).
"""

from __future__ import annotations

from collections.abc import Iterator

from m2flow.types import Batch

END = "__m2flow_end_of_step__"


def producers_of(channel, producers: int | None = None) -> int:
    """`producers` where given, else the ranks the channel says put into it (1 for a channel that does not say)."""
    return getattr(channel, "producers", 1) if producers is None else producers


def consumers_of(channel, consumers: int | None = None) -> int:
    """`consumers` where given, else the ranks the channel says take from it (1 for a channel that does not say)."""
    return getattr(channel, "consumers", 1) if consumers is None else consumers


def drain(channel, producers: int | None = None, timeout: float | None = None, key=None,
          alone: bool = False) -> Iterator:
    """Yield items from `channel` (sub-queue `key`) until `producers` END markers have arrived (default: the
    channel's producers; see `drain_batches`)."""
    for items in drain_batches(channel, producers, timeout, key, alone):
        yield from items


def drain_batches(channel, producers: int | None = None, timeout: float | None = None, key=None,
                  alone: bool = False) -> Iterator[list]:
    """Yield what each round trip to `channel` brought (a non-empty list) until `producers` END markers have arrived.
    `alone`: this consumer has the sub-queue to itself (one consumer rank, or its own key), so each round trip takes
    everything queued; consumers sharing a queue take one item at a time, so that none takes another's END."""
    ends, producers = 0, producers_of(channel, producers)
    while ends < producers:
        got = channel.get_all(key=key, timeout=timeout) if alone else [channel.get(key=key, timeout=timeout)]
        items = [x for x in got if not (isinstance(x, str) and x == END)]
        ends += len(got) - len(items)
        if items:
            yield items


def finish(channel, consumers: int | None = None, keyed: bool = False) -> None:
    """End this producer's stream: one END per consumer rank (default: the channel's consumers; into each rank's
    sub-queue when `keyed`)."""
    for r in range(consumers_of(channel, consumers)):
        channel.put(END, key=r if keyed else None)


def split_for_ranks(batch: Batch, ranks: int) -> list[Batch]:
    """`ranks` contiguous shares of `batch`, sizes differing by at most one. A rank left without samples (a batch
    smaller than the group) gets one row marked `meta["weight"] = 0`: it runs the same collectives, learns nothing."""
    if len(batch) == 0:
        raise ValueError("split_for_ranks: empty batch")
    base, extra = divmod(len(batch), ranks)
    shares, start = [], 0
    for r in range(ranks):
        size = base + (r < extra)
        if size:
            shares.append(batch.select(slice(start, start + size)))
        else:
            filler = batch.select(slice(0, 1))
            filler.meta["weight"] = 0
            shares.append(filler)
        start += size
    return shares


def route(channel, batch: Batch, ranks: int) -> None:
    """Put one share of `batch` into each consumer rank's sub-queue (key = rank): every rank gets one item per call."""
    for r, share in enumerate(split_for_ranks(batch, ranks)):
        channel.put(share, key=r, weight=len(share))
