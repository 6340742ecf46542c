"""The run-time product: loss scalers that drop in for ``torch.amp.GradScaler``.

Imports torch and PyYAML only (never stable-baselines3, optuna or gymnasium).
"""

from autoscale.scalers.base import FP16_MAX, FP16_MIN_NORMAL, LossScaler, StepStats, default_device
from autoscale.scalers.registry import (
    ScalerInfo,
    find_policy,
    get_scaler,
    list_scalers,
    policy_dirs,
    register_loss_scaler,
)
from autoscale.scalers.rules import (  # noqa: F401  (registers the built-in rules)
    AmaxHistoryScaler,
    DeepSpeedScaler,
    FairseqScaler,
    JmpScaler,
    MegatronScaler,
    MetaseqScaler,
    StaticScaler,
    TorchScaler,
)

__all__ = [
    "FP16_MAX",
    "FP16_MIN_NORMAL",
    "LossScaler",
    "StepStats",
    "ScalerInfo",
    "default_device",
    "find_policy",
    "get_scaler",
    "list_scalers",
    "policy_dirs",
    "register_loss_scaler",
    "AmaxHistoryScaler",
    "DeepSpeedScaler",
    "FairseqScaler",
    "JmpScaler",
    "MegatronScaler",
    "MetaseqScaler",
    "StaticScaler",
    "TorchScaler",
]
