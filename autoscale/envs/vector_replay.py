"""Replay of parametric rules vectorised over candidates and episodes: K x E lanes in numpy.

The scalar replay (:func:`~autoscale.envs.episodes.drive_episode` with a fresh scaler, through
:class:`~autoscale.envs.ReplayEnv`) takes one step of one episode per Python call of the rule. For
the rules in :data:`VECTOR_RULES` this module steps every lane (a candidate's parameters on one
episode) together, and returns the scorecards the scalar replay returns, equal field by field
(``tests/envs/test_vector_replay.py`` holds them equal over random parameters):

- a step at scale S overflows when the loss was non-finite or ``log2 S`` exceeds the traced
  threshold; its precision loss is interpolated in the same precision table
  (:func:`~autoscale.envs.replay_env.precision_table`) with the same arithmetic;
- ``log2`` is exact where the scalar path's ``math.log2`` is: exponents of powers of two, and
  ``math.log2`` itself for any other scale (numpy's may differ in the last bit), cached;
- the rules' updates are the scalar rules' float operations, float32 rounding and clamps
  (:meth:`~autoscale.scalers.controller.ScaleBounds.clamp`) included, element by element
  (:mod:`autoscale.envs.vector_rules`: the counter rules; :mod:`autoscale.envs.vector_amax`: the
  amax rules); a rule's per-step guard (``amax-loss``) lowers a step's scale as
  :class:`~autoscale.envs.ReplayEnv` does, and ``raise_at_min`` raises where the controller does;
- an episode ends where the scalar one does (three non-finite losses in a row: diverged), and the
  scorecard is :meth:`~autoscale.training.Scorecard.from_steps` of the same columns.

Rules not listed (plugins, exported policies) are not vectorised: callers replay them one by one.
What differs: a rule whose target scale overflows a double (an amax below about 1e-304, where
``2.0 ** k`` raises in the scalar rule) gets infinity, clamped to the maximum, here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from autoscale.envs.replay_env import TABLE_LO, TABLE_SPAN
from autoscale.envs.vector_amax import AMAX_RULES
from autoscale.envs.vector_rules import COUNTER_RULES, LaneRule, f32_lanes
from autoscale.envs.vector_windows import ReplayWindows, replay_windows

__all__ = ["VECTOR_RULES", "ReplayWindows", "replay_windows", "replay_rule"]

# rule -> make(params (K dicts), lanes shape (K, E), windows) -> LaneRule; ``params`` are the built
# rules' own ``params()``
VECTOR_RULES: dict[str, Callable[..., LaneRule]] = {**COUNTER_RULES, **AMAX_RULES}


class _Log2:
    """``math.log2`` of one lane array of positive scales per step, exactly: a lane's scale
    changes on few steps, so only changed lanes are computed; powers of two from their exponent,
    other values through ``math.log2`` itself."""

    def __init__(self) -> None:
        self.x: np.ndarray | None = None
        self.y: np.ndarray | None = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.x is None or self.y is None:
            changed = np.ones(x.shape, dtype=bool)
            y = np.empty(x.shape)
        else:
            changed = x != self.x
            y = self.y.copy()
        if changed.any():
            values = x[changed]
            mant, exp = np.frexp(values)
            logs = (exp - 1).astype(np.float64)
            odd = mant != 0.5
            if odd.any():
                logs[odd] = [math.log2(v) for v in values[odd].tolist()]
            y[changed] = logs
        self.x, self.y = x, y
        return y


class _Clamp:
    """:meth:`ScaleBounds.clamp` elementwise: NaN or below the minimum -> the minimum, above the
    maximum -> the maximum, then float32."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray) -> None:
        self.lo, self.hi = lo, hi

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.where((x != x) | (x < self.lo), self.lo, np.where(x > self.hi, self.hi, x))
        return f32_lanes(x)


# ---------------------------------------------------------------------------- the replay
def _lane_params(rule: str, controllers: list[Any]) -> list[dict[str, Any]]:
    """Each candidate's rule parameters; ValueError for a guard that skips loss spikes, which
    the lanes do not (the scalar replay environment does)."""
    params = [c.rule.params() for c in controllers]
    if any(p.get("spike_bits") for p in params):
        raise ValueError(
            f"replay_rule('{rule}'): a guard that skips loss spikes (spike_bits) is not "
            "vectorised; replay it with the scalar replay environment"
        )
    return params


def replay_rule(
    rule: str,
    scalers: Sequence[Any],
    windows: ReplayWindows,
) -> list[list[Any]]:
    """Scorecards of K candidates of ``rule`` on every episode of ``windows``: ``[k][e]``.

    Args:
        rule: A name in :data:`VECTOR_RULES`.
        scalers: K fresh scalers of ``rule`` (``scaler_for(rule, spec, **params)``): their rule's
            ``params()``, bounds and ``controller.start`` are what the lanes use.
        windows: The episodes (:func:`replay_windows`).

    Returns:
        ``cards[k][e]``: the :class:`~autoscale.training.Scorecard` the scalar replay gives
        candidate k on episode e.
    """
    from autoscale.training import Scorecard

    controllers = [s.controller for s in scalers]
    for c in controllers:
        if c.rule.name != rule:
            raise ValueError(f"replay_rule('{rule}') got a scaler of rule '{c.rule.name}'")
    k_n, e_n, h = len(controllers), len(windows), windows.horizon
    shape = (k_n, e_n)
    lo = np.asarray([c.bounds.min_scale for c in controllers])[:, None]
    hi = np.asarray([c.bounds.max_scale for c in controllers])[:, None]
    clamp, log2 = _Clamp(lo, hi), _Log2()
    env_clamp = _Clamp(np.float64(windows.min_scale), np.float64(windows.max_scale))
    lanes = VECTOR_RULES[rule](_lane_params(rule, controllers), shape, windows)
    aborts = np.asarray([c.raise_at_min for c in controllers])[:, None]
    scale = np.asarray(
        [[c.start(s) for s in windows.start_scale.tolist()] for c in controllers], dtype=np.float64
    )
    scales = np.empty((h, *shape))
    overs = np.empty((h, *shape), dtype=bool)
    precs = np.empty((h, *shape))
    rows = np.arange(e_n)
    for t in range(h):
        scale = env_clamp(scale)  # the env's clamp of the scale a step is taken at
        if lanes.guard is not None:  # the rule's per-step guard, as ReplayEnv applies it
            scale = lanes.guard(t, scale)
        log2_scale = log2(scale)
        over = windows.nonfinite[:, t] | (log2_scale > windows.threshold[:, t])
        pos = np.clip(log2_scale - TABLE_LO, 0.0, TABLE_SPAN)
        low = pos.astype(np.int64)
        frac = pos - low
        table = windows.table[:, t, :]
        at = table[rows, low]
        up = table[rows, np.minimum(low + 1, TABLE_SPAN)]
        exact = (frac == 0.0) | (low + 1 > TABLE_SPAN)
        prec = np.where(exact, at, at * (1 - frac) + up * frac)
        scales[t], overs[t] = scale, over
        precs[t] = np.where(over, np.nan, prec)
        if aborts.any():
            _abort_at_min(rule, lanes, t, over & aborts & (scale <= lo), lo)
        scale = clamp(lanes.step(t, scale, over))
    cards = []
    for k in range(k_n):
        row = []
        for e in range(e_n):
            n = int(windows.steps[e])
            s, o = scales[:n, k, e], overs[:n, k, e]
            row.append(
                Scorecard.from_steps(
                    s.tolist(),
                    o.tolist(),
                    precs[:n, k, e].tolist(),
                    windows.loss[e, :n].tolist(),
                    eval_loss=float(windows.eval_loss[e]),
                    hit_min=bool((o & (s <= windows.min_scale)).any()),
                    wall_s=0.0,
                )
            )
        cards.append(row)
    return cards


def _abort_at_min(rule: str, lanes: LaneRule, t: int, at_min: np.ndarray, lo: np.ndarray) -> None:
    """:meth:`ScaleController.step <autoscale.scalers.controller.ScaleController.step>`'s abort: an
    overflow at the minimum, with ``raise_at_min``, that the rule would answer by lowering the
    scale raises as it does in the scalar replay."""
    from autoscale.errors import MinimumLossScaleError

    if not at_min.any():
        return
    if lanes.backs_off is not None:
        at_min = at_min & lanes.backs_off(t)
    if at_min.any():
        k = int(np.argwhere(at_min)[0][0])
        raise MinimumLossScaleError(
            f"Current loss scale already at minimum ({lo[k, 0]:g}) and the step "
            f"overflowed again (rule '{rule}'); lower min_scale or set raise_at_min=False"
        )
