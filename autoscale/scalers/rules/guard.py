"""The per-step loss guard's memory, shared by the rules and agents that guard each step.

Spiky losses make gradients whose size follows the loss (``amax-loss``'s docstring has the
measurements). :class:`LossGuard` keeps the largest gradient amax per unit of ``|loss|`` of the
last ``guard_history`` clean steps, and gives the limit a step's ``scale * |loss|`` must stay under
(:meth:`guard_limit`) to keep its foreseen amax ``guard_margin`` bits below fp16's maximum. A
scaler applies it on the device when the loss is scaled (no host sync); the environments apply
the host twin (:func:`~autoscale.scalers.loss_guard.guarded_scale`).

``amax-loss`` hosts one; so can an agent: an environment given ``episode.guard`` applies it to
the agent's scales and learns it from every step, and the exported policy carries it, so the
agent sets the base scale and its growth while the guard takes each spike.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from autoscale.errors import ConfigError
from autoscale.scalers.controller import FP16_MAX, StepStats
from autoscale.scalers.rules.checks import check_bits, check_interval

__all__ = ["LEARNED", "SHORT", "LossGuard"]

SHORT = "short"  # a guarded step overflowed all the same: the guard's foresight fell short
LEARNED = "learned"  # a clean step taught the guard its gradient amax per |loss|


class LossGuard:
    """The guard's memory and limit.

    Args:
        guard_history: Clean steps whose amax per ``|loss|`` it remembers.
        guard_margin: Bits the foreseen amax stays below fp16's maximum.
    """

    has_guard = True

    def __init__(self, guard_history: int = 16, guard_margin: float = 1.0) -> None:
        self.guard_margin = check_bits("guard_margin", guard_margin)
        self.guard_history = check_interval("guard_history", guard_history)
        self.ratios: deque[float] = deque(maxlen=self.guard_history)  # gradient amax per |loss|

    def guard_limit(self) -> float | None:
        """The largest ``scale * |loss|`` a step may take (None before any clean step)."""
        if not self.ratios:
            return None
        return FP16_MAX * 2.0**-self.guard_margin / max(self.ratios)

    def observe(self, scale: float, stats: StepStats) -> str | None:
        """Learn from one step taken at ``scale``: :data:`SHORT` when a guarded step overflowed
        (it remembers that this loss needed at least twice the room), :data:`LEARNED` when a
        clean step with a usable loss and amax taught it that step's amax per ``|loss|``, else
        None."""
        loss = abs(stats.loss) if stats.loss_seen else math.nan
        usable = 0.0 < loss < math.inf
        if stats.found_inf or not math.isfinite(stats.grad_amax):
            if stats.guarded and usable:
                self.ratios.append(2.0 * FP16_MAX / (scale * loss))
                return SHORT
            return None
        if usable and stats.grad_amax > 0:
            self.ratios.append(stats.grad_amax / loss)
            return LEARNED
        return None

    def params(self) -> dict[str, Any]:
        return {"guard_history": self.guard_history, "guard_margin": self.guard_margin}

    def state(self) -> dict[str, Any]:
        return {"ratios": [float(r) for r in self.ratios]}

    def load_state(self, state: dict[str, Any], owner: str) -> None:
        """Restore :meth:`state`; ``owner`` names the rule or policy in errors."""
        ratios = state.get("ratios", [])
        if not isinstance(ratios, list) or not all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r < math.inf
            for r in ratios
        ):
            raise ConfigError(
                f"{owner}: state 'ratios' must be a list of positive numbers, got "
                f"{ratios!r}; the checkpoint was not written by this rule"
            )
        self.ratios = deque((float(r) for r in ratios), maxlen=self.guard_history)
