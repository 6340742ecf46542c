"""Data shipped with autoscale: the env specs (``envs/``) and the policies (``policies/``).

A wheel carries them as package data (``autoscale/_shipped/``, copied there at build time from the
top-level folders, where users of a checkout look for them); a source checkout or an editable
install reads the top-level folders themselves.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["shipped_dir", "SHIPPED"]

SHIPPED = ("envs", "policies")
_PACKAGE = Path(__file__).resolve().parent


def shipped_dir(kind: str) -> Path | None:
    """The folder of shipped ``kind`` (``"envs"`` or ``"policies"``), or None when this install
    has none."""
    if kind not in SHIPPED:
        raise ValueError(f"unknown kind of shipped data '{kind}' (known: {', '.join(SHIPPED)})")
    packaged = _PACKAGE / "_shipped" / kind
    if packaged.is_dir():
        return packaged
    checkout = _PACKAGE.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / kind).is_dir():
        return checkout / kind
    return None
