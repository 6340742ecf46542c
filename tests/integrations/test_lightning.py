"""Lightning: the precision plugins carry the autoscale scaler through fit and checkpoints."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import pytest
import torch

import autoscale
from autoscale.scalers.scaler import LossScaler
from tests.integrations.helpers import (
    FAST_TORCH,
    SCALE,
    assert_three_clean_fp16_steps,
    lightning_trainer,
)

if TYPE_CHECKING:
    import lightning.pytorch as L
    from lightning.pytorch.plugins import MixedPrecision

    from tests.integrations.lightning_modules import Regression

# Lightning is imported by the tests that run it (tests.integrations.lightning_modules)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None,
    reason="needs lightning: pip install -e '.[dev]'",
)


def _fit(plugin: MixedPrecision, max_steps: int, ckpt_path=None) -> tuple[L.Trainer, Regression]:
    from tests.integrations.lightning_modules import Regression

    trainer = lightning_trainer(plugin, max_steps, gradient_clip_val=1.0)
    module = Regression()
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


def _plugin(init_scale: float) -> MixedPrecision:
    from autoscale.integrations.lightning import mixed_precision_plugin

    return mixed_precision_plugin("torch", device="cpu", **{**FAST_TORCH, "init_scale": init_scale})


@pytest.mark.slow
def test_fit_uses_the_scaler_and_checkpoints_it(tmp_path, clip_spy):
    plugin = _plugin(SCALE)
    scaler = plugin.scaler
    assert (
        isinstance(scaler, LossScaler) and plugin.precision == "16-mixed" and plugin.device == "cpu"
    )
    trainer, module = _fit(plugin, max_steps=3)

    assert trainer.precision_plugin is plugin
    # dtypes: the plugin's fp16 autocast, on CPU
    assert_three_clean_fp16_steps(scaler, module.dtypes, clip_spy.norms, module.stats, module)

    ckpt = tmp_path / "three.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["MixedPrecision"]
    assert saved["scale"] == SCALE * 2 and saved["autoscale"]["rule_state"] == {"growth_tracker": 1}

    resumed = _plugin(8.0)
    _fit(resumed, max_steps=4, ckpt_path=ckpt)
    # restored scale and tracker (1): step 4 reached growth_interval=2 and doubled the scale again
    assert resumed.scaler.steps == 4 and resumed.scaler.get_scale() == SCALE * 4


@pytest.mark.slow  # about a second or more
def test_fsdp_plugin_holds_the_scaler():
    # FSDPPrecision autocasts on CUDA only, and Lightning's FSDP needs CUDA: only the plugin is
    # checked here (its own scaler= argument raises in Lightning 2.6, hence the workaround).
    from lightning.pytorch.plugins import FSDPPrecision

    from autoscale.integrations.lightning import fsdp_precision_plugin

    plugin = fsdp_precision_plugin(
        "deepspeed", device="cpu", init_scale=2.0**10, loss_scale_window=5
    )
    assert isinstance(plugin, FSDPPrecision) and plugin.precision == "16-mixed"
    assert isinstance(plugin.scaler.rule, autoscale.scalers.DeepSpeedRule)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    # FSDP1's semantics (fp16 and offloaded gradients), where the plugin would build one
    assert isinstance(plugin.scaler, ShardedGradScaler)
    state = plugin.state_dict()
    assert state["scale"] == 2.0**10 and state["autoscale"]["rule"] == "deepspeed"
    other = fsdp_precision_plugin("deepspeed", device="cpu")
    other.load_state_dict(state)
    assert other.scaler.get_scale() == 2.0**10


@pytest.mark.parametrize(
    ("scaler", "skip_aware"),
    [("GradScaler", False), ("autoscale", False), ("autoscale", True)],
)
def test_scheduler_on_skipped_steps(scaler, skip_aware):
    """Lightning (2.6) steps a step-interval scheduler after every optimizer step, skipped or
    not, with GradScaler as with ours; overriding ``lr_scheduler_step`` with the scaler's
    ``step_was_skipped`` holds it on skipped steps."""
    from lightning.pytorch.plugins import MixedPrecision

    from tests.integrations.lightning_modules import Scheduled

    plugin = (
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=SCALE))
        if scaler == "GradScaler"
        else _plugin(SCALE)
    )
    module = Scheduled(bad={2, 4}, skip_aware=skip_aware)
    trainer = lightning_trainer(plugin, 6)
    trainer.fit(module)
    sched = trainer.lr_scheduler_configs[0].scheduler
    if scaler == "GradScaler":  # it halved at each of the two overflows: they were skipped
        assert plugin.scaler.get_scale() == SCALE / 4
    if skip_aware:
        assert plugin.scaler.skipped == 2
        assert sched.last_epoch == 4
        assert module.lrs == [1e-3 * 0.5**k for k in (0, 1, 2, 2, 3, 3)]
    else:
        assert sched.last_epoch == 6
        assert module.lrs == [1e-3 * 0.5**k for k in range(6)]
