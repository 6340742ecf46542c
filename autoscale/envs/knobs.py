"""Scenario knobs drawn at random per replayed episode, so that an agent trained on a few recorded
members sees many loss weights, drifts, bad-batch rates and spike shapes.

Every failure scenario of the suite is a loss weight over the steps (``Scenario.loss_weight``:
small-grads a constant, moving a spike, drift a slope) or a batch whose loss is infinite
(bad-batches). With Adam the trajectory is nearly invariant to the loss weight (the scenarios'
docstrings), so a recorded step under a weight ``2**g`` is the same step with every gradient
``2**g`` times larger: its overflow threshold ``g`` bits lower, its gradient statistics and the
loss the scaler sees ``2**g`` times larger, its precision loss at scale ``S`` the recorded one at
``S * 2**g``. :class:`Knobs` draws such a ``g`` per step, and bad steps, for one episode;
:class:`~autoscale.envs.replay_env.ReplayEnv` applies them (``knobs=``). What this cannot show, as
replay cannot: how a skipped step would have changed the steps after it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from autoscale.errors import ConfigError

__all__ = ["Knobs", "EpisodeKnobs"]


@dataclasses.dataclass(frozen=True)
class EpisodeKnobs:
    """One episode's draw: ``gain[t]`` (log2 of the loss weight at step ``t``) and ``bad[t]``
    (step ``t``'s batch overflows at any scale), and the draw that made them (for reports)."""

    gain: tuple[float, ...]
    bad: tuple[bool, ...]
    drawn: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Ranges of the knobs drawn per episode (log2 units for weights; uniform draws).

    Args:
        plain: Probability of an episode as recorded (no knob), so the members themselves stay
            in the mix.
        weight_bits: log2 of the loss weight at the episode's start (small-grads' 1e-5 is -16.6).
        drift_bits: How far log2 of the weight moves, linearly, by the episode's end.
        spike: Probability of one spike; ``spike_bits`` its height (moving's 4096 is 12) and
            ``spike_width`` its half-width in steps (it rises and decays geometrically).
        bad: Probability of bad batches; ``bad_every`` the range of their period in steps.
    """

    plain: float = 0.2
    weight_bits: tuple[float, float] = (-20.0, 4.0)
    drift_bits: tuple[float, float] = (-8.0, 8.0)
    spike: float = 0.5
    spike_bits: tuple[float, float] = (2.0, 14.0)
    spike_width: tuple[int, int] = (2, 60)
    bad: float = 0.5
    bad_every: tuple[int, int] = (4, 32)

    def __post_init__(self) -> None:
        for name in ("plain", "spike", "bad"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ConfigError(f"knobs: {name} is a probability in [0, 1], got {p!r}")
        for name in ("weight_bits", "drift_bits", "spike_bits", "spike_width", "bad_every"):
            lo, hi = getattr(self, name)
            if not lo <= hi:
                raise ConfigError(
                    f"knobs: {name} must be (low, high) with low <= high, got {(lo, hi)}"
                )
        if self.spike_width[0] < 1 or self.bad_every[0] < 4:
            raise ConfigError(
                "knobs: spike_width starts at 1 or more, bad_every at 4 or more (three non-finite "
                f"losses in a row end an episode as diverged); got {self.spike_width}, {self.bad_every}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()
        }

    def draw(self, rng: np.random.Generator, steps: int) -> EpisodeKnobs | None:
        """The knobs of one ``steps``-step episode from ``rng``; None: this episode is plain."""
        if rng.random() < self.plain:
            return None
        start = float(rng.uniform(*self.weight_bits))
        drift = float(rng.uniform(*self.drift_bits))
        t = np.arange(steps, dtype=np.float64)
        gain = start + drift * t / max(1, steps - 1)
        drawn: dict[str, Any] = {"weight_bits": start, "drift_bits": drift}
        if rng.random() < self.spike:
            height = float(rng.uniform(*self.spike_bits))
            width = int(rng.integers(self.spike_width[0], self.spike_width[1] + 1))
            at = int(rng.integers(steps))
            gain = gain + height * np.maximum(0.0, 1.0 - np.abs(t - at) / width)
            drawn["spike"] = {"bits": height, "width": width, "at": at}
        bad = np.zeros(steps, dtype=bool)
        if rng.random() < self.bad:
            every = int(rng.integers(self.bad_every[0], self.bad_every[1] + 1))
            bad[int(rng.integers(every)) :: every] = True
            drawn["bad_every"] = every
        return EpisodeKnobs(tuple(gain.tolist()), tuple(bad.tolist()), drawn)


def weighted(amax: float, rms: float, loss: float, gain: float) -> tuple[float, float, float]:
    """A step's gradient amax, rms and the loss the scaler sees under a loss weight ``2**gain``."""
    w = 2.0**gain
    return amax * w, rms * w, (loss * w if math.isfinite(loss) else loss)
