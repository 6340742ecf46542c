"""The scorecard: the one place where every metric of a training run is defined.

The CLI, the environment's reward, the search objective and the experiments all read these
definitions; none recomputes a metric its own way.

Per-step quantities (on :class:`~autoscale.training.StepRecord`):

- **skipped**: the step's gradients held a non-finite value (``found_inf``): the optimizer step
  was not applied.
- **precision_loss** of a step that used loss scale ``S``: the fraction of non-zero gradient
  elements whose *scaled* magnitude ``|g| * S`` lies below the fp16 normal minimum ``2^-14``
  (where fp16 keeps fewer than 11 significant bits, down to flushing to zero below ``2^-24``).
  ``g`` is the unscaled gradient the optimizer receives, before clipping; elements that are
  exactly zero (including those already flushed to zero) are not counted. NaN on skipped steps.
  Runs whose autocast dtype is bf16 or fp32 use their own normal minimum, ``2^-126``, instead of
  fp16's (so an unscaled bf16 run is not charged for fp16's narrow range).
- **loss**: the unscaled training objective of the step (mean over its micro-batches, before any
  scenario loss weight); inf/NaN when non-finite.

Per-run quantities (:class:`Scorecard`), over the N steps of a run:

- ``skipped``: number of skipped steps; ``skip_rate = skipped / N``.
- ``precision_loss``: the per-step precision loss averaged over applied (non-skipped) steps.
- ``final_loss``: mean of the finite training losses over the last ``max(1, N // 10)`` applied
  steps (NaN if there are none).
- ``eval_loss``: ``TrainingRun.eval_loss()`` at the end (held-out batches, never trained on).
- ``min_scale``, ``max_scale``: smallest and largest loss scale used by any of the N steps.
- ``hit_min``: the scaler had an overflow while at its minimum scale (``scaler.hit_min``).
- ``diverged``: non-finite parameters, or a non-finite eval loss.
- ``wall_s``: wall-clock seconds of the N training steps (evaluation excluded).
- ``useful_steps_per_s = (N - skipped) / wall_s``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import TYPE_CHECKING, Any

from autoscale.errors import ConfigError
from autoscale.training.instruments import HIST_LO

if TYPE_CHECKING:
    from autoscale.training.records import StepRecord

__all__ = [
    "Scorecard",
    "FP16_MIN_NORMAL_LOG2",
    "precision_loss_from_counts",
    "precision_loss_from_hist",
    "step_metrics",
    "summarize",
    "json_safe",
]

FP16_MIN_NORMAL_LOG2 = -14


def precision_loss_from_counts(below: float, nonzero: float, found_inf: bool) -> float:
    """Precision loss of one step from its counts (see the module docstring).

    Args:
        below: Non-zero elements with ``|g| * S < 2^-14``.
        nonzero: All non-zero elements.
        found_inf: The step was skipped (gives NaN).
    """
    if found_inf or not (math.isfinite(below) and math.isfinite(nonzero)):
        return math.nan
    return below / nonzero if nonzero > 0 else 0.0


def precision_loss_from_hist(
    hist: Sequence[float], log2_scale: float, log2_min_normal: float = FP16_MIN_NORMAL_LOG2
) -> float:
    """Precision loss at scale ``2**log2_scale`` of a step whose log2|g| histogram is ``hist``.

    ``hist`` holds fractions per 1-bit bin of :data:`~autoscale.training.instruments.HIST_EDGES`
    (``StepRecord.grad_log2_hist``). An element is lost when ``log2|g| + log2_scale < log2_min_normal``;
    bins wholly below that threshold count fully, the bin containing it counts in proportion
    (exact for integer ``log2_scale``, a linear interpolation otherwise). Lets a replay evaluate
    any scale without re-running the step. ``log2_min_normal``: -14 for fp16, -126 for bf16.
    """
    cut = log2_min_normal - log2_scale - HIST_LO  # threshold in bin units from the first edge
    if cut <= 0:
        return 0.0
    full = min(int(math.floor(cut)), len(hist))
    total = math.fsum(hist[:full])
    if full < len(hist):
        total += hist[full] * (cut - full)
    return min(1.0, total)


def step_metrics(record: StepRecord) -> dict[str, float]:
    """The per-step terms a reward uses: ``skipped`` (0/1), ``precision_loss``, ``loss``."""
    return {
        "skipped": float(record.found_inf),
        "precision_loss": record.precision_loss,
        "loss": record.loss,
    }


@dataclass(frozen=True)
class Scorecard:
    """The metrics of one run (definitions in this module's docstring). JSON via :meth:`to_json`."""

    steps: int
    skipped: int
    skip_rate: float
    precision_loss: float
    final_loss: float
    eval_loss: float
    min_scale: float
    max_scale: float
    hit_min: bool
    diverged: bool
    wall_s: float
    useful_steps_per_s: float

    @classmethod
    def from_records(
        cls,
        records: Sequence[StepRecord],
        *,
        eval_loss: float,
        hit_min: bool,
        wall_s: float,
        params_finite: bool = True,
    ) -> Scorecard:
        """Score the steps ``records``.

        Args:
            records: The run's steps, in order.
            eval_loss: Held-out loss at the end.
            hit_min: ``scaler.hit_min``.
            wall_s: Wall-clock seconds of the steps.
            params_finite: Whether every parameter is finite at the end (else ``diverged``).
        """
        return cls.from_steps(
            [r.scale for r in records],
            [r.found_inf for r in records],
            [r.precision_loss for r in records],
            [r.loss for r in records],
            eval_loss=eval_loss,
            hit_min=hit_min,
            wall_s=wall_s,
            params_finite=params_finite,
        )

    @classmethod
    def from_steps(
        cls,
        scales: Sequence[float],
        found_inf: Sequence[bool],
        precision_loss: Sequence[float],
        loss: Sequence[float],
        *,
        eval_loss: float,
        hit_min: bool,
        wall_s: float,
        params_finite: bool = True,
    ) -> Scorecard:
        """Score a run from its steps' columns (:meth:`from_records` of records with these
        ``scale``, ``found_inf``, ``precision_loss`` and ``loss``; the vectorised replay's path)."""
        steps = len(scales)
        if not steps:
            raise ConfigError("a scorecard needs at least one step")
        kept = [not f for f in found_inf]  # applied steps
        applied_loss = list(compress(loss, kept))
        skipped = steps - len(applied_loss)
        tail = [x for x in applied_loss[-max(1, steps // 10) :] if math.isfinite(x)]
        eval_loss = float(eval_loss)
        return cls(
            steps=steps,
            skipped=skipped,
            skip_rate=skipped / steps,
            precision_loss=_mean(compress(precision_loss, kept)),
            final_loss=_mean(tail),
            eval_loss=eval_loss,
            min_scale=min(scales),
            max_scale=max(scales),
            hit_min=bool(hit_min),
            diverged=not params_finite or not math.isfinite(eval_loss),
            wall_s=float(wall_s),
            useful_steps_per_s=len(applied_loss) / wall_s if wall_s > 0 else math.nan,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (non-finite floats stay floats; :meth:`to_json` turns them to null)."""
        return dataclasses.asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        """Strict JSON: NaN and infinities are written as ``null``."""
        return json.dumps(json_safe(self.to_dict()), allow_nan=False, **kwargs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scorecard:
        """Inverse of :meth:`to_dict` (and of :meth:`to_json` after ``json.loads``: null -> NaN)."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise ConfigError(f"scorecard lacks {', '.join(missing)}")
        return cls(**{n: math.nan if d[n] is None else d[n] for n in names})


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return math.fsum(values) / len(values) if values else math.nan


def summarize(cards: Sequence[Scorecard]) -> dict[str, dict[str, float]]:
    """Mean, sample standard deviation, min and max of every metric over ``cards`` (e.g. seeds).

    Booleans become rates (the mean of 0/1). A NaN in any card makes that metric's summary NaN.
    """
    if not cards:
        raise ConfigError("nothing to summarize: no scorecards")
    out: dict[str, dict[str, float]] = {}
    for f in dataclasses.fields(Scorecard):
        values = [float(getattr(c, f.name)) for c in cards]
        if any(math.isnan(v) for v in values):
            out[f.name] = {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan}
            continue
        std = (
            statistics.stdev(values)
            if len(values) > 1 and all(math.isfinite(v) for v in values)
            else 0.0
        )
        out[f.name] = {"mean": _mean(values), "std": std, "min": min(values), "max": max(values)}
    return out


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (for strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
