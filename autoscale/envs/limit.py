"""The hindsight limit: the best any loss-scale policy could have done on recorded steps.

A step overflows at every scale above its threshold (``2^threshold``: fp16's largest value over
the gradient amax, what the trace records) and loses to fp16's underflow a share of its gradient
elements that only falls as the scale rises. So the largest power of two at or under the
threshold, chosen with hindsight for each step, skips nothing a scale can save (a step whose loss
is non-finite fails at any scale) and loses the least precision any scale could: no policy that
sets one scale per step does better on those steps.

:func:`limit_share` turns it into the headline number of a policy's row: the share of the
precision gain over ``torch`` that the limit says was there to win, captured by the policy,
``(P_torch - P_policy) / (P_torch - P_limit)`` (1: all of it; 0: none; below 0: worse than
torch). It says how close a policy is and where there is room (docs/design.md, "The limit").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autoscale.envs.replay_env import LOG2_FP16_MIN_NORMAL
from autoscale.envs.traces import InstanceTrace

__all__ = ["Limit", "episodes_limit", "hindsight_limit", "limit_lines", "limit_share"]


@dataclass(frozen=True)
class Limit:
    """The hindsight limit over a span of recorded steps.

    Attributes:
        log2_scale: Per step, log2 of the largest power-of-two scale that does not overflow it,
            within the episode's bounds (NaN where the loss itself was non-finite).
        precision_loss: Per step, the precision loss at that scale (NaN as above).
        mean_precision_loss: Their mean over the steps a scale can save (the scorecard's
            ``precision_loss`` of a policy that always took the limit).
        unsavable: Steps whose loss was non-finite: skipped at any scale.
    """

    log2_scale: np.ndarray
    precision_loss: np.ndarray
    mean_precision_loss: float
    unsavable: int


def hindsight_limit(
    trace: InstanceTrace,
    hist_edges: np.ndarray,
    start: int = 0,
    steps: int | None = None,
    *,
    min_scale: float = 2.0**-24,
    max_scale: float = 2.0**64,
    log2_min_normal: float = LOG2_FP16_MIN_NORMAL,
) -> Limit:
    """The limit of ``steps`` recorded steps of ``trace`` from ``start`` (default: to its end).

    The limit's scale is clamped into ``[min_scale, max_scale]``, as a scaler's is: a step whose
    threshold lies below the minimum overflows there too, and counts as unsavable.
    """
    end = trace.steps if steps is None else start + steps
    threshold = np.asarray(trace.threshold[start:end], dtype=np.float64)
    nonfinite = np.asarray(trace.nonfinite[start:end], dtype=bool)
    lo, hi = math.log2(min_scale), math.log2(max_scale)
    scale = np.clip(np.floor(np.nan_to_num(threshold, nan=-np.inf, posinf=hi)), None, hi)
    below = scale < lo  # overflows even at the minimum
    scale = np.maximum(scale, lo)
    lost = nonfinite | below
    hist = np.asarray(trace.hist[start:end], dtype=np.float64)
    totals = hist.sum(axis=1, keepdims=True)
    cum = np.concatenate([np.zeros((hist.shape[0], 1)), np.cumsum(hist, axis=1)], axis=1)
    cum = np.divide(cum, totals, out=np.zeros_like(cum), where=totals > 0)
    # the share below the normal minimum at each step's own scale (precision_table's arithmetic)
    x = log2_min_normal - scale
    precision = np.array([np.interp(xi, hist_edges, row) for xi, row in zip(x, cum)])
    log2_scale = np.where(lost, np.nan, scale)
    precision = np.where(lost, np.nan, precision)
    kept = precision[~lost]
    return Limit(
        log2_scale=log2_scale,
        precision_loss=precision,
        mean_precision_loss=float(kept.mean()) if kept.size else math.nan,
        unsavable=int(lost.sum()),
    )


def limit_share(p_torch: float, p_policy: float, p_limit: float) -> float | None:
    """``(P_torch - P_policy) / (P_torch - P_limit)``: the share of the achievable precision gain
    over torch that a policy captures; None where there is no gain to win (torch within 1e-6 of
    the limit) or a value is missing."""
    values = (p_torch, p_policy, p_limit)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return None
    room = p_torch - p_limit
    if room <= 1e-6:
        return None
    return (p_torch - p_policy) / room


def episodes_limit(trace, names: list[str], steps: int, episode) -> tuple[float, int]:
    """The limit over replayed episodes of ``steps`` steps from the start of each of ``names``
    (instances of ``trace``, a :class:`~autoscale.envs.traces.Trace`): the mean of their
    precision losses at the limit, and the steps no scale could save, summed."""
    limits = [
        hindsight_limit(
            trace.instance(name), trace.hist_edges, 0, steps,
            min_scale=episode.min_scale, max_scale=episode.max_scale,
        )
        for name in names
    ]  # fmt: skip
    values = [lim.mean_precision_loss for lim in limits if math.isfinite(lim.mean_precision_loss)]
    mean = sum(values) / len(values) if values else math.nan
    return mean, sum(lim.unsavable for lim in limits)


def limit_lines(precision: dict[str, float], p_limit: float, unsavable: int) -> list[str]:
    """The lines a table of policies ends with: the limit, and each policy's share of it
    (``precision``: name -> mean precision loss over the same episodes, ``torch`` among them)."""
    head = (
        f"hindsight limit: precision loss {100 * p_limit:.2f}% (the largest scale that does not "
        f"overflow each step; {unsavable} step{'' if unsavable == 1 else 's'} fail{'s' if unsavable == 1 else ''} at any scale)"
    )
    if "torch" not in precision:
        return [head, "share of the limit: needs torch's row on the same episodes"]
    lines = [head, "share of the achievable precision gain over torch it captures, "
             "(P_torch - P) / (P_torch - P_limit):"]  # fmt: skip
    width = max(len(n) for n in precision)
    for name, p in precision.items():
        if name == "torch":
            continue
        share = limit_share(precision["torch"], p, p_limit)
        lines.append(
            f"  {name.ljust(width)}  {'n/a (no gain to win)' if share is None else f'{share:.3f}'}"
        )
    return lines
