"""Shared settings of the integration tests."""

from __future__ import annotations

import sys

import pytest
import torch


def _reset_accelerate() -> None:
    # Accelerate keeps one process-wide state; each test builds its own Accelerator.
    if "accelerate" in sys.modules:
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
    """Records the pre-clip total norm of every ``torch.nn.utils.clip_grad_norm_`` call, which is
    where Accelerate, Trainer and Lightning clip."""
    from tests.integrations.helpers import ClipSpy

    spy = ClipSpy(torch.nn.utils.clip_grad_norm_)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    return spy
