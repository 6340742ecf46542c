"""The counter rules stepped over K candidates x E episodes at once: what the vectorised replay
(:func:`~autoscale.envs.vector_replay.replay_rule`) calls once a step instead of K x E rules.

Each maker takes the K built rules' ``params()``, the lanes' shape ``(K, E)`` and the windows
(:class:`~autoscale.envs.vector_windows.ReplayWindows`), and returns a :class:`LaneRule` whose
``step`` is the scalar rule's ``next_scale`` element by element: the same float operations
(float32 rounding included where the rule rounds), the same counters and their quirks, state kept
per lane. ``tests/envs/test_vector_replay.py`` holds every maker to the scalar rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["LaneRule", "COUNTER_RULES", "f32_lanes", "column"]

Step = Callable[[int, np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class LaneRule:
    """A rule over lanes, as the replay drives it.

    Attributes:
        step: ``step(t, scale, over)``: the scale each lane wants after step ``t`` taken at
            ``scale`` (``over``: it overflowed), before the controller's clamp
            (:meth:`~autoscale.scalers.controller.ScaleRule.next_scale`).
        guard: ``guard(t, scale)``: the scale each lane's step ``t`` takes under the rule's
            per-step guard, given the scale the rule set (None: no guard;
            :func:`~autoscale.scalers.loss_guard.guarded_scale`).
        backs_off: ``backs_off(t)``: where an overflow at step ``t`` would lower the scale, read
            before ``step`` (None: everywhere;
            :meth:`~autoscale.scalers.controller.ScaleRule.backs_off_on_overflow`).
    """

    step: Step
    guard: Callable[[int, np.ndarray], np.ndarray] | None = None
    backs_off: Callable[[int], np.ndarray] | None = None


def f32_lanes(x: np.ndarray) -> np.ndarray:
    """:func:`~autoscale.scalers.controller.f32` elementwise (round to float32; too large -> inf)."""
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(np.float32).astype(np.float64)


def column(params: Sequence[dict], key: str, dtype: Any = np.float64) -> np.ndarray:
    """The K candidates' ``key`` as a ``(K, 1)`` column (broadcasts over episodes)."""
    return np.asarray([p[key] for p in params], dtype=dtype)[:, None]


def _static(params: Sequence[dict], shape: tuple[int, int], w: Any) -> LaneRule:
    never = np.zeros(shape, dtype=bool)
    return LaneRule(step=lambda t, scale, over: scale, backs_off=lambda t: never)


def _torch(params: Sequence[dict], shape: tuple[int, int], w: Any) -> LaneRule:
    growth, backoff = column(params, "growth_factor"), column(params, "backoff_factor")
    interval = column(params, "growth_interval", np.int64)
    tracker = np.zeros(shape, dtype=np.int64)

    def step(t: int, scale: np.ndarray, over: np.ndarray) -> np.ndarray:
        tracker[over] = 0
        tracker[~over] += 1
        grow = tracker == interval
        tracker[grow] = 0
        grown = f32_lanes(scale * growth)
        grown = np.where(np.isfinite(grown), grown, scale)
        return np.where(over, f32_lanes(scale * backoff), np.where(grow, grown, scale))

    return LaneRule(step)


def _deepspeed(params: Sequence[dict], shape: tuple[int, int], w: Any) -> LaneRule:
    factor = column(params, "scale_factor")
    window = column(params, "loss_scale_window", np.int64)
    hysteresis = column(params, "hysteresis", np.int64)
    consecutive = column(params, "consecutive_hysteresis", bool)
    state = {
        "hysteresis": np.broadcast_to(hysteresis, shape).copy(),  # cur_hysteresis
        "last_overflow": np.full(shape, -1, dtype=np.int64),  # cur_iter is t: a fresh rule
    }

    def backs_off(t: int) -> np.ndarray:
        return (hysteresis == 1) | (state["hysteresis"] == 1)

    def step(t: int, scale: np.ndarray, over: np.ndarray) -> np.ndarray:
        cur, last = state["hysteresis"], state["last_overflow"]
        down = over & backs_off(t)
        cur = np.where(over & ~down, cur - 1, cur)
        stable = t - last - 1
        grow = ~over & (stable > 0) & (stable % window == 0)
        state["hysteresis"] = np.where(~over & consecutive | grow, hysteresis, cur)
        state["last_overflow"] = np.where(over, t, last)
        return np.where(down, scale / factor, np.where(grow, scale * factor, scale))

    return LaneRule(step, backs_off=backs_off)


def _megatron(params: Sequence[dict], shape: tuple[int, int], w: Any) -> LaneRule:
    # float32 products, as the scalar rule (and Megatron's tensors) compute them
    growth = f32_lanes(column(params, "growth_factor"))
    backoff = f32_lanes(column(params, "backoff_factor"))
    interval = column(params, "growth_interval", np.int64)
    hysteresis = column(params, "hysteresis", np.int64)
    state = {
        "growth": np.zeros(shape, dtype=np.int64),
        "hysteresis": np.broadcast_to(hysteresis, shape).copy(),
    }

    def backs_off(t: int) -> np.ndarray:
        return state["hysteresis"] <= 1

    def step(t: int, scale: np.ndarray, over: np.ndarray) -> np.ndarray:
        tracker = np.where(over, 0, state["growth"] + 1)
        left = np.where(over, state["hysteresis"] - 1, state["hysteresis"])
        grow = ~over & (tracker == interval)
        state["growth"] = np.where(grow, 0, tracker)
        state["hysteresis"] = np.where(grow, hysteresis, left)
        down = over & (left <= 0)
        return np.where(
            down,
            f32_lanes(scale * backoff),
            np.where(grow, f32_lanes(scale * growth), scale),
        )

    return LaneRule(step, backs_off=backs_off)


def _jmp(params: Sequence[dict], shape: tuple[int, int], w: Any) -> LaneRule:
    factor = column(params, "factor")
    period = column(params, "period", np.int64)
    counter = np.zeros(shape, dtype=np.int64)

    def step(t: int, scale: np.ndarray, over: np.ndarray) -> np.ndarray:
        nonlocal counter
        grow = counter == period - 1
        counter = np.where(over, 0, (counter + 1) % period)
        return np.where(over, scale / factor, np.where(grow, scale * factor, scale))

    return LaneRule(step)


def _fairseq_maker(grow_window: bool) -> Callable[..., LaneRule]:
    """fairseq's rule (``grow_window``: metaseq's, whose window doubles and halves)."""

    def make(params: Sequence[dict], shape: tuple[int, int], w: Any) -> LaneRule:
        factor = column(params, "scale_factor")
        tolerance = column(params, "tolerance")
        state = {
            "window": np.broadcast_to(column(params, "scale_window", np.int64), shape).copy(),
            "last_overflow": np.full(shape, -1, dtype=np.int64),  # iter is t: a fresh rule
            "last_rescale": np.full(shape, -1, dtype=np.int64),
            "overflows": np.zeros(shape, dtype=np.int64),  # since the last rescale
        }

        def backs_off(t: int) -> np.ndarray:  # FairseqRule._would_rescale
            since = (t - state["last_rescale"]).astype(np.float64)
            return (state["overflows"] + 1) / since >= tolerance

        def step(t: int, scale: np.ndarray, over: np.ndarray) -> np.ndarray:
            window, last = state["window"], state["last_overflow"]
            down = over & backs_off(t)
            grow = ~over & ((t - last) % window == 0)
            state["last_overflow"] = np.where(over, t, last)
            overflows = state["overflows"]  # counted on overflows only; 0 after a rescale
            state["overflows"] = np.where(over, np.where(down, 0, overflows + 1), overflows)
            state["last_rescale"] = np.where(down | grow, t, state["last_rescale"])
            if grow_window:  # int(window / factor), at least 1; int(window * factor)
                smaller = np.maximum(np.floor(window / factor).astype(np.int64), 1)
                larger = np.floor(window * factor).astype(np.int64)
                state["window"] = np.where(down, smaller, np.where(grow, larger, window))
            return np.where(down, scale / factor, np.where(grow, scale * factor, scale))

        return LaneRule(step, backs_off=backs_off)

    return make


COUNTER_RULES: dict[str, Callable[..., LaneRule]] = {
    "static": _static,
    "torch": _torch,
    "deepspeed": _deepspeed,
    "megatron": _megatron,
    "jmp": _jmp,
    "fairseq": _fairseq_maker(grow_window=False),
    "metaseq": _fairseq_maker(grow_window=True),
}
