"""The run-time product: loss scalers that drop in for ``torch.amp.GradScaler``.

A scaler (:class:`LossScaler`, a GradScaler) hosts a rule (:class:`ScaleRule`) that decides each
next scale. Imports torch and PyYAML only (never stable-baselines3, optuna or gymnasium).
Importing it first checks that this torch has the private members the scalers rely on
(:mod:`~autoscale.scalers.torch_compat`).
"""

from autoscale.scalers.torch_compat import check_torch

check_torch()  # before the modules below import torch's private members

from autoscale.scalers.catalog import ScalerInfo, list_scalers, make_scaler
from autoscale.scalers.controller import (
    FP16_MAX,
    FP16_MIN_NORMAL,
    ScaleBounds,
    ScaleController,
    ScaleRule,
    StepStats,
)
from autoscale.scalers.policies import (
    PolicyManifest,
    find_policy,
    policy_dirs,
    read_manifest,
    register_policy_kind,
)
from autoscale.scalers.registry import register_loss_scaler, rule_class
from autoscale.scalers.rules import (
    AmaxCapRule,
    AmaxHistoryRule,
    AmaxLossRule,
    DeepSpeedRule,
    FairseqRule,
    JmpRule,
    MegatronRule,
    MetaseqRule,
    StaticRule,
    TorchRule,
)
from autoscale.scalers.scaler import LossScaler, default_device

__all__ = [
    "FP16_MAX",
    "FP16_MIN_NORMAL",
    "LossScaler",
    "PolicyManifest",
    "ScaleBounds",
    "ScaleController",
    "ScaleRule",
    "ScalerInfo",
    "StepStats",
    "default_device",
    "find_policy",
    "make_scaler",
    "list_scalers",
    "policy_dirs",
    "read_manifest",
    "register_loss_scaler",
    "register_policy_kind",
    "rule_class",
    "AmaxCapRule",
    "AmaxHistoryRule",
    "AmaxLossRule",
    "DeepSpeedRule",
    "FairseqRule",
    "JmpRule",
    "MegatronRule",
    "MetaseqRule",
    "StaticRule",
    "TorchRule",
]
