"""Turn what a user hands an integration (a scaler name or a built scaler) into a LossScaler."""

from __future__ import annotations

from typing import Any

from autoscale.errors import ConfigError
from autoscale.scalers.catalog import make_scaler
from autoscale.scalers.scaler import LossScaler

__all__ = ["resolve_scaler"]


def resolve_scaler(scaler: str | LossScaler, device: str, overrides: dict[str, Any]) -> LossScaler:
    """The scaler an integration installs: ``make_scaler(scaler, device, **overrides)`` for a name,
    the object itself for a built :class:`LossScaler` (checked against ``device``).

    Raises:
        ConfigError: overrides given with a built scaler, a scaler built for another device, or
            something that is neither a name nor a LossScaler (a plain GradScaler, say).
    """
    if isinstance(scaler, str):
        return make_scaler(scaler, device=device, **overrides)
    if not isinstance(scaler, LossScaler):
        raise ConfigError(
            f"scaler must be a registered scaler name or an autoscale LossScaler, got {type(scaler).__name__}; "
            "pass a name such as 'torch' (GradScaler's own rule) or autoscale.get_scaler(NAME)"
        )
    if overrides:
        raise ConfigError(
            f"overrides {sorted(overrides)} apply to a scaler name, not to the built scaler {scaler!r}; "
            f"pass autoscale.get_scaler('{scaler.name}', {', '.join(f'{k}=...' for k in overrides)}) or the name"
        )
    built_for = getattr(scaler, "_device", device)
    if built_for != device:
        raise ConfigError(
            f"scaler {scaler!r} was built for device '{built_for}', but training runs on '{device}'; "
            f"build it with autoscale.get_scaler('{scaler.name}', device='{device}') or pass its name"
        )
    return scaler
