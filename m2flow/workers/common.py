"""Small pieces every reasoning worker shares: the end-of-stream marker and channel draining.

Channels carry items until a producer rank puts END; a consumer stops after one END per producer rank.
"""

from __future__ import annotations

from typing import Iterator

END = "__m2flow_end_of_step__"


def drain(channel, producers: int = 1, timeout: float | None = None) -> Iterator:
    """Yield items from `channel` until `producers` END markers have arrived."""
    ends = 0
    while ends < producers:
        item = channel.get(timeout=timeout)
        if isinstance(item, str) and item == END:
            ends += 1
        else:
            yield item
