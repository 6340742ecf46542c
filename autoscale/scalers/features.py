"""The feature extractor shared by the environments and by exported policies.

Observation parity is an invariant: a policy must see in deployment exactly what it saw in
training. Both the Gymnasium environments and :class:`~autoscale.scalers.neural.NeuralPolicyRule`
turn the same :class:`~autoscale.scalers.scaler.StepStats` records into features with this class.
The spec is versioned; a policy trained on another ``FEATURE_VERSION`` is refused.

Pure Python on host floats: the statistics were already read in the scaler's one sync per step.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from autoscale.scalers.controller import FP16_MAX, StepStats

__all__ = [
    "FeatureExtractor",
    "FrameStack",
    "FEATURE_VERSION",
    "FEATURE_NAMES",
    "N_FEATURES",
    "FEATURE_BOUND",
]

FEATURE_VERSION = 1
WINDOW = 16
FEATURE_BOUND = 4.0
LOG2_FP16_MAX = math.log2(FP16_MAX)
LOG2_FP16_MIN_NORMAL = -14.0

FEATURE_NAMES: tuple[str, ...] = (
    "log2_scale",  # log2 of the scale the last step used, / 16
    "overflow",  # 1 when the last step was skipped (non-finite gradients)
    "overflow_rate",  # share of skipped steps over the last 16
    "since_overflow",  # log2(1 + clean steps since the last skip) / 11 (2047 steps -> 1)
    "headroom",  # bits between fp16 max and (last finite grad amax x scale), / 16
    "floor",  # bits between (last finite grad RMS x scale) and the fp16 normal minimum 2^-14, / 16
    "stats_known",  # 1 once a finite gradient amax has been seen
    "loss_nonfinite",  # 1 when the last loss itself was non-finite (fails at any scale)
    "nonfinite_rate",  # share of non-finite losses over the last 16 steps
    "loss_trend",  # log(loss) - log(EMA of loss), clipped to [-1, 1]
    "progress",  # log2(1 + steps seen) / 16
)
N_FEATURES = len(FEATURE_NAMES)


class FeatureExtractor:
    """Turns the stream of per-step statistics into a fixed-size observation vector.

    Call :meth:`observe` once per optimizer step with that step's :class:`StepStats`; it returns
    the features describing the situation after the step. :meth:`features` gives the features
    for a given current scale without consuming a step (the first observation of an episode).
    State is primitive (:meth:`state_dict`) so it checkpoints with the scaler.
    """

    version = FEATURE_VERSION
    names = FEATURE_NAMES

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.since_overflow = 0
        self.overflows: deque[int] = deque(maxlen=WINDOW)
        self.nonfinite: deque[int] = deque(maxlen=WINDOW)
        self.last_amax = math.nan
        self.last_rms = math.nan
        self.loss_ema = math.nan
        self.last_loss = math.nan
        self.last_overflow = 0
        self.last_nonfinite = 0
        self._n_overflows = 0  # sum(self.overflows), kept as it changes
        self._n_nonfinite = 0

    def observe(self, stats: StepStats) -> list[float]:
        """Consume one step's statistics; return the features after it (scale = ``stats.scale``)."""
        self.update(stats)
        return self.features(stats.scale)

    def update(self, stats: StepStats) -> None:
        """Consume one step's statistics without computing features (:meth:`observe` without its
        return value, for drivers that read no observation)."""
        self.steps += 1
        overflow = 1 if stats.found_inf else 0
        nonfinite = 1 if stats.loss_nonfinite else 0
        # running sums over the windows (exact: integers), so features() needs no sum()
        if len(self.overflows) == WINDOW:
            self._n_overflows -= self.overflows[0]
            self._n_nonfinite -= self.nonfinite[0]
        self.overflows.append(overflow)
        self.nonfinite.append(nonfinite)
        self._n_overflows += overflow
        self._n_nonfinite += nonfinite
        self.last_overflow = overflow
        self.last_nonfinite = nonfinite
        self.since_overflow = 0 if overflow else self.since_overflow + 1
        amax = stats.grad_amax
        if not overflow and amax > 0 and amax != math.inf:  # finite and positive (NaN fails > 0)
            self.last_amax = amax
            rms = stats.grad_rms
            if rms > 0 and rms != math.inf:
                self.last_rms = rms
        loss = stats.loss
        if loss > 0 and loss != math.inf:
            self.last_loss = loss
            ema = self.loss_ema
            self.loss_ema = loss if ema != ema else 0.9 * ema + 0.1 * loss

    def features(self, scale: float) -> list[float]:
        """The observation for the current state if the next decision is made at ``scale``."""
        # Runs once a replayed step: clips as conditional expressions, equal to
        # max(-b, min(b, x)) for every x, NaN included (-> b), without two calls each.
        log2_scale = math.log2(scale)
        amax, rms, ema, loss = self.last_amax, self.last_rms, self.loss_ema, self.last_loss
        b = FEATURE_BOUND
        x = log2_scale / 16.0
        f_scale = x if -b <= x <= b else (-b if x < -b else b)
        known = math.isfinite(amax)
        if known:
            x = (LOG2_FP16_MAX - (math.log2(amax) + log2_scale)) / 16.0
            f_headroom = x if -b <= x <= b else (-b if x < -b else b)
        else:
            f_headroom = 0.0
        if math.isfinite(rms):
            x = (math.log2(rms) + log2_scale - LOG2_FP16_MIN_NORMAL) / 16.0
            f_floor = x if -b <= x <= b else (-b if x < -b else b)
        else:
            f_floor = 0.0
        trend = 0.0
        if math.isfinite(ema) and math.isfinite(loss):
            x = math.log(loss) - math.log(ema)
            trend = x if -1.0 <= x <= 1.0 else (-1.0 if x < -1.0 else 1.0)
        n = len(self.overflows) or 1
        since = math.log2(1 + self.since_overflow) / 11.0  # min(1.0, x) is x if x < 1.0 else 1.0
        progress = math.log2(1 + self.steps) / 16.0
        return [
            f_scale,
            float(self.last_overflow),
            self._n_overflows / n,
            since if since < 1.0 else 1.0,
            f_headroom,
            f_floor,
            float(known),
            float(self.last_nonfinite),
            self._n_nonfinite / n,
            trend,
            progress if progress < 1.0 else 1.0,
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": FEATURE_VERSION,
            "steps": self.steps,
            "since_overflow": self.since_overflow,
            "overflows": list(self.overflows),
            "nonfinite": list(self.nonfinite),
            "last_amax": self.last_amax,
            "last_rms": self.last_rms,
            "loss_ema": self.loss_ema,
            "last_loss": self.last_loss,
            "last_overflow": self.last_overflow,
            "last_nonfinite": self.last_nonfinite,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        for key in ("steps", "since_overflow", "last_overflow", "last_nonfinite"):
            setattr(self, key, int(state[key]))
        for key in ("last_amax", "last_rms", "loss_ema", "last_loss"):
            setattr(self, key, float(state[key]))
        self.overflows.extend(int(v) for v in state["overflows"])
        self.nonfinite.extend(int(v) for v in state["nonfinite"])
        self._n_overflows = sum(self.overflows)
        self._n_nonfinite = sum(self.nonfinite)


class FrameStack:
    """The last ``history`` feature vectors side by side, oldest first: the observation of a
    policy that sees a short history (frame stacking). At the start of an episode the first
    vector fills every slot. The environments and :class:`~autoscale.scalers.neural.NeuralPolicyRule`
    stack with this class, so a deployed policy sees what it saw in training.
    """

    def __init__(self, history: int = 1) -> None:
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be an integer >= 1, got {history!r}")
        self.history = history
        self.frames: deque[list[float]] = deque(maxlen=history)

    def reset(self, first: list[float]) -> list[float]:
        self.frames.clear()
        self.frames.extend([list(first)] * self.history)
        return self.vector()

    def push(self, frame: list[float]) -> list[float]:
        self.frames.append(list(frame))
        return self.vector()

    def vector(self) -> list[float]:
        if self.history == 1:
            return self.frames[0]
        return [v for frame in self.frames for v in frame]

    def state_dict(self) -> dict[str, Any]:
        return {"frames": [list(f) for f in self.frames]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        frames = state.get("frames") or []
        self.frames.clear()
        self.frames.extend(list(map(float, f)) for f in frames[-self.history :])
