"""Shared settings of the integration tests."""

from __future__ import annotations

import sys

import pytest
import torch


def _reset_accelerate() -> None:
    # Accelerate keeps one process-wide state; each test builds its own Accelerator.
    if sys.modules.get("accelerate") is not None:  # (None: a test hides it)
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_framework_state():
    """One torch thread (tiny models run fastest so) and a fresh Accelerate state per test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    _reset_accelerate()
    yield
    _reset_accelerate()
    torch.set_num_threads(before)


@pytest.fixture
def clip_spy(monkeypatch):
    """Records the pre-clip total norm of every clip: ``torch.nn.utils.clip_grad_norm_`` (where
    Trainer and Lightning clip, and Accelerate before 1.16) and ``clip_grads_with_norm_`` called
    directly (Accelerate 1.16 measures the norm itself, then clips with it). torch's own
    clip_grad_norm_ calls the latter through its module's name, which this does not patch: no
    clip counts twice."""
    from tests.integrations.helpers import ClipSpy

    spy = ClipSpy(torch.nn.utils.clip_grad_norm_)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    real = torch.nn.utils.clip_grads_with_norm_

    def with_norm(parameters, max_norm, total_norm, *args, **kwargs):
        spy.norms.append(float(total_norm))
        return real(parameters, max_norm, total_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", with_norm)
    return spy
