"""Accelerate: install_scaler / make_accelerator put the autoscale scaler on the Accelerator."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import GradScalerKwargs

import autoscale
from autoscale.errors import ConfigError
from autoscale.integrations import install_scaler, make_accelerator
from autoscale.scalers.base import LossScaler
from tests.integrations.helpers import (
    FAST_TORCH,
    SCALE,
    assert_three_clean_fp16_steps,
    record_output_dtypes,
    regression_batches,
    tiny_mlp,
)


@pytest.mark.parametrize("how", ["install_scaler", "make_accelerator"])
def test_fp16_steps_use_the_autoscale_scaler(how, clip_spy, tmp_path):
    if how == "install_scaler":
        accelerator = Accelerator(mixed_precision="fp16", cpu=True)
        scaler = install_scaler(accelerator, "torch", **FAST_TORCH)
    else:
        accelerator = make_accelerator("torch", scaler_overrides=FAST_TORCH, cpu=True)
        scaler = accelerator.scaler
    model = tiny_mlp()
    dtypes = record_output_dtypes(model[0])
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert isinstance(accelerator.scaler, LossScaler) and accelerator.scaler is scaler
    assert optimizer.scaler is scaler  # what AcceleratedOptimizer.step calls

    stats = []
    for x, y in regression_batches(3):  # the README snippet
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        stats.append(scaler.last_stats)

    # dtypes: Accelerate's prepare wrapped the forward in fp16 autocast
    assert_three_clean_fp16_steps(scaler, dtypes, clip_spy.norms, stats, model)

    # save_state / load_state carry the rule's state through torch.load(weights_only=True)
    accelerator.save_state(str(tmp_path / "state"))
    scaler.set_scale(1.0)
    scaler.rule.load_state({"growth_tracker": 0})
    accelerator.load_state(str(tmp_path / "state"))
    assert scaler.get_scale() == SCALE * 2
    assert scaler.steps == 3 and scaler.rule.state() == {"growth_tracker": 1}


def test_refuses_after_prepare():
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    model = tiny_mlp()
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(
        ConfigError, match=r"before accelerator\.prepare.*1 prepared optimizer\(s\) already hold"
    ):
        install_scaler(accelerator, "torch")
    assert accelerator.scaler is None
    accelerator.free_memory()  # forgets the prepared objects: prepare again with the new scaler
    assert isinstance(install_scaler(accelerator, "torch"), LossScaler)


def test_refuses_a_model_prepared_without_autocast():
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.prepare(tiny_mlp())
    with pytest.raises(ConfigError, match=r"1 model\(s\) were prepared without fp16 autocast"):
        install_scaler(accelerator, "deepspeed")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"mixed_precision": "no"},
            r"needs Accelerator\(mixed_precision='fp16'\), got mixed_precision='no'",
        ),
        ({"mixed_precision": "bf16"}, r"got mixed_precision='bf16'"),
        (
            {"mixed_precision": "fp16", "kwargs_handlers": [GradScalerKwargs(init_scale=1024.0)]},
            r"GradScalerKwargs\(init_scale=1024\.0\).*install_scaler\(accelerator, 'torch', init_scale=",
        ),
    ],
)
def test_refuses_what_the_scaler_would_not_serve(kwargs, match):
    accelerator = Accelerator(cpu=True, **kwargs)
    with pytest.raises(ConfigError, match=match):
        install_scaler(accelerator, "torch")


@pytest.mark.parametrize(
    ("scaler", "overrides", "match"),
    [
        (torch.amp.GradScaler("cpu"), {}, r"got GradScaler; pass a name such as 'torch'"),
        ("built", {"init_scale": 8.0}, r"overrides \['init_scale'\] apply to a scaler name"),
        ("cuda", {}, r"built for device 'cuda', but training runs on 'cpu'.*device='cpu'"),
        ("torch-dynamc", {}, r"unknown scaler 'torch-dynamc'"),
    ],
)
def test_bad_scaler_arguments(scaler, overrides, match):
    if scaler == "built":
        scaler = autoscale.get_scaler("torch", device="cpu")
    elif scaler == "cuda":
        with pytest.warns(UserWarning, match="CUDA is not available"):
            scaler = autoscale.get_scaler("torch", device="cuda")
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    with pytest.raises(autoscale.AutoscaleError, match=match):
        install_scaler(accelerator, scaler, **overrides)
