"""Replay of parametric rules vectorised over candidates and episodes: K x E lanes in numpy.

The scalar replay (:func:`~autoscale.agents.evaluate.drive_episode` with a fresh scaler, through
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
  (:meth:`~autoscale.scalers.rule.ScaleBounds.clamp`) included, element by element;
- an episode ends where the scalar one does (three non-finite losses in a row: diverged), and the
  scorecard is :meth:`~autoscale.training.Scorecard.from_steps` of the same columns.

Rules with a per-step guard, or not listed, are not vectorised: callers replay them one by one.
What differs: a rule whose target scale overflows a double (an amax below about 1e-304, where
``2.0 ** k`` raises in the scalar rule) gets infinity, clamped to the maximum, here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoscale.envs.replay_env import TABLE_HI, TABLE_LO, TABLE_SPAN, precision_table
from autoscale.scalers.rule import FP16_MAX
from autoscale.scalers.rules import HALF_BIT

__all__ = ["VECTOR_RULES", "ReplayWindows", "replay_windows", "replay_rule"]

NONFINITE_RUN = 3  # non-finite losses in a row that end an episode (ScaleEnvBase._take)


@dataclass(frozen=True)
class ReplayWindows:
    """E episodes' trace columns, stacked: what the replay reads of each step.

    Attributes:
        nonfinite, threshold, loss, amax: ``(E, h)`` trace columns of the episodes' steps.
        table: ``(E, h, TABLE_SPAN + 1)`` precision loss at integer log2 scales.
        start_scale: ``(E,)`` the scale each episode starts from (as ``reset`` reports it).
        eval_loss: ``(E,)`` the recording's eval loss of each episode's instance.
        steps: ``(E,)`` each episode's length (shorter than h where it diverged).
        min_scale, max_scale: the env's bounds (its clamp of each step's scale, and ``hit_min``).
    """

    nonfinite: np.ndarray
    threshold: np.ndarray
    loss: np.ndarray
    amax: np.ndarray
    table: np.ndarray
    start_scale: np.ndarray
    eval_loss: np.ndarray
    steps: np.ndarray
    min_scale: float
    max_scale: float

    @property
    def horizon(self) -> int:
        return int(self.threshold.shape[1])

    def __len__(self) -> int:
        return int(self.threshold.shape[0])


def replay_windows(env: Any, episodes: Sequence[tuple[str, int]]) -> ReplayWindows:
    """The windows of ``episodes`` (``(instance, offset)`` pairs, as ``drive_episode`` takes
    them) of ``env``: a :class:`~autoscale.envs.ReplayEnv`, or a
    :class:`~autoscale.envs.suite_env.SuiteEnv` over traces (``MEMBER:INSTANCE`` names).
    Resets ``env`` once per episode, to read its start scale."""
    h = env.episode_steps
    cols: dict[str, list] = {k: [] for k in ("nonfinite", "threshold", "loss", "amax", "table")}
    starts, evals, lengths = [], [], []
    tables: dict[tuple[int, str], np.ndarray] = {}
    kept: set[tuple[float, float]] = set()
    bounds = (math.nan, math.nan)
    for instance, offset in episodes:
        _, info = env.reset(options={"instance": instance, "offset": offset})
        replay = getattr(env, "current", env)  # a SuiteEnv's member env
        name = replay.instance.name
        t = replay.trace.instance(name)
        key = (id(replay), name)
        if key not in tables:
            scales = np.arange(TABLE_LO, TABLE_HI + 1, dtype=np.float64)
            tables[key] = precision_table(
                t.hist, replay.trace.hist_edges, scales, replay.log2_min_normal
            )
        window = slice(info["offset"], info["offset"] + h)
        nonfinite = t.nonfinite[window].astype(bool)
        cols["nonfinite"].append(nonfinite)
        cols["threshold"].append(t.threshold[window].astype(np.float64))
        cols["loss"].append(t.loss[window].astype(np.float64))
        cols["amax"].append(t.amax[window].astype(np.float64))
        cols["table"].append(tables[key][window])
        starts.append(float(info["scale"]))
        bounds = (replay.min_scale, replay.max_scale)
        if any(b != bounds for b in kept):
            raise ValueError("replay_windows: the episodes' envs have different scale bounds")
        kept.add(bounds)
        evals.append(float(t.eval_loss))
        lengths.append(_length(cols["loss"][-1]))
    return ReplayWindows(
        **{k: np.stack(v) for k, v in cols.items()},
        start_scale=np.asarray(starts, dtype=np.float64),
        eval_loss=np.asarray(evals, dtype=np.float64),
        steps=np.asarray(lengths, dtype=np.int64),
        min_scale=bounds[0],
        max_scale=bounds[1],
    )


def _length(loss: np.ndarray) -> int:
    """Steps until the episode ends: all, or through the third non-finite loss in a row."""
    run = 0
    for t, bad in enumerate((~np.isfinite(loss)).tolist()):
        run = run + 1 if bad else 0
        if run >= NONFINITE_RUN:
            return t + 1
    return len(loss)


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


def _f32(x: np.ndarray) -> np.ndarray:
    """:func:`~autoscale.scalers.rule.f32` elementwise (round to float32; too large -> inf)."""
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(np.float64)


class _Clamp:
    """:meth:`ScaleBounds.clamp` elementwise: NaN or below the minimum -> the minimum, above the
    maximum -> the maximum, then float32."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray) -> None:
        self.lo, self.hi = lo, hi

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.where((x != x) | (x < self.lo), self.lo, np.where(x > self.hi, self.hi, x))
        return _f32(x)


# ---------------------------------------------------------------------------- the rules
# Each rule: make(params (K dicts), lanes shape (K, E), windows) -> step(t, scale, over) -> next
# scale (before the controller's clamp). ``params`` are the built rule's own ``params()``.


def _column(params: Sequence[dict], key: str, dtype: Any = np.float64) -> np.ndarray:
    return np.asarray([p[key] for p in params], dtype=dtype)[:, None]


def _torch(params: Sequence[dict], shape: tuple[int, int], w: ReplayWindows) -> Callable:
    growth, backoff = _column(params, "growth_factor"), _column(params, "backoff_factor")
    interval = _column(params, "growth_interval", np.int64)
    tracker = np.zeros(shape, dtype=np.int64)

    def step(t: int, scale: np.ndarray, over: np.ndarray) -> np.ndarray:
        tracker[over] = 0
        tracker[~over] += 1
        grow = tracker == interval
        tracker[grow] = 0
        grown = _f32(scale * growth)
        grown = np.where(np.isfinite(grown), grown, scale)
        return np.where(over, _f32(scale * backoff), np.where(grow, grown, scale))

    return step


class _History:
    """Per lane, the gradient amax of the last ``history_len`` clean steps (the amax rules'
    ``history`` deque), and ``2.0 ** floor(log2(FP16_MAX / max(history)) - margin)``."""

    def __init__(self, length: np.ndarray, shape: tuple[int, int], w: ReplayWindows) -> None:
        self.length = length
        self.ring = np.full((*shape, int(length.max())), -np.inf)  # columns >= length stay -inf
        self.count = np.zeros(shape, dtype=np.int64)  # amax appended so far
        self.lanes = np.indices(shape)
        # log2(FP16_MAX / amax) of every traced amax by math.log2: floor() sees the exact value
        self.values = np.unique(w.amax[np.isfinite(w.amax) & (w.amax > 0)])
        self.logs = np.asarray(
            [math.log2(FP16_MAX / a) for a in self.values.tolist()], dtype=np.float64
        )

    def push(self, mask: np.ndarray, amax: np.ndarray) -> None:
        """Append ``amax`` where ``mask`` (and it is positive)."""
        mask = mask & (amax > 0)
        if mask.any():
            k, e = self.lanes[0][mask], self.lanes[1][mask]
            self.ring[k, e, self.count[mask] % self.length[k, 0]] = amax[mask]
            self.count[mask] += 1

    def wanted(self, margin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(whether the history is non-empty, the scale it asks for there; 0 elsewhere)."""
        known = self.count > 0
        out = np.zeros(known.shape)
        if known.any():
            log = self.logs[np.searchsorted(self.values, self.ring.max(axis=2)[known])]
            with np.errstate(over="ignore"):
                out[known] = np.ldexp(1.0, np.floor(log - margin[known]).astype(np.int64))
        return known, out


def _amax_history(params: Sequence[dict], shape: tuple[int, int], w: ReplayWindows) -> Callable:
    backoff = _column(params, "backoff_factor")
    margin = np.broadcast_to(_column(params, "margin"), shape)
    history = _History(_column(params, "history_len", np.int64), shape, w)

    def step(t: int, scale: np.ndarray, over: np.ndarray) -> np.ndarray:
        amax = np.broadcast_to(w.amax[:, t], shape)
        bad = over | ~np.isfinite(amax)
        history.push(~bad, amax)
        known, wanted = history.wanted(margin)
        return np.where(bad, scale * backoff, np.where(known, wanted, scale))

    return step


def _amax_cap(params: Sequence[dict], shape: tuple[int, int], w: ReplayWindows) -> Callable:
    backoff = _column(params, "backoff_factor")
    margin, capped_margin = _column(params, "margin"), _column(params, "capped_margin")
    interval = _column(params, "growth_interval", np.int64)
    wait = _column(params, "probe_after", np.int64)
    history = _History(_column(params, "history_len", np.int64), shape, w)
    cap = np.full(shape, np.inf)
    clean = np.zeros(shape, dtype=np.int64)
    overflowed = np.full(shape, np.inf)
    safe = np.zeros(shape)

    def step(t: int, scale: np.ndarray, over: np.ndarray) -> np.ndarray:
        nonlocal cap, overflowed, safe, clean
        amax = np.broadcast_to(w.amax[:, t], shape)
        loss_bad = np.broadcast_to(~np.isfinite(w.loss[:, t]), shape)  # fails at any scale
        bad = ~loss_bad & (over | ~np.isfinite(amax))
        good = ~loss_bad & ~bad
        # an overflow: back to the clean level after a probe or growth, else cap below it
        back = bad & (safe > 0.0) & (safe < scale)
        cap = np.where(bad, np.where(back, safe, scale * backoff), cap)
        overflowed = np.where(bad, scale, overflowed)
        safe = np.where(bad, 0.0, safe)
        clean = np.where(bad, 0, clean)
        # a clean step under a cap: growth, or a probe towards the overflow half a bit away
        under = good & np.isfinite(cap)
        clean = np.where(under, clean + 1, clean)
        grow = under & (clean >= interval)
        with np.errstate(invalid="ignore", over="ignore"):
            probe = (
                under
                & ~grow
                & (clean >= wait)
                & np.isfinite(overflowed)
                & (overflowed > cap * HALF_BIT)
            )
            moved = grow | probe
            safe = np.where(moved, cap, safe)
            cap = np.where(grow, cap * 2.0, np.where(probe, np.sqrt(cap * overflowed), cap))
        overflowed = np.where(grow, np.inf, overflowed)
        clean = np.where(moved, 0, clean)
        history.push(good, amax)
        known, wanted = history.wanted(np.where(np.isinf(cap), margin, capped_margin))
        out = np.where(
            known, np.where(cap < wanted, cap, wanted), np.where(cap < scale, cap, scale)
        )
        return np.where(loss_bad, scale, np.where(bad, cap, out))

    return step


VECTOR_RULES: dict[str, Callable] = {
    "torch": _torch,
    "amax-history": _amax_history,
    "amax-cap": _amax_cap,
}


# ---------------------------------------------------------------------------- the replay
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
        if c.rule.name != rule or c.rule.has_guard:
            raise ValueError(f"replay_rule('{rule}') got a scaler of rule '{c.rule.name}'")
    k_n, e_n, h = len(controllers), len(windows), windows.horizon
    shape = (k_n, e_n)
    lo = np.asarray([c.bounds.min_scale for c in controllers])[:, None]
    hi = np.asarray([c.bounds.max_scale for c in controllers])[:, None]
    clamp, log2 = _Clamp(lo, hi), _Log2()
    env_clamp = _Clamp(np.float64(windows.min_scale), np.float64(windows.max_scale))
    step = VECTOR_RULES[rule]([c.rule.params() for c in controllers], shape, windows)
    scale = np.asarray(
        [[c.start(s) for s in windows.start_scale.tolist()] for c in controllers], dtype=np.float64
    )
    scales = np.empty((h, *shape))
    overs = np.empty((h, *shape), dtype=bool)
    precs = np.empty((h, *shape))
    rows = np.arange(e_n)
    for t in range(h):
        scale = env_clamp(scale)  # the env's clamp of the scale a step is taken at
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
        scale = clamp(step(t, scale, over))
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
