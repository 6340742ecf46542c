"""Where exported policies live, in one place: the folders searched for a policy's name, in
order, and the folder an export goes to when it is given none.

1. ``$AUTOSCALE_POLICY_PATH`` (``os.pathsep``-separated): folders a user or a team points at;
2. ``./policies``: the project's own, in the working directory;
3. the user's folder (:func:`user_policy_dir`): ``$AUTOSCALE_HOME/policies``, else
   ``$XDG_DATA_HOME/autoscale/policies``, else ``~/.local/share/autoscale/policies``, the same
   from every working directory, as other ML tools keep their caches;
4. the policies shipped with autoscale.

An export goes to the first folder of ``$AUTOSCALE_POLICY_PATH``, else to the user's folder
(:func:`default_policy_dir`), so a policy exported in one folder is found from every other.
Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "HOME_ENV",
    "POLICY_PATH_ENV",
    "default_policy_dir",
    "policy_dirs",
    "policy_places",
    "user_policy_dir",
]

POLICY_PATH_ENV = "AUTOSCALE_POLICY_PATH"
#: autoscale's folder of the user's own data; policies go to its ``policies/``
HOME_ENV = "AUTOSCALE_HOME"


def user_policy_dir() -> Path:
    """The user's own folder of exported policies, the same from every working directory:
    ``$AUTOSCALE_HOME/policies``, else ``$XDG_DATA_HOME/autoscale/policies`` (an absolute
    ``XDG_DATA_HOME`` only, as the XDG spec asks), else ``~/.local/share/autoscale/policies``."""
    home = os.environ.get(HOME_ENV, "").strip()
    if home:
        return Path(home).expanduser() / "policies"
    data = os.environ.get("XDG_DATA_HOME", "").strip()
    base = Path(data) if data and Path(data).is_absolute() else Path.home() / ".local" / "share"
    return base / "autoscale" / "policies"


def _places() -> list[tuple[str, Path]]:
    """(what put it there, folder) of every folder searched for policies, in order."""
    from autoscale.resources import shipped_dir

    places = [
        (POLICY_PATH_ENV, Path(p))
        for p in os.environ.get(POLICY_PATH_ENV, "").split(os.pathsep)
        if p
    ]
    places += [("./policies", Path.cwd() / "policies"), ("the user's", user_policy_dir())]
    shipped = shipped_dir("policies")
    if shipped is not None:
        places.append(("shipped", shipped))
    seen: list[tuple[str, Path]] = []
    for what, d in places:
        if d.resolve() not in [s.resolve() for _, s in seen]:
            seen.append((what, d))
    return seen


def policy_dirs() -> list[Path]:
    """The folders searched for exported policies, in order: ``$AUTOSCALE_POLICY_PATH``,
    ``./policies``, the user's (:func:`user_policy_dir`), the policies shipped with autoscale."""
    return [d for _, d in _places()]


def policy_places() -> str:
    """The folders :func:`find_policy` searches, in order and in words (for ``autoscale list``
    and the error for an unknown name): each with what puts it there."""
    words = {
        POLICY_PATH_ENV: "${} ({})".format,
        "./policies": "{} ({})".format,
        "the user's": "the user's folder {1}".format,
        "shipped": "the shipped ones ({1})".format,
    }
    places = _places()
    said = [words[what](what, d) for what, d in places]
    if not any(what == POLICY_PATH_ENV for what, _ in places):
        said.insert(0, f"${POLICY_PATH_ENV} (not set)")
    return f"{', '.join(said[:-1])} and {said[-1]}"


def default_policy_dir() -> Path:
    """Where exports go: the first entry of ``$AUTOSCALE_POLICY_PATH``, else the user's folder
    (:func:`user_policy_dir`), found from every working directory."""
    env = [p for p in os.environ.get(POLICY_PATH_ENV, "").split(os.pathsep) if p]
    return Path(env[0]) if env else user_policy_dir()
