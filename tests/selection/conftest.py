"""Shared settings of the build tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The build's models are tiny: one intra-op thread is as fast, and does not fight other
    processes for the cores (OpenMP threads spinning on a shared machine slow a build severalfold).
    Module-scoped so that it covers the module-scoped builds too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
