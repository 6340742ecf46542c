"""A scaler's checkpoint state: written and checked here, primitives only.

:meth:`~autoscale.scalers.scaler.LossScaler.state_dict` keeps GradScaler's keys (``scale``,
``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker``), so tools that
read ``state["scale"]`` and a plain GradScaler still load it, and adds an ``"autoscale"`` entry
with the rule's name, settings (``params``), bounds, counters and state (format
:data:`STATE_VERSION`). It loads under ``torch.load(weights_only=True)``. :func:`read_state` checks
a state before anything is changed, and names what is wrong in one line.

A state saved by the same rule restores the rule's settings too, as GradScaler's
``load_state_dict`` restores ``growth_factor``, ``backoff_factor`` and ``growth_interval``: the
run continues exactly as the saving scaler would have, whatever settings the loading scaler was
built with. A plain GradScaler's state gives the ``torch`` rule those three; a state of an
autoscale that saved no ``params`` gives the three GradScaler keys where the rule has them.

A state saved by another scaler loads too (a plain or sharded GradScaler's, another rule's):
its scale carries over, and the loading rule's own memory (a tracker, a history, a policy's
features) starts fresh, since another rule's memory means nothing to it; one warning says so.
This is what observing a run with ``autoscale wrap --`` and resuming it with ``--scaler auto``
needs. Inside a wrapped program (:func:`load_as_gradscaler`) a state that GradScaler would load
never raises here either: an ``"autoscale"`` entry that cannot be used is set aside with a warning,
and a scale of 0, inf or NaN (a dead run's) continues from the nearest usable one.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from autoscale.errors import ConfigError
from autoscale.scalers.controller import (
    ScaleBounds,
    ScaleController,
    ScaleRule,
    f32,
    positive_finite,
)

__all__ = [
    "KNOBS",
    "rule_for",
    "STATE_VERSION",
    "LoadedState",
    "load_as_gradscaler",
    "read_state",
    "write_state",
]

STATE_VERSION = 1
_COUNTERS = ("steps", "skipped", "min_hits")
#: GradScaler's settings, kept at the top level of every state
KNOBS = ("growth_factor", "backoff_factor", "growth_interval")
#: the rule a plain GradScaler's (or ShardedGradScaler's) state was saved by
GRADSCALER_RULE = "torch"
_lenient = {"on": False}


def load_as_gradscaler(on: bool = True) -> None:
    """In this process, load every state that torch's GradScaler would load without raising: an
    ``"autoscale"`` entry that is corrupt or of a newer autoscale is set aside (the state loads as
    a GradScaler's), with a warning. ``autoscale wrap`` sets it in the program it runs, so that
    nothing raises there that would not raise without the wrap."""
    _lenient["on"] = bool(on)


def write_state(
    name: str, scale: float, knobs: dict[str, Any], controller: ScaleController
) -> dict[str, Any]:
    """The state dict of a scaler named ``name`` at ``scale`` (``knobs``: GradScaler's three)."""
    rule_state = controller.rule.state()
    bounds = controller.bounds
    return {
        "scale": scale,
        **knobs,
        "_growth_tracker": int(rule_state.get("growth_tracker", 0)),
        "autoscale": {
            "version": STATE_VERSION,
            "rule": name,
            "params": controller.rule.params(),
            "min_scale": bounds.min_scale,
            "max_scale": bounds.max_scale,
            **controller.counters(),
            "rule_state": rule_state,
        },
    }


@dataclass(frozen=True)
class LoadedState:
    """A checked state: the scale to continue from (clamped into the scaler's bounds), the rule
    state and counters to restore (counters None for a plain GradScaler's state), and the rule's
    settings the state was saved with (None: another rule's state, whose settings are not this
    rule's; the loading rule keeps those of its keys that the state does not name)."""

    scale: float
    rule_state: dict[str, Any]
    counters: dict[str, int] | None
    params: dict[str, Any] | None = None


def read_state(state_dict: Any, name: str, bounds: ScaleBounds) -> LoadedState:
    """Check ``state_dict`` for a scaler named ``name`` with ``bounds``; warn where the scaler's
    own bounds differ from the checkpoint's or the scale had to be clamped. A state saved by
    another rule (or a GradScaler, into a rule other than ``torch``) gives its scale and the
    counters, with an empty rule state: the rule starts its memory fresh (one warning).

    Raises:
        ConfigError: a state of a newer autoscale, or with a missing or malformed entry (named
            in the message; inside a wrapped program only a scale that is not a number).
        RuntimeError: an empty state (GradScaler's message: saved from a disabled scaler).
    """
    if not isinstance(state_dict, dict):
        raise ConfigError(
            f"scaler state must be a mapping (a state_dict()), got {type(state_dict).__name__}"
        )
    if len(state_dict) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved "
            "from a disabled instance of GradScaler."
        )
    scale = _item(state_dict.get("scale"))
    try:
        scale = positive_finite("scale", scale)
    except ConfigError:
        msg = (
            f"scaler state has scale {scale!r}, not a positive finite number; the checkpoint "
            "is corrupt or was saved after the scale reached 0 or inf"
        )
        if not _lenient["on"] or not isinstance(scale, int | float):
            raise ConfigError(msg) from None
        # GradScaler loads it (and its run is dead); a wrapped program continues from the
        # nearest scale that is not: the minimum for 0, the maximum for inf, 2^16 for NaN
        scale = bounds.clamp(2.0**16 if scale != scale else max(float(scale), 0.0))
        warnings.warn(f"{msg}; continuing from {scale:g}", stacklevel=3)
    ours = state_dict.get("autoscale")
    if ours is not None:
        try:
            _check_ours(ours)
        except ConfigError as exc:
            if not _lenient["on"]:
                raise
            warnings.warn(f"{exc}; it is loaded as a GradScaler's state", stacklevel=3)
            ours = None
    saved_by = GRADSCALER_RULE if ours is None else ours["rule"]
    clamped = bounds.clamp(scale)
    if saved_by != name:  # the scale carries over; the other rule's memory means nothing here
        clamp = (
            "" if clamped == f32(scale) else f" (clamped into this scaler's bounds: {clamped:g})"
        )
        what = "a GradScaler" if ours is None else f"rule '{saved_by}'"
        warnings.warn(
            f"scaler state saved by {what} loads into '{name}': its scale {scale:g} carries "
            f"over{clamp}, the rule's own memory starts fresh",
            stacklevel=3,
        )
        return LoadedState(clamped, {}, None if ours is None else _counters(ours))
    if ours is None:  # a plain GradScaler's state, into the rule that reproduces GradScaler
        tracker = _item(state_dict.get("_growth_tracker", 0))
        loaded = LoadedState(
            clamped, {"growth_tracker": int(tracker)}, None, _settings(state_dict, None, name)
        )
    else:
        saved = (ours.get("min_scale"), ours.get("max_scale"))
        if saved != (None, None) and saved != (bounds.min_scale, bounds.max_scale):
            warnings.warn(
                f"checkpoint of rule '{name}' was saved with scale bounds {saved}; this scaler "
                f"keeps its own ({bounds.min_scale:g}, {bounds.max_scale:g})",
                stacklevel=3,
            )
        loaded = LoadedState(
            clamped, ours["rule_state"], _counters(ours), _settings(state_dict, ours, name)
        )
    if loaded.scale != f32(scale):
        warnings.warn(
            f"checkpoint scale {scale:g} lies outside this scaler's [{bounds.min_scale:g}, "
            f"{bounds.max_scale:g}]; continuing from {loaded.scale:g}",
            stacklevel=3,
        )
    return loaded


def rule_for(controller: ScaleController, loaded: LoadedState, name: str) -> ScaleRule:
    """The rule a scaler named ``name`` continues with after loading ``loaded``: its own, or
    one of its class with the settings the state was saved with
    (:meth:`~autoscale.scalers.controller.ScaleController.with_params`), its state loaded.

    Raises:
        ConfigError: settings or a rule state the rule refuses (inside a wrapped program,
            settings it refuses are set aside with a warning: it keeps its own).
    """
    rule = controller.rule
    if loaded.params:
        try:
            rebuilt = controller.with_params(loaded.params)
        except ConfigError as exc:
            if not _lenient["on"]:
                raise ConfigError(f"checkpoint of '{name}': {exc}") from None
            warnings.warn(f"checkpoint of '{name}': {exc}; it keeps its own", stacklevel=3)
        else:
            if rebuilt is None:
                warnings.warn(
                    f"checkpoint of '{name}' was saved with other settings, which its rule "
                    "cannot be rebuilt from; it keeps its own",
                    stacklevel=3,
                )
            else:
                rule = rebuilt
    rule.load_state(loaded.rule_state)
    return rule


def _check_ours(ours: Any) -> None:
    """Raise ConfigError, naming what is wrong, where the ``"autoscale"`` entry cannot be used."""
    if not isinstance(ours, dict):
        raise ConfigError(
            "scaler state's 'autoscale' entry must be a mapping; the checkpoint is corrupt"
        )
    version = ours.get("version", STATE_VERSION)
    if not isinstance(version, int) or version > STATE_VERSION:
        raise ConfigError(
            f"scaler state has format {version!r}, this autoscale reads up to {STATE_VERSION}; "
            "upgrade autoscale to load it"
        )
    name = ours.get("rule")
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"scaler state's 'autoscale' entry names no rule (got {name!r}); the checkpoint is "
            "corrupt"
        )
    params = ours.get("params")
    if params is not None and (
        not isinstance(params, dict) or not all(isinstance(k, str) for k in params)
    ):
        raise ConfigError(
            f"scaler state of rule '{name}' has params {params!r}, not a mapping of names to "
            "values; the checkpoint is corrupt"
        )
    missing = [k for k in (*_COUNTERS, "rule_state") if k not in ours]
    if missing:
        raise ConfigError(
            f"scaler state of rule '{name}' lacks {missing}; the checkpoint is corrupt"
        )
    bad = {
        k: ours[k]
        for k in _COUNTERS
        if isinstance(ours[k], bool) or not isinstance(ours[k], int) or ours[k] < 0
    }
    if bad:
        raise ConfigError(
            f"scaler state of rule '{name}' has counters {bad}, not integers >= 0; the "
            "checkpoint is corrupt"
        )


def _settings(state_dict: dict[str, Any], ours: dict[str, Any] | None, name: str) -> dict:
    """The settings a state of rule ``name`` was saved with: its ``params``, else GradScaler's
    three at the top level (those it has). Inside a wrapped program, settings that are not
    numbers are set aside with a warning (the rule keeps its own), as GradScaler loads them."""
    if ours is not None and ours.get("params") is not None:
        return dict(ours["params"])
    knobs = {k: _item(state_dict[k]) for k in KNOBS if k in state_dict}
    bad = {
        k: v
        for k, v in knobs.items()
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
    }
    if bad:
        msg = f"scaler state for '{name}' has settings {bad}, not finite numbers"
        if not _lenient["on"]:
            raise ConfigError(f"{msg}; the checkpoint is corrupt")
        warnings.warn(f"{msg}; the rule keeps its own settings", stacklevel=4)
        return {}
    return knobs


def _counters(ours: dict[str, Any]) -> dict[str, int]:
    return {k: ours[k] for k in _COUNTERS}


def _item(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value
