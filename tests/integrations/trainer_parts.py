"""The Trainer subclass and callbacks of the HF Trainer tests, in a module of their own:
importing transformers takes seconds, paid by the tests that run it, not by every collection of
the tests."""

from __future__ import annotations

from transformers import TrainerCallback

from autoscale.integrations.trainer import AutoscaleTrainer


class Record(TrainerCallback):
    """The scale each step starts with, and the scaler's record of each step."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.scales: list[float] = []
        self.stats = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.scales.append(self.trainer.loss_scaler.get_scale())

    def on_step_end(self, args, state, control, **kwargs):
        self.stats.append(self.trainer.loss_scaler.last_stats)


class InfLossTrainer(AutoscaleTrainer):
    """Multiplies the loss of the optimizer steps in ``bad`` (0-based) by inf."""

    bad: frozenset[int] = frozenset()

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * float("inf") if self.state.global_step in self.bad else loss


class LearningRates(TrainerCallback):
    """The learning rate each step starts with."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])
