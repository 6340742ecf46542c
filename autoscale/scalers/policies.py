"""What an exported policy is on disk, in one place: the manifest, the kinds of policy, names, where
policies are found, and how one is published.

A policy is a folder ``NAME/`` holding ``policy.yaml`` (a :class:`PolicyManifest`) and, for a neural
policy, ``weights.pt``. Each *kind* (``parametric``, ``neural``, or one a package registers with
:func:`register_policy_kind`) has a loader that turns the folder into a scaler.

Policies are found by name in the folders of :mod:`autoscale.scalers.policy_home` (re-exported
here): ``$AUTOSCALE_POLICY_PATH``, the project's ``./policies``, the user's own folder, the
shipped ones; an export given no folder goes to the user's, found from every working directory.
Publishing stages the folder next to its destination and moves it into place, so a reader never
sees half a policy and an interrupted export leaves none.

Torch and PyYAML only, so that loading a policy at training time needs nothing else.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autoscale.errors import ConfigError, PolicyError
from autoscale.processes import host_name, pid_alive
from autoscale.scalers.policy_home import (
    HOME_ENV,
    POLICY_PATH_ENV,
    default_policy_dir,
    policy_dirs,
    policy_places,
    user_policy_dir,
)
from autoscale.scalers.registry import rule_class
from autoscale.yamlio import load_yaml, yaml_problem

if TYPE_CHECKING:
    from autoscale.scalers.scaler import LossScaler

__all__ = [
    "PolicyManifest",
    "read_manifest",
    "write_manifest",
    "sha256_file",
    "register_policy_kind",
    "policy_kinds",
    "check_policy_name",
    "check_not_shipped",
    "policy_dirs",
    "user_policy_dir",
    "default_policy_dir",
    "policy_places",
    "find_policy",
    "policy_ref",
    "folder_without_manifest",
    "policy_names",
    "policy_rows",
    "load_policy",
    "staged_policy",
    "existing_policy_error",
    "check_export_dest",
    "MANIFEST",
    "MANIFEST_FORMAT",
    "POLICY_PATH_ENV",
    "HOME_ENV",
]

MANIFEST = "policy.yaml"
MANIFEST_FORMAT = 1

#: kind -> loader(path, manifest, device, overrides) -> LossScaler
_KINDS: dict[str, Callable[..., LossScaler]] = {}


@dataclass(frozen=True)
class PolicyManifest:
    """What an exported policy is and where it came from.

    Attributes:
        name: The policy's registry name (its folder name).
        kind: ``"parametric"`` (a rule with tuned knobs), ``"neural"`` (a network in
            ``weights.pt``), or a kind a package registered.
        family: The rule id for a parametric policy; the network architecture for a neural one.
        parameters: Rule keyword arguments, or the network's shape and action mapping.
        feature_version: Version of the feature spec a neural policy reads (None for rules).
        autoscale_version: autoscale's version at export.
        torch_version: torch's version at export.
        workload: What it was searched or trained on (model, scenario, dtype, ...).
        scorecard: Its scorecard on that workload's held-out instances.
        weights_sha256: Checksum of ``weights.pt`` (neural only).
        format: Manifest format version.
    """

    name: str
    kind: str
    family: str
    parameters: dict[str, Any] = field(default_factory=dict)
    feature_version: int | None = None
    autoscale_version: str = ""
    torch_version: str = ""
    workload: dict[str, Any] = field(default_factory=dict)
    scorecard: dict[str, Any] = field(default_factory=dict)
    weights_sha256: str | None = None
    format: int = MANIFEST_FORMAT

    def describe(self) -> str:
        """What it is and where it was made, in one line (``autoscale list``): a suite's
        policy by every split of the suite its workload names (a build such as ``auto``'s
        trains or searches on ``members``, chooses on ``validation`` and tests on ``test``,
        both among ``left_out``); a trial exported by number that the search would not export,
        with the first reason its evidence gives."""
        against = (self.scorecard.get("evidence") or {}).get("not_the_pick")
        not_pick = f"; exported by number, not the search's pick: {against[0]}" if against else ""
        return self._made() + not_pick

    def _made(self) -> str:
        what = f"{self.kind} policy ({self.family})"
        wl = self.workload
        how = "trained on" if self.kind == "neural" else "searched on"
        kept = ""
        if wl.get("exported_policy") or wl.get("builtin_rule"):  # a search found nothing better
            source = f"'{wl['exported_policy']}'" if wl.get("exported_policy") else "the rule"
            how = f"= {source} unchanged, exported by a search on"
            kept = f" = {source} unchanged"
        if wl.get("suite"):
            members, left_out = len(wl.get("members", [])), len(wl.get("left_out", []))
            if "validation" in wl or "test" in wl:
                chosen, tested = len(wl.get("validation", [])), len(wl.get("test", []))
                return (
                    f"{what} chosen on suite '{wl['suite']}', {members + left_out} members: "
                    f"candidates trained or searched on {members}, chosen on "
                    f"{_count(chosen, 'validation member')}, tested on "
                    f"{_count(tested, 'test member')}"
                )
            what += f" {how} suite '{wl['suite']}' ({members} members)"
            return what + (f", {left_out} left out" if left_out else "")
        where = "/".join(str(wl[k]) for k in ("model", "scenario") if k in wl)
        if where:
            return f"{what} {how} {where}"
        return f"{what}{kept}: {wl['note']}" if wl.get("note") else what + kept

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# ---------------------------------------------------------------------- kinds
def register_policy_kind(kind: str, loader: Callable[..., LossScaler]) -> None:
    """Let ``get_scaler`` load policies whose manifest says ``kind: KIND``.

    ``loader(path, manifest, device, overrides)`` returns the scaler.
    """
    if not kind or not isinstance(kind, str):
        raise ConfigError(f"a policy kind must be a non-empty string, got {kind!r}")
    _KINDS[kind] = loader


def policy_kinds() -> tuple[str, ...]:
    """The kinds of policy this autoscale can load."""
    return tuple(sorted(_KINDS))


# ---------------------------------------------------------------------- the manifest
def read_manifest(path: str | os.PathLike) -> PolicyManifest:
    """Read and validate ``path/policy.yaml``.

    Raises:
        PolicyError: missing, unreadable or malformed manifest, an unknown kind, or a newer format.
    """
    folder = Path(path)
    file = folder / MANIFEST
    if not file.is_file():
        raise PolicyError(
            f"no {MANIFEST} in '{folder}'; export a policy there with 'autoscale export'"
        )
    try:
        data = load_yaml(file.read_text())
    except yaml.YAMLError as exc:
        raise PolicyError(
            f"cannot read '{file}': {yaml_problem(exc)}; re-export the policy"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(
            f"cannot read '{file}': {str(exc).splitlines()[0]}; re-export the policy"
        ) from exc
    if not isinstance(data, dict):
        raise PolicyError(f"'{file}' is not a mapping; re-export the policy")
    known = set(PolicyManifest.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise PolicyError(
            f"'{file}' has unknown keys {unknown}; it was written by a newer autoscale, upgrade it"
        )
    for key in ("name", "kind", "family"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise PolicyError(f"'{file}' lacks '{key}'; re-export the policy")
    if data["kind"] not in _KINDS:
        raise PolicyError(
            f"'{file}' has kind '{data['kind']}', which this autoscale cannot load "
            f"(known: {', '.join(policy_kinds())}); upgrade autoscale or install the package that adds it"
        )
    fmt = data.get("format", MANIFEST_FORMAT)
    if isinstance(fmt, bool) or not isinstance(fmt, int):
        raise PolicyError(f"'{file}': format must be an integer, got {fmt!r}; re-export the policy")
    if fmt > MANIFEST_FORMAT:
        raise PolicyError(
            f"'{file}' uses manifest format {fmt}, this autoscale reads up to {MANIFEST_FORMAT}; upgrade autoscale"
        )
    for key in ("parameters", "workload", "scorecard"):
        if data.get(key) is None:
            data[key] = {}
        if not isinstance(data[key], dict):
            raise PolicyError(f"'{file}': '{key}' must be a mapping; re-export the policy")
    return PolicyManifest(**data)


def write_manifest(path: str | os.PathLike, manifest: PolicyManifest) -> Path:
    """Write ``path/policy.yaml`` atomically (a reader never sees half a file)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(_plain(manifest.to_dict()), sort_keys=False)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".policy.", suffix=".yaml")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the policy from other users
    os.replace(tmp, folder / MANIFEST)
    return folder / MANIFEST


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _plain(obj: Any) -> Any:
    """Turn numpy scalars and tuples into YAML-safe primitives."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, str):
        return str(obj)  # str subclasses such as torch's TorchVersion
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    return obj


# ---------------------------------------------------------------------- names and places
def check_policy_name(name: str) -> str:
    """``name`` if it can name a policy: letters, digits, ``-_.``, not hidden, not a rule's name
    (``get_scaler`` finds rules first, so such a policy could never be loaded).

    Raises:
        ConfigError: naming the value and the rule it breaks.
    """
    if (
        not isinstance(name, str)
        or not name
        or not all(c.isalnum() or c in "-_." for c in name)
        or name.startswith(".")
    ):
        raise ConfigError(
            f"policy name '{name}' must use letters, digits, '-', '_' or '.' only (not starting with '.')"
        )
    if rule_class(name) is not None:
        raise ConfigError(f"policy name '{name}' is a built-in rule's name; choose another")
    return name


def check_not_shipped(name: str, root: str | os.PathLike) -> None:
    """Refuse an export named as a policy shipped with autoscale (``auto``) into any folder but
    the shipped one: every folder autoscale looks in comes before the shipped ones, so it would
    stand for that policy in every run and search here, the search's bar included.

    Raises:
        ConfigError: naming the policy and the fix.
    """
    from autoscale.resources import shipped_dir

    shipped = shipped_dir("policies")
    if shipped is None or not (shipped / name / MANIFEST).is_file():
        return
    if Path(root).resolve() != shipped.resolve():
        raise ConfigError(
            f"policy name '{name}' is a policy shipped with autoscale: an export of that name in "
            f"{root} would replace it in every run and search here (a search's bar included); "
            "choose another name"
        )


def find_policy(name: str) -> Path | None:
    """The folder of the exported policy ``name``, or None. A path to a policy folder also works."""
    direct = Path(name)
    if (direct / MANIFEST).is_file():
        return direct
    if os.sep in name or "/" in name:
        return None
    for d in policy_dirs():
        if (d / name / MANIFEST).is_file():
            return d / name
    return None


def policy_ref(folder: str | os.PathLike) -> str:
    """What names the exported policy in ``folder`` to ``get_scaler`` and ``--scaler``: its
    name where :func:`find_policy` finds this folder by it, else the folder's path (an export to
    a folder outside :func:`~autoscale.scalers.policy_home.policy_dirs`, or one whose name an
    earlier folder there holds too)."""
    folder = Path(folder)
    found = find_policy(folder.name)
    if found is not None and found.resolve() == folder.resolve():
        return folder.name
    return str(folder)


def folder_without_manifest(name: str) -> Path | None:
    """The folder ``name`` would be found in (a policy folder's entry, or the path ``name`` when
    it has a separator) if it holds no manifest: a copy or an export that did not finish."""
    if os.sep in name or "/" in name:
        candidates = [Path(name)]
    elif name and not name.startswith("."):
        candidates = [d / name for d in policy_dirs()]
    else:
        candidates = []
    return next((c for c in candidates if c.is_dir() and not (c / MANIFEST).exists()), None)


def policy_names() -> list[str]:
    """Names of every policy found in :func:`policy_dirs` (the first of a name wins); hidden
    folders (an export being staged) are not policies."""
    names: list[str] = []
    for d in policy_dirs():
        if d.is_dir():
            names.extend(
                p.name
                for p in sorted(d.iterdir())
                if not p.name.startswith(".") and (p / MANIFEST).is_file() and p.name not in names
            )
    return names


def policy_rows() -> list[tuple[str, PolicyManifest | None, Path, PolicyError | None]]:
    """(name, manifest, folder, error) of every policy found; a corrupt one has no manifest and
    the error that says why (``autoscale list`` marks it UNUSABLE)."""
    rows: list[tuple[str, PolicyManifest | None, Path, PolicyError | None]] = []
    for name in policy_names():
        path = find_policy(name)
        try:
            rows.append((name, read_manifest(path), path, None))
        except PolicyError as exc:
            rows.append((name, None, path, exc))
    return rows


def load_policy(path: str | os.PathLike, device: str | None = None, **overrides: Any) -> LossScaler:
    """The exported policy in folder ``path`` as a scaler (``overrides`` on top of its parameters).

    Raises:
        PolicyError: a corrupt or incompatible policy.
    """
    path = Path(path)
    manifest = read_manifest(path)
    return _KINDS[manifest.kind](path, manifest, device, overrides)


# ---------------------------------------------------------------------- publishing
def existing_policy_error(
    dest: Path, *, other: bool = False, flag: str | None = None
) -> ConfigError:
    """The one message for an export that would replace a policy without ``--force``;
    ``flag``: the command's option that names the export (``--export``, ``--name``, ...)."""
    what = "already exists and holds another policy" if other else "already exists"
    return ConfigError(f"policy folder '{dest}' {what}; {another_name(flag)}")


def another_name(flag: str | None) -> str:
    """The fix of an export name that is taken, naming the command's option where known."""
    return f"choose another name{f' ({flag} NAME)' if flag else ''} or pass --force"


def check_export_dest(
    name: str,
    folder: str | os.PathLike | None = None,
    force: bool = False,
    flag: str | None = None,
) -> Path:
    """Where an export of ``name`` into ``folder`` (default: :func:`default_policy_dir`) will go,
    checked before any work: a valid name, and no policy there unless ``force`` (``flag``: the
    command's option that names it, for the message).

    Raises:
        ConfigError: an invalid name, or a policy already there without ``force``.
    """
    root = Path(folder or default_policy_dir())
    dest = root / check_policy_name(name)
    check_not_shipped(name, root)
    if dest.exists() and not force:
        raise existing_policy_error(dest, flag=flag)
    return dest


@contextlib.contextmanager
def staged_policy(
    name: str, out_dir: str | os.PathLike | None = None, *, force: bool = False
) -> Iterator[Path]:
    """Stage a policy folder and publish it as ``out_dir/NAME`` when the block succeeds.

    Yields an empty private folder beside the destination; write the policy's files there. On a
    clean exit it is given the usual file modes and moved into place in one rename (an existing
    folder is replaced only with ``force``, through a backup renamed away first); on an exception
    or an interrupt it is removed and nothing is published. Several processes may publish the
    same name at once: one complete policy results (without ``force``, the others are refused;
    with it, the last one to publish stays). What a killed process left (a hidden staging or
    backup folder named after its host and pid) is cleaned up by the next publish of the name on
    that host, which also puts a backed-up policy back if the kill came between its two renames.

    Raises:
        ConfigError: a bad name, or an existing policy without ``force`` (checked before the block
            runs and again when publishing).
    """
    check_policy_name(name)
    root = Path(out_dir) if out_dir else default_policy_dir()
    dest = root / name
    if root.is_dir():
        _clean_dead_staging(root, name)
    if dest.exists() and not force:
        raise existing_policy_error(dest)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=_owned_prefix(name, "staging")))
    try:
        yield tmp
        _publish(tmp, dest, force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _host() -> str:
    return "".join(c if c.isalnum() or c == "-" else "-" for c in host_name())


def _owned_prefix(name: str, what: str) -> str:
    """``.NAME.WHAT.HOST.PID.``: a hidden folder that says which process made it."""
    return f".{name}.{what}.{_host()}.{os.getpid()}."


def _clean_dead_staging(root: Path, name: str) -> None:
    """Remove the staging and backup folders of ``name`` left by dead processes of this host;
    restore a backed-up policy whose replacement never arrived."""
    for what in ("old", "staging"):  # a backup first: it may have to go back into place
        head = f".{name}.{what}.{_host()}."
        for folder in root.glob(glob.escape(head) + "*"):
            pid = folder.name[len(head) :].split(".", 1)[0]
            if not pid.isdigit() or pid_alive(int(pid)):
                continue
            kept = folder / name
            if what == "old" and kept.is_dir() and not (root / name).exists():
                with contextlib.suppress(OSError):
                    os.replace(kept, root / name)
            shutil.rmtree(folder, ignore_errors=True)


def _publish(tmp: Path, dest: Path, force: bool) -> None:
    # mkdtemp/mkstemp make private (0700/0600) entries: give the policy the usual umask modes
    umask = _umask()
    os.chmod(tmp, 0o777 & ~umask)
    for f in tmp.iterdir():
        os.chmod(f, 0o666 & ~umask)
    # Another process may publish the same name between any two of these steps; a rename onto a
    # folder that holds files fails (ENOTEMPTY/EEXIST), and then we look again.
    for _ in range(20):
        if not dest.exists():
            try:
                os.replace(tmp, dest)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            if not force:  # published by another process meanwhile
                raise existing_policy_error(dest)
            continue
        if not force:
            raise existing_policy_error(dest)
        backup = Path(tempfile.mkdtemp(dir=dest.parent, prefix=_owned_prefix(dest.name, "old")))
        try:
            try:
                os.replace(dest, backup / dest.name)
            except FileNotFoundError:  # another process moved it away first
                continue
            try:
                os.replace(tmp, dest)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    with contextlib.suppress(OSError):  # put the old policy back
                        os.replace(backup / dest.name, dest)
                    raise
        finally:
            shutil.rmtree(backup, ignore_errors=True)
    raise ConfigError(
        f"policy folder '{dest}' kept changing while publishing it (other exports of the same "
        "name); export again"
    )
