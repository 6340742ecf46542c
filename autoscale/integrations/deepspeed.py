"""DeepSpeed: the scale rule as the ``fp16`` block of a DeepSpeed config.

DeepSpeed scales the loss inside its engine (``deepspeed/runtime/fp16/loss_scaler.py``) and takes no
GradScaler, so autoscale reaches it through the config: a static scale or the dynamic
hysteresis/window rule, which covers the ``static``, ``deepspeed``, ``torch``, ``jmp`` and
``megatron`` rules and parametric policies exported from them (each rule's ``deepspeed_config``
does the translation). Rules that read
gradient statistics and neural policies have no DeepSpeed equivalent. DeepSpeed itself is not needed
to build the config.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError
from autoscale.scalers.catalog import make_scaler
from autoscale.scalers.neural import deepspeed_refusal
from autoscale.scalers.policies import find_policy, read_manifest
from autoscale.scalers.registry import build_scaler, rule_class
from autoscale.scalers.scaler import LossScaler

__all__ = ["deepspeed_config", "write_deepspeed_config", "HF_AUTO_BATCH"]

# What Hugging Face Trainer and Accelerate fill in from their own arguments; plain
# deepspeed.initialize needs numbers instead: pass them in base_config.
HF_AUTO_BATCH = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}
_SCALE_KEYS = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
)


def deepspeed_config(
    name_or_policy: str | os.PathLike | LossScaler,
    base_config: dict[str, Any] | str | os.PathLike | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """A DeepSpeed config whose ``fp16`` block runs the rule ``name_or_policy``.

    Args:
        name_or_policy: A rule id (``"deepspeed"``, ``"torch"``, ...), an exported parametric policy's
            name or folder, or a built :class:`LossScaler` of such a rule.
        base_config: The rest of the config, as a dict or a JSON file; its ``fp16`` entries other than
            the scale keep their values (``auto_cast``, ...). Default: the batch-size keys set to
            ``"auto"``, which Hugging Face Trainer and Accelerate fill in.
        **overrides: Rule parameters on top of the rule's (or the policy's) own.

    Returns:
        A new dict; ``base_config`` is not modified.

    Raises:
        ConfigError: a neural policy, a rule DeepSpeed cannot express, a base config with bf16 on,
            or an unreadable base config file.
        UnknownNameError: ``name_or_policy`` is no scaler or policy.
    """
    scaler = _scaler(name_or_policy, overrides)
    fp16 = scaler.rule.deepspeed_config(scaler.init_scale, scaler.min_scale)
    config = _base(base_config)
    bf16 = config.get("bf16", config.get("bfloat16"))
    if isinstance(bf16, dict) and bf16.get("enabled") in (True, "true"):
        raise ConfigError(
            "the base config enables bf16, which uses no loss scale; set bf16.enabled to false "
            "(or 'auto') to train in fp16 with this rule"
        )
    kept = {k: v for k, v in (config.get("fp16") or {}).items() if k not in _SCALE_KEYS}
    config["fp16"] = {**kept, **fp16}
    return config


def write_deepspeed_config(
    name_or_policy: str | os.PathLike | LossScaler,
    path: str | os.PathLike,
    base_config: dict[str, Any] | str | os.PathLike | None = None,
    **overrides: Any,
) -> Path:
    """Write :func:`deepspeed_config` as JSON to ``path`` (for ``--deepspeed ds.json``); returns it."""
    config = deepspeed_config(name_or_policy, base_config, **overrides)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(config, indent=2) + "\n")
    return out


def _scaler(what: str | os.PathLike | LossScaler, overrides: dict[str, Any]) -> LossScaler:
    """The scaler whose rule goes into the config: ``what`` itself, or rebuilt with overrides."""
    if isinstance(what, LossScaler):
        if not overrides:
            return what
        spec = what.spec()
        spec.pop("name")
        return build_scaler(type(what.rule), "cpu", {**spec, **overrides}, name=what.name)
    name = os.fspath(what)
    path = find_policy(name) if rule_class(name) is None else None
    if path is not None:  # refuse a policy DeepSpeed cannot run before loading its weights
        manifest = read_manifest(path)
        if manifest.kind != "parametric":
            raise deepspeed_refusal(manifest.name, manifest.kind)
    return make_scaler(name, device="cpu", **overrides)


def _base(base_config: dict[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    if base_config is None:
        return dict(HF_AUTO_BATCH)
    if isinstance(base_config, dict):
        return copy.deepcopy(base_config)
    file = Path(base_config)
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read DeepSpeed config '{file}': {exc}; pass a dict or a JSON file"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"DeepSpeed config '{file}' is not a JSON object; pass a dict or a JSON file"
        )
    return data
