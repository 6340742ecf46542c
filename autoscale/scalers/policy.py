"""Loaders for exported policies, registered with the scaler registry.

A parametric policy is a built-in (or plugin) rule with tuned parameters: loading it is
``get_scaler(family, **parameters)``. Neural policies are loaded by ``PolicyScaler``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autoscale.errors import PolicyError, UnknownNameError
from autoscale.scalers.manifest import PolicyManifest
from autoscale.scalers.registry import get_scaler, register_policy_loader

__all__ = ["load_parametric"]


def load_parametric(
    path: Path, manifest: PolicyManifest, device: str | None, overrides: dict[str, Any]
):
    """Build the rule ``manifest.family`` with the exported parameters (overrides win)."""
    params = {**manifest.parameters, **overrides}
    try:
        scaler = get_scaler(manifest.family, device=device, **params)
    except UnknownNameError as exc:
        raise PolicyError(
            f"policy '{manifest.name}' ({path}) uses rule '{manifest.family}', unknown here: {exc}"
        ) from exc
    scaler.policy_name = manifest.name
    scaler.name = manifest.name  # checkpoints and spec() name the policy, not its rule
    return scaler


register_policy_loader("parametric", load_parametric)
