"""What a training step leaves behind (:class:`StepRecord`) and a run's saved state (:class:`Snapshot`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from autoscale.scalers.controller import FP16_MAX, StepStats

__all__ = ["StepRecord", "Snapshot"]


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step of a :class:`~autoscale.training.TrainingRun`.

    Metric definitions are in :mod:`autoscale.training.scorecard`.

    Attributes:
        step: 0-based step index of the run.
        scale: Loss scale this step used.
        found_inf: The gradients held a non-finite value; the step was skipped.
        loss: Unscaled training objective (mean over the accumulation micro-batches, before the
            scenario's loss weight); inf/NaN when non-finite.
        loss_nonfinite: The loss itself was non-finite: the step fails at any scale.
        grad_amax: Max |unscaled gradient| (inf/NaN when ``found_inf``).
        grad_rms: RMS of the unscaled gradient elements.
        precision_loss: Share of non-zero gradient elements below fp16's normal range at this
            scale; NaN when ``found_inf``.
        lr: Learning rate of this step.
        wall_s: Wall-clock seconds of this step.
        stats: The scaler's ``last_stats`` after this step (the record its rule saw).
        grad_log2_hist: Only when recording: fractions (summing to 1) of the finite non-zero
            unscaled gradient elements per 1-bit bin of log2|g|, bins
            :data:`~autoscale.training.instruments.HIST_EDGES` (-64 .. +16, ends open).
            None when not recording or when no element was finite and non-zero.
        backward_amax: Only when recording in fp16: max |x| over every fp16 tensor the backward
            pass produced (activation gradients included), at the scale used; inf if any was
            non-finite; None otherwise.
    """

    step: int
    scale: float
    found_inf: bool
    loss: float
    loss_nonfinite: bool
    grad_amax: float
    grad_rms: float
    precision_loss: float
    lr: float
    wall_s: float
    stats: StepStats
    grad_log2_hist: tuple[float, ...] | None = None
    backward_amax: float | None = None

    @property
    def overflow_threshold_log2(self) -> float | None:
        """log2 of the smallest scale at which this step's backward would overflow fp16.

        ``log2(65504 * scale / backward_amax)``: the backward is linear in the scale, so one pass
        at a safe scale predicts the threshold. None unless recorded, finite and non-zero.
        """
        amax = self.backward_amax
        if amax is None or not (math.isfinite(amax) and amax > 0):
            return None
        return math.log2(FP16_MAX * self.scale / amax)

    def to_dict(self) -> dict[str, Any]:
        """Primitives only (``stats`` as a dict, the histogram as a list)."""
        out = asdict(self)
        out["stats"] = self.stats.to_dict()
        if self.grad_log2_hist is not None:
            out["grad_log2_hist"] = list(self.grad_log2_hist)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRecord:
        """The record :meth:`to_dict` wrote."""
        hist = d.get("grad_log2_hist")
        return cls(
            **{
                **d,
                "stats": StepStats(**d["stats"]),
                "grad_log2_hist": None if hist is None else tuple(hist),
            }
        )


@dataclass(frozen=True)
class Snapshot:
    """In-memory state of a :class:`~autoscale.training.TrainingRun` (see ``snapshot()``).

    Tensors are private copies: training on after the snapshot never changes it, and one
    snapshot can be restored any number of times.
    """

    step_index: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    scaler: dict[str, Any]
    scaler_last_stats: StepStats | None
    rng: dict[str, Any]
    data: dict[str, Any]
    scenario: dict[str, Any]
    records: tuple[StepRecord, ...]
    extra: dict[str, Any] | None = None  # the learning rates' base, a user's scheduler
