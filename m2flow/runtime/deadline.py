"""Deadlines for blocking calls that take an optional timeout (None: no deadline, wait as long as it takes)."""

from __future__ import annotations

import threading
import time


def deadline_of(timeout: float | None) -> float | None:
    """The monotonic time `timeout` seconds from now, or None."""
    return None if timeout is None else time.monotonic() + timeout


def seconds_left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (0 once passed), or None."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def wait(cond: threading.Condition, deadline: float | None) -> bool:
    """`cond.wait()` (held by the caller) until notified or the deadline; False once the deadline has passed, so that
    `while not ready(): if not wait(cond, deadline): <time out>` re-checks its predicate after every wake-up."""
    if deadline is None:
        cond.wait()
        return True
    left = deadline - time.monotonic()
    return left > 0 and (cond.wait(left) or True)
