"""Scaler registry: built-in rules, third-party rules (entry points) and exported policies on disk.

Lookup order for ``get_scaler(name)``: registered rules (built-in and ``register_loss_scaler``),
then rules published by installed packages under the ``autoscale.scalers`` entry-point group,
then exported policies (:mod:`autoscale.scalers.policies`). A plugin that fails to load is
reported (a warning, a line in ``autoscale list``, the error of ``get_scaler`` for its name) and the
other plugins still load.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any

from autoscale.errors import ConfigError, PolicyError, unknown_name
from autoscale.scalers.rule import ScaleRule

if TYPE_CHECKING:
    from autoscale.scalers.base import LossScaler

__all__ = [
    "register_loss_scaler",
    "get_scaler",
    "build_scaler",
    "list_scalers",
    "rule_class",
    "rule_names",
    "rule_defaults",
    "plugin_errors",
    "ScalerInfo",
    "SCALER_OPTIONS",
    "ENTRY_POINT_GROUP",
]

ENTRY_POINT_GROUP = "autoscale.scalers"
#: Keyword arguments every scaler takes, whatever its rule (LossScaler's own).
SCALER_OPTIONS = (
    "init_scale",
    "min_scale",
    "max_scale",
    "raise_at_min",
    "collect_stats",
    "enabled",
    "process_group",
    "identical_grads",
)

_RULES: dict[str, type[ScaleRule]] = {}
_PLUGINS: set[str] = set()
_PLUGIN_ERRORS: dict[str, str] = {}
_ENTRY_POINTS_LOADED = False


@dataclass(frozen=True)
class ScalerInfo:
    """One line of ``autoscale list``."""

    name: str
    kind: str  # "rule", "plugin" or "policy"
    description: str
    defaults: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def usable(self) -> bool:
        return not self.description.startswith("UNUSABLE")


def register_loss_scaler(
    name: str, *, override: bool = False
) -> Callable[[type[ScaleRule]], type[ScaleRule]]:
    """Class decorator that registers a :class:`~autoscale.scalers.rule.ScaleRule` as ``name``.

    ``get_scaler(name)`` then hosts the rule in a GradScaler. Example::

        @register_loss_scaler("halve-only")
        class HalveOnly(ScaleRule):
            def next_scale(self, scale, stats):
                return scale / 2 if stats.found_inf else scale
    """

    def decorator(cls: type[ScaleRule]) -> type[ScaleRule]:
        if not (isinstance(cls, type) and issubclass(cls, ScaleRule)):
            raise TypeError(
                f"register_loss_scaler('{name}') expects a ScaleRule subclass, got {cls!r}; a rule "
                "decides next_scale(scale, stats) and get_scaler hosts it in a GradScaler"
            )
        if name in _RULES and _RULES[name] is not cls and not override:
            raise ConfigError(
                f"scaler '{name}' is already registered ({_RULES[name].__qualname__}); pass override=True"
            )
        cls.name = name
        _RULES[name] = cls
        return cls

    return decorator


def _builtin() -> None:
    import autoscale.scalers.rules  # noqa: F401  (registers the built-in rules)


def _load_entry_points() -> None:
    """Load every plugin once per process; one that fails is recorded and warned about, alone."""
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _RULES:
            continue
        try:
            cls = ep.load()
            register_loss_scaler(ep.name)(cls)
        except Exception as exc:  # a broken plugin must not break the others
            first = (str(exc).splitlines() or [""])[0]
            _PLUGIN_ERRORS[ep.name] = f"{ep.value} failed to load: {type(exc).__name__}: {first}"
            warnings.warn(
                f"scaler plugin '{ep.name}' ({_PLUGIN_ERRORS[ep.name]}); the other scalers work, "
                "fix or uninstall the package that publishes it",
                stacklevel=3,
            )
            continue
        _PLUGINS.add(ep.name)


def plugin_errors() -> dict[str, str]:
    """Entry-point name -> why that plugin failed to load."""
    _load_entry_points()
    return dict(_PLUGIN_ERRORS)


def rule_class(name: str) -> type[ScaleRule] | None:
    """The rule registered (or published by a plugin) as ``name``, or None."""
    _builtin()
    if name not in _RULES:
        _load_entry_points()
    return _RULES.get(name)


def rule_names() -> list[str]:
    """Every registered rule's name (built-in and plugins that loaded)."""
    _builtin()
    _load_entry_points()
    return list(_RULES)


def build_scaler(
    cls: type[ScaleRule],
    device: str | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    what: str | None = None,
) -> LossScaler:
    """Host a new ``cls`` rule in a scaler: ``overrides`` split into the rule's parameters and the
    scaler's options (:data:`SCALER_OPTIONS`).

    Args:
        name: The scaler's name (an exported policy's); default the rule's.
        what: How error messages name the scaler; default ``name``.

    Raises:
        ConfigError: a keyword neither takes (nearest valid one suggested), or an invalid value.
    """
    from autoscale.scalers.base import LossScaler

    overrides = dict(overrides or {})
    what = what or name or cls.name
    params = _rule_params(cls)
    for key in overrides:
        if key not in params and key not in SCALER_OPTIONS:
            accepted = params + list(SCALER_OPTIONS)
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(
                f"scaler '{what}' takes no parameter '{key}'; {hint}(it takes: {', '.join(sorted(accepted))})"
            )
    options = {k: overrides.pop(k) for k in SCALER_OPTIONS if k in overrides}
    try:
        rule = cls(**overrides)
    except TypeError as exc:  # a parameter of the wrong kind
        raise ConfigError(f"scaler '{what}': {exc}") from None
    return LossScaler(rule, device, name=name, **options)


def get_scaler(name: str, device: str | None = None, **overrides: Any) -> LossScaler:
    """Build the scaler registered (or exported) as ``name``.

    Args:
        name: A rule id (``torch``, ``deepspeed``, ...), a plugin's id, an exported policy's name, or
            the path of an exported policy folder.
        device: Device type of the scale tensor; CUDA when present, else CPU.
        **overrides: The rule's keyword arguments, and the scaler's (``init_scale``, ``min_scale``,
            ``max_scale``, ``raise_at_min``, ``collect_stats``, ``enabled``).

    Raises:
        UnknownNameError: ``name`` is nothing known; the message lists what is.
        ConfigError: an override the rule does not take, an invalid value, or a plugin that failed
            to load.
        PolicyError: an exported policy that is corrupt or incompatible.
    """
    from autoscale.scalers import policies

    cls = rule_class(name)
    if cls is not None:
        return build_scaler(cls, device, overrides)
    if name in _PLUGIN_ERRORS:
        raise ConfigError(
            f"scaler plugin '{name}' ({_PLUGIN_ERRORS[name]}); fix or reinstall the package that publishes it"
        )
    path = policies.find_policy(name)
    if path is not None:
        return policies.load_policy(path, device=device, **overrides)
    broken = policies.folder_without_manifest(name)
    if broken is not None:
        raise PolicyError(
            f"policy folder '{broken}' has no {policies.MANIFEST} (a copy or an export that did "
            "not finish); export the policy again, or remove the folder"
        )
    raise unknown_name("scaler", name, list(_RULES) + policies.policy_names(), "autoscale list")


def _rule_params(cls: type) -> list[str]:
    """The keyword parameters of a rule class's ``__init__`` (its own and its bases')."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind is p.KEYWORD_ONLY and p.name not in names:
                names.append(p.name)
    return names


def rule_defaults(cls: type[ScaleRule]) -> dict[str, Any]:
    """The defaults of a scaler of rule ``cls``: its parameters', then the scale bounds'."""
    out: dict[str, Any] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind is p.KEYWORD_ONLY and p.name not in out and p.default is not p.empty:
                out[p.name] = p.default
    out.update(
        init_scale=cls.default_init_scale,
        min_scale=cls.default_min_scale,
        max_scale=cls.default_max_scale,
        raise_at_min=False,
    )
    return out


def list_scalers() -> list[ScalerInfo]:
    """Every scaler ``get_scaler`` can build: rules, plugins (broken ones marked UNUSABLE), then
    exported policies (corrupt ones marked UNUSABLE)."""
    from autoscale.scalers import policies

    names = rule_names()
    infos = [
        ScalerInfo(
            name,
            "plugin" if name in _PLUGINS else "rule",
            cls.description,
            rule_defaults(cls),
            cls.source,
        )
        for name in names
        for cls in (_RULES[name],)
    ]
    infos += [
        ScalerInfo(name, "plugin", f"UNUSABLE: {error}", {}, "")
        for name, error in _PLUGIN_ERRORS.items()
    ]
    return infos + policies.policy_infos()
