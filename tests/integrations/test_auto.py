"""The shipped general policy ``auto`` in every framework: HF Trainer, Accelerate and Lightning
take real fp16 steps with it, and its state (the rule's, a neural policy's observation history
included) survives their checkpoints through ``torch.load(weights_only=True)``."""

from __future__ import annotations

import lightning.pytorch as L
import torch
from accelerate import Accelerator
from transformers import TrainingArguments

import autoscale
from autoscale.integrations import install_scaler
from autoscale.integrations.lightning import mixed_precision_plugin
from autoscale.integrations.trainer import AutoscaleTrainer
from autoscale.scalers.base import LossScaler
from tests.integrations.helpers import (
    ByteDataset,
    record_output_dtypes,
    regression_batches,
    tiny_gpt2,
    tiny_mlp,
)


def _auto_rule() -> type:
    return type(autoscale.get_scaler("auto", device="cpu").rule)


def _same_state(a: LossScaler, b: LossScaler) -> None:
    assert a.get_scale() == b.get_scale() and a.steps == b.steps
    assert a.rule.state() == b.rule.state()


def test_trainer(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        fp16=True,
        use_cpu=True,
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=4,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = AutoscaleTrainer(
        model=tiny_gpt2(), args=args, train_dataset=ByteDataset(), scaler="auto"
    )
    scaler = trainer.loss_scaler
    assert isinstance(scaler.rule, _auto_rule())
    dtypes = record_output_dtypes(trainer.model.transformer.h[0].attn.c_attn)
    trainer.train()
    assert scaler.steps == 4 and set(dtypes) == {torch.float16}
    saved = torch.load(tmp_path / "checkpoint-4" / "scaler.pt", weights_only=True)
    again = autoscale.get_scaler("auto", device="cpu")
    again.load_state_dict(saved)
    _same_state(scaler, again)


def test_accelerate(tmp_path):
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = install_scaler(accelerator, "auto")
    assert isinstance(scaler.rule, _auto_rule())
    model = tiny_mlp()
    dtypes = record_output_dtypes(model[0])
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for x, y in regression_batches(4):
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    assert scaler.steps == 4 and dtypes == [torch.float16] * 4
    accelerator.save_state(str(tmp_path / "state"))
    other = Accelerator(mixed_precision="fp16", cpu=True)
    restored = install_scaler(other, "auto")
    fresh = tiny_mlp()
    other.prepare(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    other.load_state(str(tmp_path / "state"))
    _same_state(scaler, restored)


class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_mlp()
        self.dtypes = record_output_dtypes(self.net[0])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        x, y = (torch.cat(t) for t in zip(*regression_batches(4)))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _fit(plugin, max_steps: int, ckpt_path=None):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        plugins=[plugin],
        gradient_clip_val=1.0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = _Regression()
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


def test_lightning(tmp_path):
    plugin = mixed_precision_plugin("auto", device="cpu")
    assert isinstance(plugin.scaler.rule, _auto_rule())
    trainer, module = _fit(plugin, max_steps=4)
    assert plugin.scaler.steps == 4 and module.dtypes == [torch.float16] * 4
    ckpt = tmp_path / "four.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["MixedPrecision"]
    again = autoscale.get_scaler("auto", device="cpu")
    again.load_state_dict(saved)
    _same_state(plugin.scaler, again)
