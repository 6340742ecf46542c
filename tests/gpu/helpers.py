"""Shared by the CUDA tests."""

from __future__ import annotations

import warnings

import torch


def count_syncs(fn) -> int:
    """Synchronizing CUDA calls made by ``fn`` (torch.cuda.set_sync_debug_mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum(1 for w in seen if "synchroniz" in str(w.message))
