"""Which process on which host: the owner tags that let one process clean up after another that
was killed (stale trials of a search, staging folders of an export)."""

from __future__ import annotations

import os
import socket

__all__ = ["host_name", "owner_tag", "pid_alive"]


def host_name() -> str:
    """This host's name."""
    return socket.gethostname()


def owner_tag() -> str:
    """``host:pid`` of this process."""
    return f"{host_name()}:{os.getpid()}"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
