"""The amax rules (``amax-history``, ``amax-cap``, ``amax-loss``) stepped over K x E lanes.

As :mod:`autoscale.envs.vector_rules`: each maker returns a
:class:`~autoscale.envs.vector_rules.LaneRule` whose ``step`` is the scalar rule's ``next_scale``
element by element, and, for ``amax-loss``, whose ``guard`` is the per-step guard the replay env
applies (:func:`~autoscale.scalers.loss_guard.guarded_scale` of the rule's
:meth:`~autoscale.scalers.rules.AmaxLossRule.guard_limit`). ``floor(log2(...))`` is taken where
``math.log2`` would give it: from a table of ``math.log2`` of every traced amax, or from the binary
exponent away from the float just below a power of two (where ``math.log2`` may round up).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from autoscale.envs.vector_rules import LaneRule, column
from autoscale.envs.vector_windows import ReplayWindows
from autoscale.scalers.controller import FP16_MAX
from autoscale.scalers.rules import HALF_BIT

__all__ = ["AMAX_RULES", "floor_log2"]


def floor_log2(x: np.ndarray) -> np.ndarray:
    """``math.floor(math.log2(v))`` of positive finite values, exactly, as int64."""
    mant, exp = np.frexp(x)  # x = mant * 2**exp, mant in [0.5, 1)
    out = (exp - 1).astype(np.int64)
    near = mant > 1.0 - 2.0**-30  # just below a power of two: math.log2 may round up to it
    if near.any():
        out[near] = [math.floor(math.log2(v)) for v in x[near].tolist()]
    return out


class _Ring:
    """Per lane, the last ``length`` values pushed (a ``deque(maxlen=length)``) and their max,
    kept as values come and go (recomputed only where the max leaves)."""

    def __init__(
        self, length: np.ndarray, shape: tuple[int, int], empty: float = -np.inf, dtype=float
    ) -> None:
        self.length = length  # (K, 1)
        self.empty = empty  # below every value; columns >= length keep it
        width = int(length.max())
        self.ring = np.full((*shape, width), empty, dtype=dtype)
        self.flat = self.ring.reshape(-1)  # a view: lane j's slot i is flat[j * width + i]
        self.first = np.arange(shape[0] * shape[1]).reshape(shape) * width
        self.count = np.zeros(shape, dtype=np.int64)  # values pushed so far
        self.top = np.full(shape, empty, dtype=dtype)  # the max of each lane's values

    def push(self, mask: np.ndarray, values: np.ndarray) -> None:
        """Append ``values`` (no NaN) where ``mask``."""
        at = self.first + self.count % self.length
        old = self.flat[at]
        new = np.where(mask, values, old)
        self.flat[at] = new
        self.count += mask
        gone = mask & (old >= self.top) & (old > self.empty)  # the max left: recompute it there
        top = np.where(mask, np.maximum(self.top, new), self.top)
        if gone.any():
            top[gone] = self.ring[gone].max(axis=1)
        self.top = top


class _History(_Ring):
    """Per lane, the gradient amax of the last ``history_len`` clean steps (the amax rules'
    ``history`` deque), and ``2.0 ** floor(log2(FP16_MAX / max(history)) - margin)``.

    The ring holds indices into the sorted traced amax values (the max index is the max amax)."""

    def __init__(self, length: np.ndarray, shape: tuple[int, int], w: ReplayWindows) -> None:
        super().__init__(length, shape, empty=-1, dtype=np.int64)
        self.shape = shape
        usable = np.isfinite(w.amax) & (w.amax > 0)
        values = np.unique(w.amax[usable])
        # log2(FP16_MAX / amax) of every traced amax by math.log2: floor() sees the exact value
        logs = [math.log2(FP16_MAX / a) for a in values.tolist()]
        self.logs = np.asarray([*logs, 0.0], np.float64)  # index -1 (an empty lane): the 0.0
        self.index = np.where(usable, np.searchsorted(values, np.where(usable, w.amax, 0.0)), -1)

    def push_amax(self, mask: np.ndarray, t: int, amax: np.ndarray) -> None:
        """Append step ``t``'s traced amax where ``mask`` and ``amax`` (the step's) is positive."""
        self.push(mask & (amax > 0), np.broadcast_to(self.index[:, t], self.shape))

    def wanted(self, margin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(whether the history is non-empty, the scale it asks for there; 0 elsewhere)."""
        known = self.top >= 0
        with np.errstate(over="ignore"):  # empty lanes read logs[-1]: masked out
            out = np.ldexp(1.0, np.floor(self.logs[self.top] - margin).astype(np.int64))
        return known, np.where(known, out, 0.0)


def _amax_history(params: Sequence[dict], shape: tuple[int, int], w: ReplayWindows) -> LaneRule:
    backoff = column(params, "backoff_factor")
    margin = np.broadcast_to(column(params, "margin"), shape)
    history = _History(column(params, "history_len", np.int64), shape, w)

    def step(t: int, scale: np.ndarray, over: np.ndarray) -> np.ndarray:
        amax = np.broadcast_to(w.amax[:, t], shape)
        bad = over | ~np.isfinite(amax)
        history.push_amax(~bad, t, amax)
        known, wanted = history.wanted(margin)
        return np.where(bad, scale * backoff, np.where(known, wanted, scale))

    return LaneRule(step)


class _Cap:
    """:meth:`AmaxCapRule.next_scale <autoscale.scalers.rules.AmaxCapRule.next_scale>` over
    lanes; with ``regrows``, :class:`~autoscale.scalers.rules.AmaxLossRule`'s (a cap that the
    amax does not bind is tried a bit higher, and a failed probe doubles the wait before the
    next)."""

    def __init__(
        self, params: Sequence[dict], shape: tuple[int, int], w: ReplayWindows, regrows: bool
    ) -> None:
        self.regrows = regrows
        self.backoff = column(params, "backoff_factor")
        self.margin, self.capped_margin = column(params, "margin"), column(params, "capped_margin")
        self.interval = column(params, "growth_interval", np.int64)
        self.wait = np.broadcast_to(column(params, "probe_after", np.int64), shape).copy()
        self.history = _History(column(params, "history_len", np.int64), shape, w)
        self.cap = np.full(shape, np.inf)  # no gradient overflow yet
        self.clean = np.zeros(shape, dtype=np.int64)
        self.overflowed = np.full(shape, np.inf)
        self.safe = np.zeros(shape)
        self.binding = np.zeros(shape, dtype=bool)

    def step(
        self, t: int, scale: np.ndarray, grad: np.ndarray, loss_bad: np.ndarray, act: np.ndarray
    ) -> np.ndarray:
        """The next scale of the lanes where ``act`` (state changes only there), from step
        ``t``'s ``scale``, gradient amax ``grad`` (inf on an overflow; 0 where the rule drops
        it; else the traced one) and non-finite loss ``loss_bad``."""
        cap, safe, clean, overflowed = self.cap, self.safe, self.clean, self.overflowed
        live = act & ~loss_bad  # a non-finite loss fails at any scale: nothing changes
        finite = np.isfinite(grad)
        bad = live & ~finite
        good = live & finite
        if bad.any():  # an overflow: back to the clean level after a probe or growth, else cap
            back = bad & (safe > 0.0) & (safe < scale)
            cap = np.where(bad, np.where(back, safe, scale * self.backoff), cap)
            if self.regrows:
                self.wait = np.where(back, np.minimum(2 * self.wait, self.interval), self.wait)
            overflowed = np.where(bad, scale, overflowed)
            safe = np.where(bad, 0.0, safe)
            clean = np.where(bad, 0, clean)
        # a clean step under a cap: growth, or a probe towards the overflow half a bit away
        under = good & (cap != np.inf)
        clean = clean + under
        grow = under & (clean >= self.interval)
        waited = under & ~grow & (clean >= self.wait)
        if grow.any() or waited.any():
            with np.errstate(invalid="ignore", over="ignore"):
                probe = waited & (overflowed != np.inf) & (overflowed > cap * HALF_BIT)
                doubled = grow | (waited & ~probe & self.binding) if self.regrows else grow
                moved = doubled | probe
                safe = np.where(moved, cap, safe)
                cap = np.where(doubled, cap * 2.0, np.where(probe, np.sqrt(cap * overflowed), cap))
            overflowed = np.where(doubled, np.inf, overflowed)
            clean = np.where(moved, 0, clean)
        self.history.push_amax(good, t, grad)
        known, wanted = self.history.wanted(
            np.where(cap == np.inf, self.margin, self.capped_margin)
        )
        if self.regrows:
            self.binding = np.where(good & known, wanted >= cap, self.binding)
        self.cap, self.safe, self.clean, self.overflowed = cap, safe, clean, overflowed
        out = np.where(
            known, np.where(cap < wanted, cap, wanted), np.where(cap < scale, cap, scale)
        )
        return np.where(loss_bad, scale, np.where(bad, cap, out))


def _amax_cap(params: Sequence[dict], shape: tuple[int, int], w: ReplayWindows) -> LaneRule:
    cap = _Cap(params, shape, w, regrows=False)
    everywhere = np.ones(shape, dtype=bool)

    def step(t: int, scale: np.ndarray, over: np.ndarray) -> np.ndarray:
        grad = np.where(over, np.inf, w.amax[:, t])  # the step's stats: inf on an overflow
        return cap.step(
            t, scale, grad, np.broadcast_to(~np.isfinite(w.loss[:, t]), shape), everywhere
        )

    return LaneRule(step)


class _GuardMemory:
    """Per lane, the guard's memory (:class:`~autoscale.scalers.rules.guard.LossGuard`): the
    amax per ``|loss|`` of its last ``guard_history`` lessons, the ``|loss|`` each was learned at,
    and the ``|loss|`` of the last ``guard_history`` steps, for ``guard_floor``."""

    def __init__(self, params: Sequence[dict], shape: tuple[int, int]) -> None:
        length = column(params, "guard_history", np.int64)
        self.ratios = _Ring(length, shape)  # gradient amax per |loss|
        self.floor = np.asarray([p.get("guard_floor", 0.0) for p in params], dtype=float)[:, None]
        self.floored = self.floor[:, 0] > 0  # lanes of candidates with a floor
        if self.floored.any():
            self.at_loss = _Ring(length, shape)  # the |loss| of each ratio, slot for slot
            self.losses = _Ring(length, shape)  # the last steps' |loss|

    def cut(self) -> np.ndarray:
        """The ``|loss|`` below which a step teaches nothing (0 where there is no floor)."""
        with np.errstate(over="ignore", under="ignore"):
            cut = np.where(self.floor > 0, self.losses.top * 2.0**-self.floor, 0.0)
        return np.where(self.losses.count > 0, cut, 0.0)

    def top(self) -> np.ndarray:
        """The largest ratio that counts (-inf where none does)."""
        if not self.floored.any():
            return self.ratios.top
        top = self.ratios.top.copy()
        rows = self.floored
        counts = self.at_loss.ring[rows] >= self.cut()[rows][..., None]
        top[rows] = np.where(counts, self.ratios.ring[rows], -np.inf).max(axis=-1)
        return top

    def see(self, fine: np.ndarray, size: np.ndarray) -> np.ndarray:
        """Take this step's ``|loss|`` where ``fine``; returns where it may teach the guard."""
        if not self.floored.any():
            return fine
        self.losses.push(fine, np.where(fine, size, 0.0))
        return fine & (size >= self.cut())

    def push(self, mask: np.ndarray, ratio: np.ndarray, size: np.ndarray) -> None:
        self.ratios.push(mask, ratio)
        if self.floored.any():
            self.at_loss.push(mask, size)


def _amax_loss(params: Sequence[dict], shape: tuple[int, int], w: ReplayWindows) -> LaneRule:
    cap = _Cap(params, shape, w, regrows=True)
    memory = _GuardMemory(params, shape)
    # guard_limit's numerator, as the scalar rule computes it
    room = np.asarray([FP16_MAX * 2.0 ** -p["guard_margin"] for p in params])[:, None]
    min_scale = np.float64(w.min_scale)  # the env's, as ReplayEnv applies the guard
    lanes = {"base": np.full(shape, np.nan), "guarded": np.zeros(shape, dtype=bool)}
    # the episodes' loss columns as the rule reads them, once
    absloss = np.abs(w.step_loss)  # the loss the scaler saw
    usable = (absloss > 0.0) & (absloss < np.inf)  # 0 < |loss| < inf
    guardable = (absloss == absloss) & (absloss != 0)  # guarded_scale: not NaN, not 0
    loss_bad = ~np.isfinite(w.step_loss)

    def guard(t: int, scale: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
            ratio = room / memory.top() / absloss[:, t]  # limit / |loss|
        # no guard without ratios, for a NaN or zero loss, or where the ratio is 0 or inf
        on = (memory.ratios.count > 0) & guardable[:, t] & (ratio < np.inf) & (ratio > 0)
        out = scale
        if on.any():
            g = np.ldexp(1.0, floor_log2(ratio[on]))
            lower = np.where(g < scale[on], np.where(min_scale > g, min_scale, g), scale[on])
            out = scale.copy()
            out[on] = lower
        lanes["guarded"] = out < scale
        return out

    def step(t: int, scale: np.ndarray, over: np.ndarray) -> np.ndarray:
        guarded = lanes["guarded"]
        base = np.where(lanes["base"] == lanes["base"], lanes["base"], scale)
        grad = np.where(over, np.inf, w.amax[:, t])  # the step's stats: inf on an overflow
        size = np.broadcast_to(absloss[:, t], shape)
        fine = np.broadcast_to(usable[:, t], shape)
        teaches = memory.see(fine, size)
        bad = ~np.isfinite(grad)
        # a guarded step that overflowed: this loss needed at least twice the room
        missed = bad & guarded & fine
        seen = ~bad & teaches & (grad > 0)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            ratio = np.where(missed, 2.0 * FP16_MAX / (scale * size), grad / size)
        memory.push(missed | seen, ratio, size)
        grad = np.where(seen & guarded, 0.0, grad)  # its loss explains its gradients
        bad_loss = np.broadcast_to(loss_bad[:, t], shape)
        out = cap.step(t, np.where(guarded, base, scale), grad, bad_loss, ~missed)
        lanes["base"] = np.where(missed, base, out)
        return lanes["base"]

    return LaneRule(step, guard=guard)


AMAX_RULES: dict[str, Callable[..., LaneRule]] = {
    "amax-history": _amax_history,
    "amax-cap": _amax_cap,
    "amax-loss": _amax_loss,
}
