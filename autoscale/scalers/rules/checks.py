"""Checks of the rules' hyperparameters and the DeepSpeed config blocks they share."""

from __future__ import annotations

import math
from typing import Any

from autoscale.errors import ConfigError
from autoscale.scalers.controller import ScaleRule

__all__ = [
    "check_growth",
    "check_backoff",
    "check_bits",
    "check_interval",
    "int_state",
    "dynamic_block",
    "window_block",
]


def check_growth(value: float) -> float:
    value = float(value)
    if not value > 1.0 or not math.isfinite(value):
        raise ConfigError(
            f"growth factor must be > 1 (it multiplies the scale on growth), got {value!r}"
        )
    return value


def check_backoff(value: float) -> float:
    value = float(value)
    if not 0.0 < value < 1.0:
        raise ConfigError(
            f"backoff factor must be in (0, 1) (it multiplies the scale on overflow), got {value!r}"
        )
    return value


def check_bits(name: str, value: float) -> float:
    """A margin in bits: a non-negative finite number."""
    out = float(value)
    if not (math.isfinite(out) and out >= 0):
        raise ConfigError(f"{name} must be a non-negative number of bits, got {out!r}")
    return out


def check_interval(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) <= 0:
        raise ConfigError(f"{name} must be a positive integer number of steps, got {value!r}")
    return int(value)


def int_state(rule: ScaleRule, state: dict[str, Any], defaults: dict[str, int]) -> dict[str, int]:
    """The integer counters ``defaults`` names, read from ``state`` (missing keys: the default).

    Raises:
        ConfigError: ``state`` is no mapping, or a counter is no integer; names the rule and key.
    """
    if not isinstance(state, dict):
        raise ConfigError(
            f"rule '{rule.name}': state must be a mapping, got {type(state).__name__}; "
            "the checkpoint was not written by this rule"
        )
    out = {}
    for key, default in defaults.items():
        value = state.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                f"rule '{rule.name}': state '{key}' must be an integer, got {value!r}; "
                "the checkpoint was not written by this rule"
            )
        out[key] = value
    return out


def dynamic_block(rule: ScaleRule, init_scale: float, min_scale: float) -> dict[str, Any]:
    """What every dynamic DeepSpeed ``fp16`` block holds: the initial power and the minimum."""
    power = math.log2(init_scale)
    if power != int(power):
        raise ConfigError(
            f"DeepSpeed takes initial_scale_power (a power of two); init_scale {init_scale:g} is not one"
        )
    # DeepSpeedFP16Config declares min_loss_scale an int: a floor under 1 (torch's rule keeps 2^-24)
    # becomes 1, the lowest DeepSpeed can hold.
    if min_scale > 1 and min_scale != int(min_scale):
        raise ConfigError(
            f"DeepSpeed's min_loss_scale is an integer; min_scale {min_scale:g} is not one "
            f"(use min_scale={int(min_scale)} or {int(min_scale) + 1})"
        )
    return {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": int(power),
        "min_loss_scale": max(1, int(min_scale)),
    }


def window_block(
    rule: ScaleRule,
    init_scale: float,
    min_scale: float,
    growth: float,
    backoff: float,
    window: int,
    hysteresis: int = 1,
) -> dict[str, Any]:
    """A counter rule with a growth window in DeepSpeed's terms (factors fixed at 2 and 1/2)."""
    if growth != 2.0 or backoff != 0.5:
        raise ConfigError(
            f"DeepSpeed fixes the factors at 2 and 1/2; rule '{rule.name}' uses {growth:g} and {backoff:g}"
        )
    # DeepSpeed's first growth comes after window+1 clean steps, torch/jmp/megatron's after
    # `window`: window-1 matches the first growth; DeepSpeed's later growths then come every
    # window-1 steps instead of every window (DeepSpeed cannot express the rule exactly).
    return {
        **dynamic_block(rule, init_scale, min_scale),
        "loss_scale_window": max(1, window - 1),
        "hysteresis": hysteresis,
        "consecutive_hysteresis": False,
    }
