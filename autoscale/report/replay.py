"""What other rules would have done on a recorded run: its steps replayed through each rule.

Each step of the record keeps its overflow threshold (the log2 scale above which its backward
overflows fp16), whether its loss was non-finite, its gradient statistics and a histogram of
log2|g|. A rule replayed on it sets a scale each step; the step overflows when its loss was
non-finite or the scale lies above the threshold, and loses the share of gradient elements that
the histogram puts below fp16's normal range at that scale. This is the replay environment's
model (:class:`autoscale.envs.ReplayEnv`), on a user's record instead of a workload's trace.

Limits, said wherever the numbers are shown: the steps go on as recorded, so what a different
skip would have changed later is not seen; a threshold estimated from the parameter gradients
(the default) can lie above the backward's true one; a step that overflowed in the recording
only says its threshold lies below the scale it used.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from autoscale.envs.from_records import trace_from_record
from autoscale.envs.traces import InstanceTrace, Trace
from autoscale.observe import RunRecord
from autoscale.scalers import StepStats, make_scaler
from autoscale.scalers.loss_guard import is_spike, step_scale_host

__all__ = ["LIMITS", "Outcome", "RecordReplay"]

LOG2_FP16_MIN_NORMAL = -14.0
LIMITS = (
    "Replay of this run's recorded steps: each rule sets the scale step by step; a step overflows "
    "when its loss was non-finite or the scale exceeds the step's recorded overflow threshold, and "
    "loses the gradient elements its recorded histogram puts below fp16's range. The run goes on "
    "as recorded (what another rule's skips would have changed later is not seen); thresholds "
    "{how}; a step that overflowed in the recording only bounds its threshold from above."
)


@dataclass
class Outcome:
    """What one scaler did (recorded) or would have done (replayed) on the run's steps."""

    name: str
    replayed: bool
    scales: np.ndarray
    skipped: np.ndarray  # bool per step
    precision: np.ndarray  # share of gradient elements below fp16's range per step (NaN: skipped)
    at_min: int = 0
    min_scale: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return int(self.scales.shape[0])

    @property
    def skip_rate(self) -> float:
        return float(self.skipped.mean()) if self.steps else math.nan

    @property
    def precision_loss(self) -> float:
        """Mean over applied steps (the scorecard's definition)."""
        applied = self.precision[~self.skipped]
        applied = applied[np.isfinite(applied)]
        return float(applied.mean()) if applied.size else math.nan


class RecordReplay:
    """A record, ready to replay rules on.

    Args:
        record: The :class:`~autoscale.observe.RunRecord`.
    """

    def __init__(self, record: RunRecord) -> None:
        self.record = record
        self.trace: Trace = trace_from_record(record)
        self.inst: InstanceTrace = next(iter(self.trace.instances.values()))
        hist = self.inst.hist.astype(np.float64)
        totals = hist.sum(axis=1, keepdims=True)
        cum = np.concatenate([np.zeros((hist.shape[0], 1)), np.cumsum(hist, axis=1)], axis=1)
        # per step, the share of counted elements below each histogram edge (NaN: no histogram)
        self.cumulative = np.divide(cum, totals, out=np.full_like(cum, np.nan), where=totals > 0)
        self._lo = float(self.trace.hist_edges[0])
        measured = record.meta.get("threshold") == "measured"
        self.limits = LIMITS.format(
            how="were measured from every fp16 tensor of each backward"
            if measured
            else "were estimated from the parameter gradients' amax, which can err either way: "
            "activation gradients inside the backward can overflow first (replayed scales look "
            "safer than they were), and gradients summed over accumulated micro-batches or "
            "computed in fp32 (LayerNorm, embeddings) can be larger than any fp16 tensor of the "
            "backward (replay marks steps overflowed that ran fine)"
        )

    def precision_at(self, log2_scales: np.ndarray) -> np.ndarray:
        """Share of each step's gradient elements below fp16's normal range at these scales."""
        x = LOG2_FP16_MIN_NORMAL - np.asarray(log2_scales, dtype=np.float64) - self._lo
        x = np.clip(x, 0.0, self.cumulative.shape[1] - 1.0)
        i = np.minimum(np.floor(x).astype(int), self.cumulative.shape[1] - 2)
        frac = x - i
        rows = np.arange(self.cumulative.shape[0])
        return self.cumulative[rows, i] * (1.0 - frac) + self.cumulative[rows, i + 1] * frac

    def recorded(self) -> Outcome:
        """What the run's own scaler did."""
        t = self.inst
        skipped = np.asarray(self.record.column("found_inf", False), dtype=bool)
        precision = self.precision_at(np.log2(t.scale))
        precision[skipped] = np.nan
        # only steps with their own histogram count (others reuse an earlier one)
        own = np.asarray([s.get("hist") is not None for s in self.record.steps], dtype=bool)
        precision[~own] = np.nan
        min_scale = float(self.record.meta.get("min_scale") or 0.0)
        at_min = int((t.scale <= min_scale).sum()) if min_scale else 0
        name = str(self.record.meta.get("scaler", "recorded"))
        return Outcome(
            f"{name} (recorded)", False, t.scale.copy(), skipped, precision, at_min, min_scale
        )

    def replay(self, name: str, **params) -> Outcome:
        """Replay the scaler ``name`` (a rule or an exported policy; ``params`` override its
        parameters) from the run's first scale."""
        params = {"init_scale": float(self.inst.start_scale), **params}
        # a policy given by its folder's path is shown by the folder's name
        label = Path(name).name if os.sep in name or "/" in name else name
        return self.replay_scaler(make_scaler(name, device="cpu", **params), label)

    def replay_scaler(self, scaler: Any, name: str) -> Outcome:
        """Replay a fresh CPU scaler (from its own initial scale) over the run's steps."""
        rule, ctrl = scaler.rule, scaler.controller
        min_scale = ctrl.bounds.min_scale
        t = self.inst
        n = t.steps
        thr, nonfinite, loss = t.threshold.tolist(), t.nonfinite.tolist(), t.scaler_loss.tolist()
        amax, rms = t.amax.tolist(), t.rms.tolist()
        scales = np.empty(n)
        skipped = np.zeros(n, dtype=bool)
        scale = scaler.get_scale()
        guard = getattr(rule, "has_guard", False)
        for i in range(n):
            s = scale
            guarded = spiked = False
            if guard:
                spiked = is_spike(rule, loss[i])
                s = step_scale_host(rule, scale, loss[i], ctrl.bounds)
                guarded = s < scale
            over = nonfinite[i] or math.log2(s) > thr[i]
            stats = StepStats(
                i,
                s,
                over or spiked,
                math.inf if over else amax[i],
                math.inf if over else rms[i],
                loss[i],
                True,
                guarded,
                spiked,
            )
            scales[i] = s
            skipped[i] = over or spiked
            scale = ctrl.step(stats)
        precision = self.precision_at(np.log2(scales))
        precision[skipped] = np.nan
        return Outcome(
            name, True, scales, skipped, precision, int((scales <= min_scale).sum()), min_scale
        )
