"""Stable-Baselines3 agents over the loss-scale environments, evaluation, and policy export."""

from autoscale.agents.export import (
    deepspeed_fp16_config,
    export_neural,
    export_parametric,
    sb3_actor,
)

__all__ = ["deepspeed_fp16_config", "export_neural", "export_parametric", "sb3_actor"]
