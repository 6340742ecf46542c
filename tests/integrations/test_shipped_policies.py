"""Every policy shipped in policies/ (``auto`` among them once it ships) drives Accelerate, the HF
Trainer and Lightning through real fp16 steps (skipping an infinite loss under Accelerate and
Lightning) and carries its state through each framework's checkpoint."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

import autoscale
from autoscale.integrations import make_accelerator
from tests.integrations.helpers import (
    ByteDataset,
    lightning_trainer,
    regression_batches,
    tiny_gpt2,
    tiny_mlp,
    trainer_args,
)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.name for p in (ROOT / "policies").iterdir() if (p / "policy.yaml").is_file())
BAD = 2  # the step whose loss is made infinite: skipped at any scale


# each framework is imported by its test, not at collection (seconds each)
_NEEDS = "needs {}: pip install -e '.[dev]'"


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.skipif(not _installed("accelerate"), reason=_NEEDS.format("accelerate"))
def test_accelerate(name, tmp_path):
    accelerator = make_accelerator(name, cpu=True)
    scaler = accelerator.scaler
    assert scaler.name == autoscale.get_scaler(name, device="cpu").name
    model = tiny_mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = _params(model)
    last = None
    skipped = []
    for i, (x, y) in enumerate(regression_batches(6)):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if i == BAD:
            loss = loss * math.inf
        accelerator.backward(loss)
        optimizer.step()
        skipped.append(accelerator.optimizer_step_was_skipped)
        last = loss.item()
    assert skipped[BAD] and scaler.steps == 6
    assert sum(skipped) == scaler.skipped  # Accelerate sees exactly the scaler's skips
    after = _params(model)
    assert torch.isfinite(after).all() and not torch.equal(after, before)
    assert math.isfinite(last)

    state = scaler.state_dict()
    accelerator.save_state(str(tmp_path / "state"))
    scaler.set_scale(1.0)
    accelerator.load_state(str(tmp_path / "state"))
    assert scaler.state_dict() == state


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.skipif(not _installed("transformers"), reason=_NEEDS.format("transformers"))
def test_hf_trainer(name, tmp_path):
    from transformers import TrainerCallback

    from autoscale.integrations.trainer import AutoscaleTrainer

    def trainer(max_steps: int) -> AutoscaleTrainer:
        args = trainer_args(tmp_path, max_steps)
        return AutoscaleTrainer(
            model=tiny_gpt2(), args=args, train_dataset=ByteDataset(), scaler=name
        )

    first = trainer(max_steps=2)
    scaler = first.loss_scaler
    assert first.accelerator.scaler is scaler
    assert scaler.name == autoscale.get_scaler(name, device="cpu").name
    before = _params(first.model)
    first.train()
    assert (scaler.steps, scaler.skipped) == (2, 0)
    assert not torch.equal(_params(first.model), before)
    saved = torch.load(tmp_path / "checkpoint-2" / "scaler.pt", weights_only=True)
    assert saved["scale"] == scaler.get_scale()
    assert saved["autoscale"]["rule"] == scaler.name and saved["autoscale"]["steps"] == 2

    resumed = trainer(max_steps=3)
    resumed.loss_scaler.set_scale(1.0)
    starts = []  # the scale step 3 starts from

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            starts.append(resumed.loss_scaler.get_scale())

    resumed.add_callback(Record())
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert starts == [saved["scale"]]  # the saved state, not the 1.0 set above
    assert resumed.loss_scaler.steps == 3


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.skipif(not _installed("lightning"), reason=_NEEDS.format("lightning"))
def test_lightning(name, tmp_path):
    # Lightning is imported here, not at collection (seconds)
    from autoscale.integrations.lightning import mixed_precision_plugin
    from tests.integrations.lightning_modules import InfAtBatch

    plugin = mixed_precision_plugin(name, device="cpu")
    scaler = plugin.scaler
    assert scaler.name == autoscale.get_scaler(name, device="cpu").name
    trainer = lightning_trainer(plugin, 6, gradient_clip_val=1.0)
    module = InfAtBatch(BAD)
    before = _params(module)
    trainer.fit(module)
    assert trainer.precision_plugin.scaler is scaler
    assert scaler.steps == 6 and scaler.skipped >= 1
    after = _params(module)
    assert torch.isfinite(after).all() and not torch.equal(after, before)

    ckpt = tmp_path / "six.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["MixedPrecision"]
    assert saved == scaler.state_dict()
    assert saved["autoscale"]["rule"] == scaler.name and saved["autoscale"]["steps"] == 6
