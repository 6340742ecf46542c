"""The built-in ``torch`` rule reproduces ``torch.amp.GradScaler`` bit for bit (docs/design.md 3.2)."""

from __future__ import annotations

import pytest
import torch

import autoscale
from tests.scalers.helpers import adamw, assert_same_params, batches, run, tiny_model

STEPS = 30
# Injected inf losses, plus the natural fp16 overflows that a high initial scale causes.
INF_STEPS = {1, 2, 7, 13, 14, 15, 22}

OPTIMIZERS = pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
FACTORS = pytest.mark.parametrize(
    "factors",
    [
        {"growth_factor": 2.0, "backoff_factor": 0.5},
        # non-powers of two: the scale is rounded to float32 at every change, as torch's kernel does
        {"growth_factor": 1.5, "backoff_factor": 0.3},
    ],
    ids=["2-0.5", "1.5-0.3"],
)


def _pair(fused: bool, factors: dict, init_scale: float):
    kw = {"init_scale": init_scale, "growth_interval": 3, **factors}
    runs = []
    for scaler in (
        torch.amp.GradScaler("cpu", **kw),
        autoscale.get_scaler("torch", device="cpu", **kw),
    ):
        model = tiny_model()
        runs.append((model, adamw(model, fused=fused), scaler))
    return runs


@OPTIMIZERS
@FACTORS
@pytest.mark.parametrize("init_scale", [2.0**10, 2.0**20], ids=["init-2^10", "init-2^20"])
def test_same_scales_skips_and_parameters(fused, factors, init_scale):
    data = batches(STEPS)
    (m_ref, o_ref, ref), (m_ours, o_ours, ours) = _pair(fused, factors, init_scale)
    a = run(m_ref, o_ref, ref, data, INF_STEPS)
    b = run(m_ours, o_ours, ours, data, INF_STEPS)
    assert b.scales == a.scales
    assert b.after == a.after
    assert b.skipped == a.skipped
    assert set(INF_STEPS) <= set(a.skipped)
    assert any(new > old for old, new in zip(a.scales, a.after))  # the scale grew at least once
    assert_same_params(m_ours, m_ref)
    assert ours.state_dict()["scale"] == ref.state_dict()["scale"]
    assert ours.state_dict()["_growth_tracker"] == ref.state_dict()["_growth_tracker"]


def test_natural_overflows_happen_at_a_high_scale():
    data = batches(STEPS)
    (m_ref, o_ref, ref), _ = _pair(False, {}, 2.0**20)
    trace = run(m_ref, o_ref, ref, data, INF_STEPS)
    assert set(trace.skipped) - INF_STEPS, (
        "the high-scale parity case no longer overflows by itself"
    )


@OPTIMIZERS
def test_resume_from_a_gradscaler_checkpoint(fused):
    data = batches(20)
    (m_ref, o_ref, ref), (m_ours, o_ours, ours) = _pair(
        fused, {"growth_factor": 1.5, "backoff_factor": 0.3}, 2.0**12
    )
    run(m_ref, o_ref, ref, data[:9], INF_STEPS)
    run(m_ours, o_ours, ours, data[:9], INF_STEPS)
    # a checkpoint written by plain GradScaler restores the scale and the growth tracker
    fresh = autoscale.get_scaler(
        "torch", device="cpu", growth_interval=3, growth_factor=1.5, backoff_factor=0.3
    )
    fresh.load_state_dict(ref.state_dict())
    assert fresh.get_scale() == ref.get_scale()
    assert fresh.state_dict()["_growth_tracker"] == ref.state_dict()["_growth_tracker"] > 0
    a = run(m_ref, o_ref, ref, data[9:], INF_STEPS, start=9)
    b = run(m_ours, o_ours, fresh, data[9:], INF_STEPS, start=9)
    assert b.scales == a.scales and b.skipped == a.skipped
    assert_same_params(m_ours, m_ref)
