"""Every scaler by name: ``make_scaler(name)`` looks among the rules (built-in, registered, and
installed plugins: :mod:`~autoscale.scalers.registry`), then the exported policies
(:mod:`~autoscale.scalers.policies`, loaded by the policy kinds of
:mod:`~autoscale.scalers.parametric` and :mod:`~autoscale.scalers.neural`); ``list_scalers()`` lists
them all. The one place that knows both, so that neither knows the other's listing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autoscale.errors import ConfigError, PolicyError, UnknownNameError, unknown_name
from autoscale.scalers import neural, parametric, policies, residual  # noqa: F401  (the policy kinds)
from autoscale.scalers.registry import (
    build_scaler,
    is_plugin,
    plugin_errors,
    rule_class,
    rule_defaults,
    rule_names,
)
from autoscale.scalers.scaler import LossScaler

__all__ = ["ScalerInfo", "list_scalers", "make_scaler"]


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


def make_scaler(name: str, device: str | None = None, **overrides: Any) -> LossScaler:
    """Build the scaler registered (or exported) as ``name``.

    Args:
        name: A rule id (``torch``, ``deepspeed``, ...), a plugin's id, an exported policy's name, or
            the path of an exported policy folder.
        device: Device type of the scale tensor; CUDA when present, else CPU.
        **overrides: The rule's keyword arguments, and the scaler's (``init_scale``, ``min_scale``,
            ``max_scale``, ``raise_at_min``, ``collect_stats``, ``enabled``).

    Raises:
        UnknownNameError: ``name`` is nothing known; the message lists what is, and where
            exported policies were looked for.
        ConfigError: an override the rule does not take, an invalid value, or a plugin that failed
            to load.
        PolicyError: an exported policy that is corrupt or incompatible.
    """
    cls = rule_class(name)
    if cls is not None:
        return build_scaler(cls, device, overrides)
    if name in plugin_errors():
        raise ConfigError(
            f"scaler plugin '{name}' ({plugin_errors()[name]}); fix or reinstall the package that publishes it"
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
    error = unknown_name("scaler", name, rule_names() + policies.policy_names(), "autoscale list")
    raise UnknownNameError(
        f"{error}; exported policies were looked for in {policies.policy_places()}; set "
        f"{policies.POLICY_PATH_ENV}=DIR to look in another folder, or give the policy folder's path"
    )


def list_scalers() -> list[ScalerInfo]:
    """Every scaler ``make_scaler`` can build: rules, plugins (broken ones marked UNUSABLE), then
    exported policies (each built once on the CPU: one that is corrupt, or cannot be built here,
    marked UNUSABLE with the reason)."""
    names = rule_names()
    infos = [
        ScalerInfo(
            name,
            "plugin" if is_plugin(name) else "rule",
            cls.description,
            rule_defaults(cls),
            cls.source,
        )
        for name in names
        for cls in (rule_class(name),)
    ]
    infos += [
        ScalerInfo(name, "plugin", f"UNUSABLE: {error}", {}, "")
        for name, error in plugin_errors().items()
    ]
    for name, manifest, path, error in policies.policy_rows():
        if error is not None:
            infos.append(ScalerInfo(name, "policy", f"UNUSABLE: {error}", {}, str(path)))
            continue
        what = manifest.describe()
        try:  # a manifest that reads may still not build here (its rule is not registered)
            policies.load_policy(path, device="cpu")
        except (ConfigError, PolicyError) as exc:
            what = f"UNUSABLE: {what}, cannot be built here: {exc}"
        infos.append(ScalerInfo(name, "policy", what, dict(manifest.parameters), str(path)))
    return infos
