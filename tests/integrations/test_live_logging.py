"""The loss scale in the frameworks' own logs: the Trainer's callback and Lightning's monitor."""

from __future__ import annotations

import csv

import pytest
import torch

from tests.integrations.helpers import ByteDataset, lightning_trainer, tiny_gpt2, trainer_args


@pytest.mark.slow
def test_trainer_logs_carry_the_scale(tmp_path):
    pytest.importorskip("transformers")
    from autoscale.integrations.trainer import AutoscaleTrainer, log_scale

    trainer = AutoscaleTrainer(
        model=tiny_gpt2(),
        args=trainer_args(tmp_path, max_steps=4),
        train_dataset=ByteDataset(),
        scaler="torch",
        scaler_overrides={"init_scale": 2.0**12, "growth_interval": 2},
    )
    callback = log_scale(trainer, hist_every=1)
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()
    logged = [h for h in trainer.state.log_history if "autoscale/scale" in h]
    assert [h["autoscale/scale"] for h in logged] == [2.0**12, 2.0**12, 2.0**13, 2.0**13]
    assert all(
        h["autoscale/skipped_total"] == 0 and 0 <= h["autoscale/underflow"] <= 1 for h in logged
    )
    assert callback.watch is None  # closed at the end of training


def test_lightning_monitor_logs_through_the_modules_logger(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from autoscale.integrations.lightning import ScaleMonitor, mixed_precision_plugin

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, i):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(24, 8, generator=g), torch.randn(24, 1, generator=g)
    xs[8, 0] = float("inf")  # batch 2 of 4-example batches
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=4)
    trainer = lightning_trainer(
        mixed_precision_plugin("torch", "cpu", init_scale=2.0**10),
        max_steps=6,
        callbacks=[ScaleMonitor(hist_every=1)],
        log_every_n_steps=1,
    )
    trainer.loggers = [CSVLogger(str(tmp_path))]
    trainer.fit(Net(), data)
    rows = list(
        csv.DictReader(
            (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
        )
    )
    scales = [float(r["autoscale/scale"]) for r in rows if r.get("autoscale/scale")]
    skipped = [
        float(r["autoscale/skipped_total"]) for r in rows if r.get("autoscale/skipped_total")
    ]
    assert scales and scales[0] == 2.0**10 and 2.0**9 in scales  # halved after the bad batch
    assert skipped[-1] == 1.0
