"""Real-step measurements of an ``auto`` build, kept on disk so that a stopped build resumes.

A build runs real training steps for hours (:mod:`autoscale.selection.auto`); a machine that
stops it (a scheduler, a reboot, a session's end) must not cost what it measured. Each held-out
episode, each confirming set of episodes and each long run is stored as it finishes, under a key
made of everything that decides its result:

- the candidate's identity (its rule and parameters, or the hash of an agent's or a policy's
  files; never its label alone: two agents trained under one label are two candidates);
- the member's workload and episode settings, the instance (seed and start) and the steps;
- the code that runs the steps (a hash of ``autoscale/training``, ``scalers``, ``envs`` and
  ``agents``) and torch's version.

Change any of those and the old measurement is not found, so nothing stale is read back. A
candidate without an identity (one the caller did not name) is measured and never stored.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["Measured", "code_version", "files_hash"]

_PACKAGE = Path(__file__).resolve().parents[1]
_CODE = ("training", "scalers", "envs", "agents")  # what runs a real step


def files_hash(paths: Iterable[Path]) -> str:
    """SHA-256 of the files' relative names and bytes, in name order (folders: their files)."""
    files: list[tuple[str, Path]] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files += [(str(f.relative_to(p)), f) for f in p.rglob("*") if f.is_file()]
        elif p.is_file():
            files.append((p.name, p))
    h = hashlib.sha256()
    for name, f in sorted(files, key=lambda x: x[0]):
        if "__pycache__" in f.parts or name.startswith("."):
            continue
        h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def code_version() -> str:
    """A hash of the package code that runs real steps, and torch's version."""
    import torch

    pyfiles = [f for d in _CODE for f in sorted((_PACKAGE / d).rglob("*.py"))]
    return files_hash(pyfiles)[:16] + "-torch" + torch.__version__


class Measured:
    """A folder of stored measurements. ``identities``: candidate label -> identity (see the
    module's docstring); labels missing from it are measured and never stored."""

    def __init__(self, root: Path, identities: dict[str, str]) -> None:
        self.root = Path(root)
        self.identities = dict(identities)
        self.code = code_version()
        self.hits = self.stored = 0

    def path(self, scaler: str, *what: Any) -> Path | None:
        """Where the measurement ``what`` of ``scaler`` lives (None: ``scaler`` has no identity)."""
        ident = self.identities.get(scaler)
        if ident is None:
            return None
        text = json.dumps([self.code, ident, *map(repr, what)])
        h = hashlib.sha256(text.encode()).hexdigest()
        return self.root / h[:2] / f"{h}.json"

    def get(self, path: Path | None) -> Any | None:
        """The stored value, or None (never stored, or a partial or unreadable file)."""
        if path is None or not path.is_file():
            return None
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        self.hits += 1
        return value

    def put(self, path: Path | None, value: Any) -> None:
        """Store ``value`` (JSON; NaN and inf as Python's json writes them), whole or not at all."""
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
        self.stored += 1
