"""Which process on which host: the owner tags that let one process clean up after another that
was killed (stale trials of a search, staging folders of an export); and a Ctrl-C that is not
lost (:func:`sticky_interrupt`)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = [
    "host_name",
    "owner_tag",
    "owner_gone",
    "pid_alive",
    "sticky_interrupt",
    "raise_if_interrupted",
]


def host_name() -> str:
    """This host's name."""
    return socket.gethostname()


def owner_tag() -> str:
    """``host:pid`` of this process."""
    return f"{host_name()}:{os.getpid()}"


def owner_gone(tag: object) -> bool:
    """Whether an :func:`owner_tag` names a process of this host that no longer runs. A tag of
    another host, or anything that is not a tag (None, a malformed string), is not known to be
    gone: its owner may still be at work."""
    host, _, pid = str(tag or "").rpartition(":")
    return host == host_name() and pid.isdigit() and not pid_alive(int(pid))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Sticky:
    """Python's SIGINT handler (raise KeyboardInterrupt), remembering that the signal came until
    :func:`raise_if_interrupted` has seen it."""

    def __init__(self) -> None:
        self.pending = False
        self.deferred = False  # came inside an import or a storage call: raised after it

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.pending = True
        if not self.deferred and _held_back(frame):
            # an exception raised inside an import can leave a module half set up, and a class
            # body's __set_name__ wraps it in a RuntimeError that a caller's `except Exception`
            # takes for a failure (a search then ran on past Ctrl-C); one raised inside a
            # storage call makes SQLAlchemy close the connection under its own cursor and log
            # "Error closing cursor" with a traceback: raised at the next check instead. A
            # second Ctrl-C meanwhile is raised where it lands.
            self.deferred = True
            return
        self.deferred = False  # a held one goes out with this one
        raise KeyboardInterrupt


_HELD_BACK = (
    "<frozen importlib",  # an import
    f"{os.sep}sqlalchemy{os.sep}",  # a storage call: Optuna's RDB storage and its driver
    f"{os.sep}optuna{os.sep}storages{os.sep}",  # any Optuna storage (a journal file's lock)
)


def _held_back(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside an import or a storage call, where a KeyboardInterrupt
    raised at once does harm."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_HELD_BACK[0]) or any(part in name for part in _HELD_BACK[1:]):
            return True
        frame = frame.f_back
    return False


_STICKY: list[_Sticky] = []  # the handler installed by sticky_interrupt, while it is


@contextlib.contextmanager
def sticky_interrupt() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt as usual, and is not lost where Python drops it.

    A KeyboardInterrupt raised while the main thread runs a ``__del__`` or a weakref callback
    (garbage collection of a SQLAlchemy session, say) is printed as "Exception ignored" and goes
    no further: the command runs on as if Ctrl-C had never been pressed. Inside this block the
    handler also remembers the signal, and :func:`raise_if_interrupted` (called at every training
    step and between trials) raises it again where it was dropped; the "Exception ignored"
    traceback of a dropped one is not printed. A Ctrl-C that comes inside an import or a storage
    call (SQLAlchemy, an Optuna storage) is raised after it, at the next check or at the end of
    the block; a second one is raised at once. A SIGINT that is ignored, or handled by the
    program's own handler, stays so; outside the main thread nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield
        return
    handler = _Sticky()
    previous_hook = sys.unraisablehook

    def quiet(unraisable: Any) -> None:  # a dropped Ctrl-C comes out again: no traceback for it
        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and handler.pending):
            previous_hook(unraisable)

    signal.signal(signal.SIGINT, handler)
    sys.unraisablehook = quiet
    _STICKY.append(handler)
    try:
        yield
        if handler.deferred:  # a Ctrl-C that came inside an import and no check saw since
            handler.pending = handler.deferred = False
            raise KeyboardInterrupt
    finally:
        _STICKY.remove(handler)
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGINT, previous)


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt once for a Ctrl-C that came inside :func:`sticky_interrupt` and
    was not seen since; nothing otherwise (a list lookup: cheap enough for every step)."""
    if _STICKY and _STICKY[-1].pending:
        _STICKY[-1].pending = _STICKY[-1].deferred = False
        raise KeyboardInterrupt
