"""Scaler registry: built-in rules, third-party rules (entry points) and exported policies on disk.

Lookup order for ``get_scaler(name)``: registered rules (built-in and ``register_loss_scaler``),
then rules published by installed packages under the ``autoscale.scalers`` entry-point group,
then exported policies: a folder ``NAME/`` holding ``policy.yaml`` in one of the policy
directories (``$AUTOSCALE_POLICY_PATH``, ``os.pathsep``-separated; then ``./policies``; then the
``policies/`` folder of a source checkout).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoscale.errors import ConfigError, PolicyError, unknown_name

if TYPE_CHECKING:
    from autoscale.scalers.base import LossScaler

__all__ = [
    "register_loss_scaler",
    "get_scaler",
    "list_scalers",
    "ScalerInfo",
    "policy_dirs",
    "find_policy",
    "register_policy_loader",
    "POLICY_PATH_ENV",
    "ENTRY_POINT_GROUP",
]

POLICY_PATH_ENV = "AUTOSCALE_POLICY_PATH"
ENTRY_POINT_GROUP = "autoscale.scalers"
MANIFEST = "policy.yaml"

_RULES: dict[str, type[LossScaler]] = {}
_ENTRY_POINTS_LOADED = False
# kind of exported policy -> loader(path, manifest, device, overrides) -> LossScaler
_POLICY_LOADERS: dict[str, Callable[..., LossScaler]] = {}


@dataclass(frozen=True)
class ScalerInfo:
    """One line of ``autoscale list``."""

    name: str
    kind: str  # "rule", "plugin" or "policy"
    description: str
    defaults: dict[str, Any] = field(default_factory=dict)
    source: str = ""


def register_loss_scaler(
    name: str, *, override: bool = False
) -> Callable[[type[LossScaler]], type[LossScaler]]:
    """Class decorator that registers a :class:`LossScaler` subclass under ``name``.

    Example::

        @register_loss_scaler("my-rule")
        class MyRule(LossScaler):
            def next_scale(self, scale, stats):
                return scale / 2 if stats.found_inf else scale
    """

    def decorator(cls: type[LossScaler]) -> type[LossScaler]:
        from autoscale.scalers.base import LossScaler

        if not (isinstance(cls, type) and issubclass(cls, LossScaler)):
            raise TypeError(
                f"register_loss_scaler('{name}') expects a LossScaler subclass, got {cls!r}"
            )
        if name in _RULES and _RULES[name] is not cls and not override:
            raise ConfigError(
                f"scaler '{name}' is already registered ({_RULES[name].__qualname__}); pass override=True"
            )
        cls.name = name
        _RULES[name] = cls
        return cls

    return decorator


def register_policy_loader(kind: str, loader: Callable[..., LossScaler]) -> None:
    """Make ``get_scaler`` able to load exported policies whose manifest says ``kind: KIND``."""
    _POLICY_LOADERS[kind] = loader


def _builtin() -> None:
    import autoscale.scalers.neural  # noqa: F401  (registers the neural policy loader)
    import autoscale.scalers.policy  # noqa: F401  (registers the parametric policy loader)
    import autoscale.scalers.rules  # noqa: F401  (registers the built-in rules)


def _load_entry_points() -> None:
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _RULES:
            continue
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plugin must not break the built-in rules
            raise ConfigError(
                f"scaler plugin '{ep.name}' ({ep.value}) failed to load: {exc}"
            ) from exc
        register_loss_scaler(ep.name)(cls)
        cls._plugin = True


def policy_dirs() -> list[Path]:
    """The folders searched for exported policies, in order."""
    dirs = [Path(p) for p in os.environ.get(POLICY_PATH_ENV, "").split(os.pathsep) if p]
    dirs.append(Path.cwd() / "policies")
    checkout = Path(__file__).resolve().parents[2] / "policies"
    dirs.append(checkout)
    seen: list[Path] = []
    for d in dirs:
        if d.resolve() not in [s.resolve() for s in seen]:
            seen.append(d)
    return seen


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


def _policy_names() -> list[str]:
    names: list[str] = []
    for d in policy_dirs():
        if d.is_dir():
            names.extend(
                p.name
                for p in sorted(d.iterdir())
                if (p / MANIFEST).is_file() and p.name not in names
            )
    return names


def get_scaler(name: str, device: str | None = None, **overrides: Any) -> LossScaler:
    """Build the scaler registered (or exported) as ``name``.

    Args:
        name: A rule id (``torch``, ``deepspeed``, ...), a plugin's id, an exported policy's name, or
            the path of an exported policy folder.
        device: Device type of the scale tensor; CUDA when present, else CPU.
        **overrides: Keyword arguments of the rule (``init_scale``, ``min_scale``, ...).

    Raises:
        UnknownNameError: ``name`` is nothing known; the message lists what is.
        ConfigError: an override the rule does not take, or an invalid value.
        PolicyError: an exported policy that is corrupt or incompatible.
    """
    _builtin()
    if name not in _RULES:
        _load_entry_points()
    if name in _RULES:
        cls = _RULES[name]
        _check_overrides(name, cls, overrides)
        return cls(device, **overrides)
    path = find_policy(name)
    if path is not None:
        return load_policy(path, device=device, **overrides)
    raise unknown_name("scaler", name, list(_RULES) + _policy_names(), "autoscale list")


def load_policy(path: Path, device: str | None = None, **overrides: Any) -> LossScaler:
    """Load the exported policy in folder ``path`` as a scaler."""
    from autoscale.scalers.manifest import read_manifest

    manifest = read_manifest(path)
    loader = _POLICY_LOADERS.get(manifest.kind)
    if loader is None:
        raise PolicyError(
            f"policy '{path}' has kind '{manifest.kind}', which this autoscale cannot load "
            f"(known: {', '.join(sorted(_POLICY_LOADERS))}); upgrade autoscale or re-export the policy"
        )
    return loader(path, manifest, device, overrides)


def _check_overrides(name: str, cls: type, overrides: dict[str, Any]) -> None:
    accepted = _accepted_params(cls)
    for key in overrides:
        if key not in accepted:
            import difflib

            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(
                f"scaler '{name}' takes no parameter '{key}'; {hint}(it takes: {', '.join(sorted(accepted))})"
            )


def _accepted_params(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass.__module__.startswith("torch"):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind is p.KEYWORD_ONLY and p.name not in names:
                names.append(p.name)
    return names


def rule_defaults(cls: type) -> dict[str, Any]:
    """The keyword defaults of a rule, its own first, then the base class's."""
    out: dict[str, Any] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass.__module__.startswith("torch"):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind is p.KEYWORD_ONLY and p.name not in out and p.default is not p.empty:
                out[p.name] = p.default
    if out.get("min_scale") is None:
        out["min_scale"] = cls.default_min_scale
    if out.get("max_scale") is None:
        out["max_scale"] = cls.default_max_scale
    out.pop("enabled", None)
    out.pop("collect_stats", None)
    return out


def list_scalers() -> list[ScalerInfo]:
    """Every scaler ``get_scaler`` can build: rules, plugins, then exported policies."""
    _builtin()
    _load_entry_points()
    infos = [
        ScalerInfo(
            name,
            "plugin" if getattr(cls, "_plugin", False) else "rule",
            cls.description,
            rule_defaults(cls),
            cls.source,
        )
        for name, cls in _RULES.items()
    ]
    from autoscale.scalers.manifest import read_manifest

    for name in _policy_names():
        path = find_policy(name)
        try:
            m = read_manifest(path)
            infos.append(ScalerInfo(name, "policy", m.describe(), dict(m.parameters), str(path)))
        except PolicyError as exc:
            infos.append(ScalerInfo(name, "policy", f"UNUSABLE: {exc}", {}, str(path)))
    return infos
