"""Stable-Baselines3 agents over the loss-scale environments, evaluation, and policy export."""

from autoscale.agents.export import export_neural, sb3_actor

__all__ = ["export_neural", "sb3_actor"]
