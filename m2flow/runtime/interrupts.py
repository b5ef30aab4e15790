"""Ctrl-C that nothing below the driver can lose.

Python turns SIGINT into a KeyboardInterrupt raised wherever the main thread is. While the driver waits inside Ray
(`ray.get`, `ray.wait`), Ray's core worker polls for signals itself and turns the KeyboardInterrupt into a status
that some of its paths drop: the run then goes on as if Ctrl-C had never been pressed (seen once in four CI runs of
tests/faults/test_kills.py). `install()` makes the SIGINT handler remember the interrupt as well as raise it, and
`raise_if_interrupted()`, called by the flows once per step, raises it again if it was lost on the way."""

from __future__ import annotations

import signal
import threading

_pending = False


def _on_sigint(signum, frame) -> None:
    global _pending
    _pending = True
    raise KeyboardInterrupt


def install() -> bool:
    """Make Ctrl-C in this process remembered (`raise_if_interrupted`). Only from the main thread, and only over
    Python's default handler (a handler someone else set is kept); returns whether it was installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, _on_sigint):
        return False
    signal.signal(signal.SIGINT, _on_sigint)
    return True


def uninstall() -> None:
    """Back to Python's default SIGINT handler and no pending interrupt (for tests and embedders)."""
    global _pending
    _pending = False
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _on_sigint:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt if Ctrl-C came since `install()` (once: the interrupt is then taken). A no-op
    without `install()`."""
    global _pending
    if _pending:
        _pending = False
        raise KeyboardInterrupt
