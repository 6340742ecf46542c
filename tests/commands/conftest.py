"""Shared setup of the command tests (same thread setting as tests/training)."""

from tests.training.conftest import torch  # noqa: F401  (sets one intra-op thread)
