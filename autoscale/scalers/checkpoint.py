"""A scaler's checkpoint state: written and checked here, primitives only.

:meth:`~autoscale.scalers.scaler.LossScaler.state_dict` keeps GradScaler's keys (``scale``,
``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker``), so tools that
read ``state["scale"]`` and a plain GradScaler still load it, and adds an ``"autoscale"`` entry
with the rule's name, bounds, counters and state (format :data:`STATE_VERSION`). It loads under
``torch.load(weights_only=True)``. :func:`read_state` checks a state before anything is changed,
and names what is wrong in one line.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from autoscale.errors import ConfigError
from autoscale.scalers.controller import ScaleBounds, ScaleController, f32, positive_finite

__all__ = ["STATE_VERSION", "LoadedState", "read_state", "write_state"]

STATE_VERSION = 1
_COUNTERS = ("steps", "skipped", "min_hits")


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
            "min_scale": bounds.min_scale,
            "max_scale": bounds.max_scale,
            **controller.counters(),
            "rule_state": rule_state,
        },
    }


@dataclass(frozen=True)
class LoadedState:
    """A checked state: the scale to continue from (clamped into the scaler's bounds), and the
    rule state and counters to restore (counters None for a plain GradScaler's state)."""

    scale: float
    rule_state: dict[str, Any]
    counters: dict[str, int] | None


def read_state(state_dict: Any, name: str, bounds: ScaleBounds) -> LoadedState:
    """Check ``state_dict`` for a scaler named ``name`` with ``bounds``; warn where the scaler's
    own bounds differ from the checkpoint's or the scale had to be clamped.

    Raises:
        ConfigError: a state of another rule, of a newer autoscale, or with a missing or
            malformed entry (named in the message).
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
        raise ConfigError(
            f"scaler state has scale {scale!r}, not a positive finite number; the checkpoint "
            "is corrupt or was saved after the scale reached 0 or inf"
        ) from None
    ours = state_dict.get("autoscale")
    if ours is None:  # a plain GradScaler's state
        tracker = _item(state_dict.get("_growth_tracker", 0))
        loaded = LoadedState(bounds.clamp(scale), {"growth_tracker": int(tracker)}, None)
    else:
        loaded = LoadedState(bounds.clamp(scale), *_read_ours(ours, name, bounds))
    if loaded.scale != f32(scale):
        warnings.warn(
            f"checkpoint scale {scale:g} lies outside this scaler's [{bounds.min_scale:g}, "
            f"{bounds.max_scale:g}]; continuing from {loaded.scale:g}",
            stacklevel=3,
        )
    return loaded


def _read_ours(ours: Any, name: str, bounds: ScaleBounds) -> tuple[dict[str, Any], dict[str, int]]:
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
    if ours.get("rule") != name:
        raise ConfigError(
            f"scaler state was saved by rule '{ours.get('rule')}', not '{name}'; "
            f"load it with get_scaler('{ours.get('rule')}')"
        )
    missing = [k for k in (*_COUNTERS, "rule_state") if k not in ours]
    if missing:
        raise ConfigError(
            f"scaler state of rule '{name}' lacks {missing}; the checkpoint is corrupt"
        )
    counters = {k: ours[k] for k in _COUNTERS}
    bad = {
        k: v for k, v in counters.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0
    }
    if bad:
        raise ConfigError(
            f"scaler state of rule '{name}' has counters {bad}, not integers >= 0; the "
            "checkpoint is corrupt"
        )
    saved = (ours.get("min_scale"), ours.get("max_scale"))
    if saved != (None, None) and saved != (bounds.min_scale, bounds.max_scale):
        warnings.warn(
            f"checkpoint of rule '{name}' was saved with scale bounds {saved}; this scaler "
            f"keeps its own ({bounds.min_scale:g}, {bounds.max_scale:g})",
            stacklevel=4,
        )
    return ours["rule_state"], counters


def _item(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value
