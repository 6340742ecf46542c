"""Ctrl-C at safe points: :func:`deferred_interrupt` holds SIGINT back across a short critical
section and delivers it after, :func:`interruptible` lets it through inside one. A
``KeyboardInterrupt`` inside ``study.ask()`` or ``study.tell()`` would leave a trial RUNNING that
nobody tells.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["deferred_interrupt", "interruptible"]


class _Held:
    """The SIGINT handler while a section runs: remembers that the signal came."""

    def __init__(self, previous: object = None) -> None:
        self.frame: FrameType | None = None
        self.caught = False
        self.previous = previous

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.caught, self.frame = True, frame


def _deliver(previous: object, frame: FrameType | None) -> None:
    if callable(previous):
        previous(signal.SIGINT, frame)
    elif previous == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)  # what the signal would have done


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold SIGINT back for the block; deliver it to the previous handler when the block ends.

    Keep the block short (storage calls, not training): Ctrl-C waits for it. Nested sections
    deliver once, when the outermost ends; outside the main thread, or under a handler not
    installed from Python, the block runs as is. A held SIGINT's ``KeyboardInterrupt`` wins over
    the block's own error (its ``__context__``).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or isinstance(previous, _Held):  # not ours to replace, or nested
        yield
        return
    held = _Held(previous)
    signal.signal(signal.SIGINT, held)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held.caught:
            _deliver(previous, held.frame)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside a :func:`deferred_interrupt` section, let Ctrl-C through for the block (a trial's
    objective): a SIGINT held so far is delivered on entry. Outside one it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = signal.getsignal(signal.SIGINT)
    if not isinstance(held, _Held):
        yield
        return
    signal.signal(signal.SIGINT, held.previous)
    try:
        if held.caught:
            held.caught = False
            _deliver(held.previous, held.frame)
        yield
    finally:
        signal.signal(signal.SIGINT, held)
