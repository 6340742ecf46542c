"""Ctrl-C at safe points: hold SIGINT back across a short critical section, then deliver it.

A ``KeyboardInterrupt`` raised inside ``study.ask()`` after the trial row is written, or inside
``study.tell()``, leaves a trial that nobody tells: it stays RUNNING in the storage. Wrapping such
sections in :func:`deferred_interrupt` makes them atomic with respect to Ctrl-C: a SIGINT that
lands inside is recorded and delivered (``KeyboardInterrupt`` under Python's default handler) as
soon as the section is over, when the loop can still clean up.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["deferred_interrupt"]


class _Held:
    """The SIGINT handler while a section runs: remembers that the signal came."""

    def __init__(self) -> None:
        self.frame: FrameType | None = None
        self.caught = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.caught, self.frame = True, frame


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold SIGINT back for the block; deliver it to the previous handler when the block ends.

    Keep the block short (storage calls, not training): Ctrl-C waits for it. Nested sections
    deliver once, when the outermost ends. Outside the main thread (where Python delivers no
    signals) and when the current handler was not installed from Python, the block runs as is.
    If the block raises and a SIGINT was held, the ``KeyboardInterrupt`` wins (the block's error
    is its ``__context__``).

    Example::

        with deferred_interrupt():
            trial = study.ask()
            trial.set_user_attr("worker", worker)
        # a Ctrl-C during ask() raises KeyboardInterrupt here, with the trial in hand
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or isinstance(previous, _Held):  # not ours to replace, or nested
        yield
        return
    held = _Held()
    signal.signal(signal.SIGINT, held)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held.caught:
            if callable(previous):
                previous(signal.SIGINT, held.frame)
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)  # what the signal would have done
