"""The observation taken when the loss is scaled: this step's loss beside what came before.

The scale is applied after the forward pass, so a policy may read this step's loss before it
picks the step's scale. On spiky losses the gradient amax follows the step's own loss (see
``amax-loss``): an agent acting on past steps only cannot see a spike coming, one acting at scale
time can. :class:`LossNow` keeps what the scale-time features need from past steps and computes
them for a loss, on the host (the environments, a CPU scaler) or on the loss's device
(:meth:`LossNow.device_features`: no host sync, for a CUDA scaler).

Features (appended, unstacked, after the stacked after-step features of
:mod:`~autoscale.scalers.features`):

- ``loss_jump``: log2(|loss| / EMA of past losses) / 4, clipped to [-4, 4] (0 while unknown);
- ``foreseen_headroom``: bits between fp16's maximum and the amax this loss foresees at the
  step's base scale (the largest gradient amax per ``|loss|`` of the last 16 clean steps, times
  ``|loss|``, times the scale), / 16, clipped to [-4, 4] (0 while unknown);
- ``loss_now_nonfinite``: 1 when this loss is non-finite (the step fails at any scale).

Actions at scale time (:meth:`~autoscale.scalers.actions.ActionMap.base_after`): a change of the
base scale that carries on (``deltas``), or a drop for this step only (``drops``); the next base
is decoded from the scale the step used, so an exported policy needs no more than that scale
back from the device, which the scaler's one sync per step already reads.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from autoscale.errors import ConfigError
from autoscale.scalers.controller import FP16_MAX, StepStats

__all__ = ["DEFAULT_DROPS", "LossNow", "SCALE_TIME_NAMES", "N_SCALE_TIME", "RATIO_WINDOW"]

SCALE_TIME_NAMES: tuple[str, ...] = ("loss_jump", "foreseen_headroom", "loss_now_nonfinite")
N_SCALE_TIME = len(SCALE_TIME_NAMES)
DEFAULT_DROPS = (4.0, 8.0, 12.0, 16.0)  # bits a scale-time agent may drop one step's scale by
RATIO_WINDOW = 16  # clean steps whose gradient amax per |loss| the headroom reads
BOUND = 4.0
LOG2_FP16_MAX = math.log2(FP16_MAX)


def _clip(x: float) -> float:
    return x if -BOUND <= x <= BOUND else (-BOUND if x < -BOUND else BOUND)


class LossNow:
    """What the scale-time features remember of past steps: the EMA of the loss and the gradient
    amax per ``|loss|`` of the last :data:`RATIO_WINDOW` clean steps."""

    def __init__(self) -> None:
        self.loss_ema = math.nan
        self.ratios: deque[float] = deque(maxlen=RATIO_WINDOW)

    def update(self, stats: StepStats) -> None:
        """Learn from one finished step (as :meth:`FeatureExtractor.update` does)."""
        loss = abs(stats.loss) if stats.loss_seen else math.nan
        if not 0.0 < loss < math.inf:
            return
        ema = self.loss_ema
        self.loss_ema = loss if ema != ema else 0.9 * ema + 0.1 * loss
        amax = stats.grad_amax
        if not stats.found_inf and 0.0 < amax < math.inf:
            self.ratios.append(amax / loss)

    def constants(self, scale: float) -> tuple[float, float]:
        """(log2 of the EMA, log2 of fp16's maximum less log2 of the largest ratio and of
        ``scale``): NaN where unknown. The host half of the features, for the device path."""
        ema = self.loss_ema
        c_jump = math.log2(ema) if ema == ema else math.nan
        c_room = (
            LOG2_FP16_MAX - math.log2(max(self.ratios)) - math.log2(scale)
            if self.ratios
            else math.nan
        )
        return c_jump, c_room

    def features(self, loss: float, scale: float) -> list[float]:
        """The scale-time features of a step with ``loss`` at base ``scale`` (host floats)."""
        m = abs(loss)
        if not m < math.inf or m != m:
            return [0.0, 0.0, 1.0]
        if m == 0.0:
            return [0.0, 0.0, 0.0]
        c_jump, c_room = self.constants(scale)
        log2_m = math.log2(m)
        jump = _clip((log2_m - c_jump) / 4.0) if c_jump == c_jump else 0.0
        room = _clip((c_room - log2_m) / 16.0) if c_room == c_room else 0.0
        return [jump, room, 0.0]

    def device_features(self, loss: Any, scale: float) -> Any:
        """:meth:`features` of a loss tensor, on its device (float64; float32 on MPS): a vector
        of :data:`N_SCALE_TIME`, no host sync."""
        import torch

        dev = loss.device
        exact = torch.float32 if dev.type == "mps" else torch.float64
        c_jump, c_room = self.constants(scale)
        m = loss.detach().to(dev, exact, copy=True).reshape(()).abs_()
        finite = torch.isfinite(m)
        positive = finite & (m > 0)
        log2_m = torch.where(positive, m, torch.ones_like(m)).log2_()
        zero = torch.zeros_like(m)
        jump = ((log2_m - c_jump) / 4.0).clamp_(-BOUND, BOUND) if c_jump == c_jump else zero
        room = ((c_room - log2_m) / 16.0).clamp_(-BOUND, BOUND) if c_room == c_room else zero
        jump = torch.where(positive, jump, zero)
        room = torch.where(positive, room, zero)
        return torch.stack([jump, room, (~finite).to(exact)])

    def state_dict(self) -> dict[str, Any]:
        return {"loss_ema": self.loss_ema, "ratios": list(self.ratios)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ema, ratios = state.get("loss_ema", math.nan), state.get("ratios", [])
        if not isinstance(ema, (int, float)) or not isinstance(ratios, list):
            raise ConfigError(
                f"scale-time state must hold a number 'loss_ema' and a list 'ratios', got {state!r}"
            )
        if not all(isinstance(r, (int, float)) and 0 < r < math.inf for r in ratios):
            raise ConfigError(f"scale-time 'ratios' must be positive numbers, got {ratios!r}")
        self.loss_ema = float(ema)
        self.ratios = deque((float(r) for r in ratios), maxlen=RATIO_WINDOW)
