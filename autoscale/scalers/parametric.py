"""The ``parametric`` kind of exported policy: a registered rule with tuned parameters.

Loading one is ``get_scaler(family, **parameters)`` under the policy's own name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autoscale.errors import PolicyError
from autoscale.scalers.policies import PolicyManifest, register_policy_kind
from autoscale.scalers.registry import build_scaler, rule_class
from autoscale.scalers.scaler import LossScaler

__all__ = ["load_parametric"]


def load_parametric(
    path: Path, manifest: PolicyManifest, device: str | None, overrides: dict[str, Any]
) -> LossScaler:
    """Build the rule ``manifest.family`` with the exported parameters (overrides win)."""
    cls = rule_class(manifest.family)
    if cls is None:
        raise PolicyError(
            f"policy '{manifest.name}' ({path}) uses rule '{manifest.family}', which is not registered "
            "here; install the package that provides it (autoscale list shows the rules)"
        )
    params = {**manifest.parameters, **overrides}
    return build_scaler(cls, device, params, name=manifest.name)


register_policy_kind("parametric", load_parametric)
