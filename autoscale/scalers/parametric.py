"""The ``parametric`` kind of exported policy: a registered rule with tuned parameters.

Loading one is ``get_scaler(family, **parameters)`` under the policy's own name.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError, PolicyError
from autoscale.scalers.policies import MANIFEST, PolicyManifest, register_policy_kind
from autoscale.scalers.registry import build_rule, build_scaler, rule_class, rule_names
from autoscale.scalers.scaler import LossScaler

__all__ = ["load_parametric"]


def load_parametric(
    path: Path, manifest: PolicyManifest, device: str | None, overrides: dict[str, Any]
) -> LossScaler:
    """Build the rule ``manifest.family`` with the exported parameters (overrides win).

    Raises:
        PolicyError: the file names a rule not registered here, or parameters the rule refuses
            (the message names the file and the nearest rule); a refused override is the
            caller's ConfigError, as for a rule.
    """
    where = f"policy '{path.name}' ({path / MANIFEST})"
    cls = rule_class(manifest.family)
    if cls is None:
        near = difflib.get_close_matches(manifest.family, rule_names(), n=1, cutoff=0.6)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise PolicyError(
            f"{where} uses rule '{manifest.family}', which is not registered here{hint}; fix its "
            "family or export the policy again (a rule of a plugin needs its package installed; "
            "autoscale list shows the rules)"
        )
    try:
        return build_scaler(cls, device, {**manifest.parameters, **overrides}, name=manifest.name)
    except ConfigError:
        try:  # the file's parameters alone, by its rule (no scaler built): whose value it was
            build_rule(cls, dict(manifest.parameters), manifest.name)
        except ConfigError as exc:
            why = str(exc).removeprefix(f"scaler '{manifest.name}': ")
            raise PolicyError(f"{where}: {why}; fix the file or export the policy again") from None
        raise  # an override's: the caller's error, as for a rule


register_policy_kind("parametric", load_parametric)
