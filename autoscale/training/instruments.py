"""Gradient statistics of the instrumented step: cheap exact counts, and the recording extras.

:class:`GradientCensus` copies every gradient's magnitude into one flat float32 buffer (a single
batched ``cat``) that it keeps between steps, then counts with a few whole-buffer ops: no Python
loop over parameters beyond gathering them, no allocation per step (on CPU, a fresh gradient-sized
allocation costs page faults every step), no host sync. :class:`BackwardAmaxMode` runs only when a
run records traces.
"""

from __future__ import annotations

import math
import struct

import torch

from autoscale.observe.record import HIST_EDGES, HIST_HI, HIST_LO
from autoscale.observe.watch import BackwardAmaxMode
from autoscale.observe.watch import log2_histogram as histogram_of
from autoscale.scalers.controller import FP16_MIN_NORMAL
from autoscale.scalers.grad_stats import FlatAbs

__all__ = [
    "HIST_EDGES",
    "HIST_LO",
    "HIST_HI",
    "GradientCensus",
    "underflow_counts",
    "log2_histogram",
    "BackwardAmaxMode",
]

_F32_MAX = 3.4028234663852886e38


class GradientCensus:
    """Counts over the magnitudes of a list of gradients, in a buffer reused from step to step.

    Call :meth:`load` once per step, then any of :meth:`underflow_counts` and
    :meth:`log2_histogram`. Holds a float32 buffer of |g| (its own, or the scaler's: :meth:`adopt`) and an int32
    scratch buffer, each the size of all gradients.
    """

    def __init__(self) -> None:
        self._flat = FlatAbs()
        self._abs: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None

    def load(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Copy ``|g|`` of every gradient into the flat buffer (float32, on ``grads[0]``'s device)."""
        return self.adopt(self._flat.load(grads))

    def adopt(self, flat: torch.Tensor) -> torch.Tensor:
        """Count over ``flat`` (``|g|``, float32, one dimension) instead of a copy of its own: the
        buffer a :class:`~autoscale.scalers.scaler.LossScaler` filled for its statistics."""
        self._abs = flat
        if (
            self._scratch is None
            or self._scratch.numel() != flat.numel()
            or self._scratch.device != flat.device
        ):
            self._scratch = torch.empty(flat.numel(), dtype=torch.int32, device=flat.device)
        return flat

    def underflow_counts(self, scale: float, min_normal: float = FP16_MIN_NORMAL) -> torch.Tensor:
        """``[below, nonzero]`` (int64): non-zero elements with ``|g| * scale < min_normal``, and all.

        ``min_normal`` defaults to fp16's normal minimum 2^-14. Exact integer counts. With
        non-finite gradients the counts mean nothing; such a step is skipped and its precision
        loss is NaN anyway.
        """
        flat = self._abs
        limit = min_normal / scale
        limit = limit if limit <= _F32_MAX else math.inf  # beyond float32: every finite |g|
        # at least 1: a limit that rounds to 0 in float32 has no non-zero |g| below it
        bound = max(struct.unpack("<i", struct.pack("<f", limit))[0], 1)
        # |g| >= 0, so float order is the order of the bit patterns: integer ops, which CPUs
        # vectorize better than float compares into bool (NaN's pattern is above every bound).
        # clamp(bits, bound-1, bound) - (bound-1) is 1 where |g| >= limit, else 0 (counting its
        # non-zeros is cheaper than an int64 sum of the clamp, with the buffer out of cache as in
        # the step)
        bits = flat.view(torch.int32)
        nonzero = torch.count_nonzero(bits)
        torch.clamp(bits, min=bound - 1, max=bound, out=self._scratch).sub_(bound - 1)
        at_or_above = torch.count_nonzero(self._scratch)
        return torch.stack([nonzero - at_or_above, nonzero])

    def log2_histogram(self) -> torch.Tensor:
        """Counts (int64, 80 bins of :data:`HIST_EDGES`) of ``floor(log2|g|)`` over finite
        non-zero elements (:func:`autoscale.observe.watch.log2_histogram` of the buffer)."""
        return histogram_of(self._abs)


def underflow_counts(
    grads: list[torch.Tensor], scale: float, min_normal: float = FP16_MIN_NORMAL
) -> torch.Tensor:
    """One-off :meth:`GradientCensus.underflow_counts` of ``grads`` (unscaled gradients)."""
    census = GradientCensus()
    census.load(grads)
    return census.underflow_counts(scale, min_normal)


def log2_histogram(grads: list[torch.Tensor]) -> torch.Tensor:
    """One-off :meth:`GradientCensus.log2_histogram` of ``grads``."""
    census = GradientCensus()
    census.load(grads)
    return census.log2_histogram()
