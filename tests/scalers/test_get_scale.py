"""``get_scale()`` is what torch's GradScaler returns: between ``scale()`` and ``update()`` the
factor the loss was multiplied by, after ``update()`` the scale the next step starts from. A rule
that guards each step (``auto``) may lower a step's scale below its base; ``get_base_scale()``
gives the base."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import autoscale

from .helpers import SCALERS, make

SPIKES = {15, 30}  # steps whose loss is 3000 times larger


def _spiky_steps(scaler, n: int = 40):
    """A 4-to-1 linear layer under fp16 autocast; yields, per step, the loss, the scaled loss
    and the scaled gradients (between ``scale()`` and ``unscale_()``), then the unscaled ones."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y) * (3000.0 if i in SPIKES else 1.0)
        scaled = scaler.scale(loss)
        scaled.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        yield i, loss, scaled, grads
        scaler.unscale_(opt)
        yield i, [p.grad for p in model.parameters()]
        scaler.step(opt)
        scaler.update()


def test_auto_reports_the_scale_its_guard_applied():
    """The issue's case: under auto, the guard lowers most steps' scale below the base (by up
    to 2^12 on a spike); get_scale() between scale() and step() is the applied factor, and
    dividing the scaled gradients by it is what unscale_ does."""
    scaler = autoscale.get_scaler("auto", device="cpu")
    lowered, steps = [], _spiky_steps(scaler)
    for i, loss, scaled, grads in steps:
        applied = scaled.item() / loss.item()
        assert scaler.get_scale() == applied, i
        assert scaler.get_scale() <= scaler.get_base_scale()
        lowered.append(scaler.get_base_scale() / applied)
        _, unscaled = next(steps)
        assert scaler.get_scale() == applied  # still the step's, after unscale_
        for mine, theirs in zip([g / scaler.get_scale() for g in grads], unscaled):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=0)
    assert sum(r > 1 for r in lowered) >= 30  # the guard is what this test is about
    assert max(lowered) >= 2.0**12 and all(lowered[i] >= 2.0**11 for i in SPIKES)
    # after update(): the scale the next step starts from
    assert scaler.get_scale() == scaler.get_base_scale() == scaler.state_dict()["scale"]


@pytest.mark.parametrize("name", list(SCALERS))
def test_get_scale_is_the_factor_of_the_scaled_loss(name):
    """Every scaler: mid-step get_scale() is the multiplier of the loss; after update() it is
    get_base_scale(), the host copy, as the state saves it."""
    scaler = make(name, init_scale=2.0**10)
    steps = _spiky_steps(scaler, 20)
    for i, loss, scaled, _ in steps:
        if math.isfinite(scaled.item()):
            assert scaler.get_scale() == scaled.item() / loss.item(), i
        assert scaler.get_scale() == scaler._scale.item()
        next(steps)
    assert scaler.get_scale() == scaler.get_base_scale() == scaler.state_dict()["scale"]


def test_get_base_scale_when_disabled():
    scaler = make("auto", enabled=False)
    assert scaler.get_scale() == scaler.get_base_scale() == 1.0


def test_a_guarded_step_that_raises_at_the_minimum_leaves_the_next_step_honest():
    """The guard lowered a step to the minimum, it overflowed there and ``update()`` raised
    (``raise_at_min``); a loop that catches the error and goes on multiplies the next loss by
    the scale ``get_scale()`` reports, not by the guarded step's minimum left in the tensor."""
    from autoscale.errors import MinimumLossScaleError

    scaler = autoscale.get_scaler(
        "amax-loss", device="cpu", init_scale=1024.0, min_scale=1.0, raise_at_min=True
    )
    scaler.rule.ratios.append(1e6)  # foresees a huge amax per loss: the guard takes the minimum
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    # a finite loss whose gradient overflows (d sqrt(x)/dx at 0), at the guarded scale 1.0
    scaler.scale((torch.sqrt(w - 1.0) + 2.0).sum()).backward()
    assert scaler.get_scale() == 1.0
    scaler.step(opt)
    with pytest.raises(MinimumLossScaleError):
        scaler.update()
    # the next step is not guarded below the base
    scaler.rule.guard.load_state({"ratios": [], "ratio_losses": [], "losses": []}, "test")
    opt.zero_grad()
    loss = (w * 3.0).sum()
    scaled = scaler.scale(loss)
    assert scaled.item() / loss.item() == scaler.get_scale() == scaler.get_base_scale()
