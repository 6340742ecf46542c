"""The LightningModules of the Lightning tests, in a module of their own: importing Lightning
takes seconds, paid by the tests that run it, not by every collection of the tests."""

from __future__ import annotations

import math

import lightning.pytorch as L
import torch

from tests.integrations.helpers import record_output_dtypes, regression_batches, tiny_mlp


class Regression(L.LightningModule):
    """A tiny MLP regression, three steps an epoch; records its fp16 dtypes and scaler stats."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_mlp()
        self.dtypes = record_output_dtypes(self.net[0])
        self.stats = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.stats.append(self.trainer.precision_plugin.scaler.last_stats)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        x, y = (torch.cat(t) for t in zip(*regression_batches(3)))  # 3 steps an epoch
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class Scheduled(Regression):
    """Infinite loss at the batches in ``bad``; a StepLR stepped every batch. With
    ``skip_aware`` the module's ``lr_scheduler_step`` asks the scaler first (the README's)."""

    def __init__(self, bad: set[int], skip_aware: bool) -> None:
        super().__init__()
        self.bad, self.skip_aware, self.lrs = bad, skip_aware, []

    def training_step(self, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx in self.bad else loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass  # a GradScaler has no last_stats

    def lr_scheduler_step(self, scheduler, metric):
        if self.skip_aware and self.trainer.precision_plugin.scaler.step_was_skipped:
            return  # the optimizer did not step: neither does the schedule
        super().lr_scheduler_step(scheduler, metric)

    def train_dataloader(self):
        x, y = (torch.cat(t) for t in zip(*regression_batches(6)))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class InfAtBatch(L.LightningModule):
    """A tiny MLP regression whose loss is infinite at batch ``bad``, six steps an epoch."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.net = tiny_mlp()
        self.bad = bad

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        return loss * math.inf if batch_idx == self.bad else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        x, y = (torch.cat(t) for t in zip(*regression_batches(6)))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
