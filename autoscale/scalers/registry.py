"""The registry of rules: the built-in ones (:data:`~autoscale.scalers.rules.BUILTIN_RULES`),
those registered with :func:`register_loss_scaler`, and those installed packages publish under
the ``autoscale.scalers`` entry-point group. A plugin that fails to load is reported (a warning,
a line in ``autoscale list``, the error of ``get_scaler`` for its name) and the other plugins
still load. Names across rules and exported policies are resolved by
:mod:`~autoscale.scalers.catalog`.
"""

from __future__ import annotations

import difflib
import inspect
import numbers
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import Any

from autoscale.errors import ConfigError
from autoscale.scalers.controller import ScaleRule
from autoscale.scalers.rules import BUILTIN_RULES
from autoscale.scalers.scaler import LossScaler

__all__ = [
    "register_loss_scaler",
    "build_scaler",
    "build_rule",
    "rule_class",
    "rule_names",
    "rule_defaults",
    "rule_params",
    "is_plugin",
    "plugin_errors",
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

_RULES: dict[str, type[ScaleRule]] = dict(BUILTIN_RULES)
_PLUGINS: set[str] = set()
_PLUGIN_ERRORS: dict[str, str] = {}
_ENTRY_POINTS_LOADED = False


def register_loss_scaler(
    name: str, *, override: bool = False
) -> Callable[[type[ScaleRule]], type[ScaleRule]]:
    """Class decorator that registers a :class:`~autoscale.scalers.controller.ScaleRule` as ``name``.

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


def is_plugin(name: str) -> bool:
    """Whether the rule ``name`` came from an installed package's entry point."""
    return name in _PLUGINS


def plugin_errors() -> dict[str, str]:
    """Entry-point name -> why that plugin failed to load."""
    _load_entry_points()
    return dict(_PLUGIN_ERRORS)


def rule_class(name: str) -> type[ScaleRule] | None:
    """The rule registered (or published by a plugin) as ``name``, or None."""
    if name not in _RULES:
        _load_entry_points()
    return _RULES.get(name)


def rule_names() -> list[str]:
    """Every registered rule's name (built-in and plugins that loaded)."""
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
    what = what or name or cls.name
    rule, options = build_rule(cls, overrides, what)
    return LossScaler(rule, device, name=name, **options)


def build_rule(
    cls: type[ScaleRule], overrides: dict[str, Any] | None, what: str
) -> tuple[ScaleRule, dict[str, Any]]:
    """:func:`build_scaler`'s checks and rule, without a scaler (none is announced to what
    watches scalers being built): ``(rule, the scaler's options)``.

    Raises:
        ConfigError: as :func:`build_scaler`, naming the scaler ``what``.
    """
    overrides = dict(overrides or {})
    params = rule_params(cls)
    for key in overrides:
        if key not in params and key not in SCALER_OPTIONS:
            accepted = params + list(SCALER_OPTIONS)
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(
                f"scaler '{what}' takes no parameter '{key}'; {hint}(it takes: {', '.join(sorted(accepted))})"
            )
    defaults = _defaults(cls)
    overrides = {k: _of_kind(defaults.get(k), k, v, what) for k, v in overrides.items()}
    options = {k: overrides.pop(k) for k in SCALER_OPTIONS if k in overrides}
    try:
        rule = cls(**overrides)
    except (TypeError, ValueError) as exc:  # a parameter of the wrong kind
        raise ConfigError(f"scaler '{what}': {exc}") from None
    return rule, options


def _of_kind(default: Any, key: str, value: Any, what: str) -> Any:
    """``value`` for the parameter ``key``, of the kind its ``default`` is: true or false for a
    switch (or 0, 1, None); a number for a number (a string that reads as one, as YAML 1.1
    leaves ``1e-4``, is read).

    Raises:
        ConfigError: another kind, naming the parameter and the value."""
    if isinstance(default, bool):  # (0, 1 and None read as torch's GradScaler reads them)
        if not (value is None or type(value).__name__ == "bool_" or value in (0, 1)):
            raise ConfigError(f"scaler '{what}': {key} must be true or false, got {value!r}")
        return bool(value)
    if isinstance(default, numbers.Real) and not isinstance(value, numbers.Real):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"scaler '{what}': {key} must be a number (its default is {default!r}), "
                f"got {value!r}"
            ) from None
        return int(number) if isinstance(default, int) and number.is_integer() else number
    return value


def _defaults(cls: type) -> dict[str, Any]:
    """The keyword parameters' defaults of a rule class (its own and its bases') and of the
    scaler that hosts it."""
    out: dict[str, Any] = {}
    for klass in (*cls.__mro__, LossScaler):
        if "__init__" not in vars(klass) or klass is object:
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.default is not p.empty:
                out.setdefault(p.name, p.default)
    return out


def rule_params(cls: type) -> list[str]:
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
