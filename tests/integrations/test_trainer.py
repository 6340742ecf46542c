"""transformers.Trainer: AutoscaleTrainer trains with the scaler and checkpoints it in scaler.pt."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import pytest
import torch

from autoscale.errors import ConfigError
from autoscale.scalers.scaler import LossScaler
from tests.integrations.helpers import (
    SCALE,
    ByteDataset,
    assert_clipped_unscaled,
    n_params,
    record_output_dtypes,
    tiny_gpt2,
    trainer_args,
)

if TYPE_CHECKING:
    from autoscale.integrations.trainer import AutoscaleTrainer
    from tests.integrations.trainer_parts import Record

# transformers is imported by the tests that run it (tests.integrations.trainer_parts)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="needs transformers: pip install -e '.[dev]'",
)


def _trainer(out, max_steps: int, init_scale: float) -> tuple[AutoscaleTrainer, Record]:
    from autoscale.integrations.trainer import AutoscaleTrainer
    from tests.integrations.trainer_parts import Record

    trainer = AutoscaleTrainer(
        model=tiny_gpt2(),
        args=trainer_args(out, max_steps),
        train_dataset=ByteDataset(),
        scaler="torch",
        scaler_overrides={"init_scale": init_scale, "growth_interval": 3, "collect_stats": True},
    )
    record = Record(trainer)
    trainer.add_callback(record)
    return trainer, record


def test_trains_with_the_scaler_and_resumes_its_state(tmp_path, clip_spy):
    trainer, record = _trainer(tmp_path, max_steps=2, init_scale=SCALE)
    scaler = trainer.loss_scaler
    assert isinstance(scaler, LossScaler) and trainer.accelerator.scaler is scaler
    dtypes = record_output_dtypes(trainer.model.transformer.h[0].attn.c_attn)

    trainer.train()

    assert (scaler.steps, scaler.skipped) == (2, 0)
    assert set(dtypes) == {torch.float16}  # Accelerate autocast the forward pass
    assert_clipped_unscaled(clip_spy.norms, record.stats, n_params(trainer.model))
    saved = torch.load(tmp_path / "checkpoint-2" / "scaler.pt", weights_only=True)
    assert saved["scale"] == SCALE
    assert saved["autoscale"]["steps"] == 2 and saved["autoscale"]["rule_state"] == {
        "growth_tracker": 2
    }

    # A new trainer built with another initial scale picks the saved state up on resume.
    resumed, record = _trainer(tmp_path, max_steps=3, init_scale=32.0)
    assert resumed.loss_scaler.get_scale() == 32.0
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))

    assert record.scales == [SCALE]  # step 3 started from the saved scale, not 32
    # the restored growth tracker (2) reached growth_interval=3 at step 3: the scale doubled
    assert resumed.loss_scaler.get_scale() == SCALE * 2
    assert resumed.loss_scaler.steps == 3 and resumed.loss_scaler.rule.state() == {
        "growth_tracker": 0
    }


def test_requires_fp16(tmp_path):
    from transformers import TrainingArguments

    from autoscale.integrations.trainer import AutoscaleTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    with pytest.raises(
        ConfigError,
        match=r"AutoscaleTrainer needs TrainingArguments\(fp16=True\), got mixed precision 'no'",
    ):
        AutoscaleTrainer(model=tiny_gpt2(), args=args, train_dataset=ByteDataset(), scaler="torch")


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_skipped_steps_hold_the_learning_rate_schedule(tmp_path, optim):
    """The Trainer steps its scheduler only when ``accelerator.optimizer_step_was_skipped`` is
    False, which our skips set as GradScaler's do (tests/integrations/test_accelerate.py); a
    fused optimizer skips inside its kernel, unseen by Accelerate, so the schedule advances."""
    from tests.integrations.trainer_parts import InfLossTrainer, LearningRates

    args = trainer_args(tmp_path, max_steps=6, optim=optim, lr_scheduler_type="linear")
    args.save_strategy = "no"
    trainer = InfLossTrainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=ByteDataset(n=24),
        scaler="torch",
        scaler_overrides={"init_scale": SCALE},
    )
    trainer.bad = frozenset({2, 3})
    lrs = LearningRates()
    trainer.add_callback(lrs)
    trainer.train()

    scaler = trainer.loss_scaler
    assert (scaler.steps, scaler.skipped) == (6, 2) and trainer.state.global_step == 6
    linear = [1e-3 * (1 - k / 6) for k in range(6)]
    if optim == "adamw_torch":
        assert trainer.lr_scheduler.last_epoch == 4  # steps 2 and 3 did not move it
        assert lrs.lrs == pytest.approx([linear[k] for k in (0, 1, 2, 2, 2, 3)])
    else:
        assert trainer.lr_scheduler.last_epoch == 6
        assert lrs.lrs == pytest.approx(linear)
