"""Accelerate: install_scaler / make_accelerator put the autoscale scaler on the Accelerator."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="needs accelerate: pip install -e '.[dev]'")


import torch
from accelerate import Accelerator
from accelerate.utils import GradScalerKwargs

import autoscale
from autoscale.errors import ConfigError
from autoscale.integrations import install_scaler, make_accelerator
from autoscale.scalers.scaler import LossScaler
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


def _run_with_scheduler(kind: str, fused: bool, bad: set[int], n: int = 6) -> dict:
    """``n`` fp16 steps through a prepared optimizer and scheduler; the loss of the steps in
    ``bad`` is infinite. ``kind`` is which scaler the accelerator holds: torch's own GradScaler
    (installed as install_scaler does, since Accelerate makes none on CPU) or autoscale's."""
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    if kind == "GradScaler":
        accelerator.scaler, accelerator.native_amp = (
            torch.amp.GradScaler("cpu", init_scale=SCALE),
            True,
        )
    else:
        install_scaler(accelerator, "torch", init_scale=SCALE)
    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    out = {"accelerate_skipped": [], "applied": [], "lrs": []}
    for i, (x, y) in enumerate(regression_batches(n)):
        before = [p.detach().clone() for p in model.parameters()]
        out["lrs"].append(optimizer.param_groups[0]["lr"])
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss * float("inf") if i in bad else loss)
        optimizer.step()
        scheduler.step()  # AcceleratedScheduler: not when the optimizer step was skipped
        out["accelerate_skipped"].append(accelerator.optimizer_step_was_skipped)
        out["applied"].append(
            any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        )
    out["scheduler_steps"] = scheduler.scheduler.last_epoch
    out["scaler"] = accelerator.scaler
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_skipped_steps_hold_the_scheduler_as_with_gradscaler(fused):
    """Accelerate sees our skips exactly as it sees GradScaler's: a plain optimizer's skipped
    step sets ``optimizer_step_was_skipped`` and the prepared scheduler does not advance. A fused
    optimizer skips inside its kernel, which Accelerate cannot see (for GradScaler too): the
    scheduler advances there, and ``scaler.step_was_skipped`` is the way to tell."""
    bad = {2, 4}
    ours, torchs = (_run_with_scheduler(k, fused, bad) for k in ("autoscale", "GradScaler"))
    for run in (ours, torchs):
        assert run["applied"] == [i not in bad for i in range(6)]  # both skipped the bad steps
    assert {k: v for k, v in ours.items() if k != "scaler"} == {
        k: v for k, v in torchs.items() if k != "scaler"
    }
    assert ours["scaler"].skipped == 2
    if not fused:
        assert ours["accelerate_skipped"] == [i in bad for i in range(6)]
        assert ours["scheduler_steps"] == 4
        assert ours["lrs"] == [1e-3 * 0.5**k for k in (0, 1, 2, 2, 3, 3)]
    else:
        assert ours["accelerate_skipped"] == [False] * 6
        assert ours["scheduler_steps"] == 6


def test_fused_optimizer_scheduler_held_by_step_was_skipped():
    """The README's way around a fused optimizer: an unprepared scheduler stepped only when
    ``accelerator.scaler.step_was_skipped`` is False."""
    accelerator = make_accelerator("torch", scaler_overrides={"init_scale": SCALE}, cpu=True)
    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    for i, (x, y) in enumerate(regression_batches(6)):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss * float("inf") if i in (2, 4) else loss)
        optimizer.step()
        if not accelerator.scaler.step_was_skipped:
            scheduler.step()
    assert scheduler.last_epoch == 4 and accelerator.scaler.skipped == 2


def test_in_place_of_fsdp1s_sharded_scaler_it_keeps_its_semantics():
    """Accelerate's FSDP1 plugin builds a ShardedGradScaler (fp16 and CPU-offloaded gradients);
    the scaler installed in its place is one too, with the rule's decisions."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.scaler = ShardedGradScaler("cpu")  # what FSDP1's plugin leaves there
    built = install_scaler(accelerator, "auto")
    assert isinstance(built, ShardedGradScaler) and isinstance(built, LossScaler)
    assert accelerator.scaler is built and built.name == "auto"
    plain = Accelerator(mixed_precision="fp16", cpu=True)
    assert not isinstance(install_scaler(plain, "auto"), ShardedGradScaler)
