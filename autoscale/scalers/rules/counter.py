"""The counter rules: a scale that halves on overflow and grows after clean steps, as torch, DeepSpeed,
Megatron-LM, JMP, fairseq and metaseq write it (and a static scale)."""

from __future__ import annotations

import math
from typing import Any

from autoscale.errors import ConfigError
from autoscale.scalers.controller import ScaleRule, StepStats, f32
from autoscale.scalers.rules.checks import (
    check_backoff,
    check_growth,
    check_interval,
    dynamic_block,
    int_state,
    window_block,
)

__all__ = [
    "StaticRule",
    "TorchRule",
    "DeepSpeedRule",
    "MegatronRule",
    "JmpRule",
    "FairseqRule",
    "MetaseqRule",
]


class StaticRule(ScaleRule):
    """A fixed scale: overflowing steps are skipped, the scale never moves.

    Source: apex/DeepSpeed ``loss_scale: N`` (static loss scaling); 128 is a common hand-picked value.
    """

    description = "fixed scale; overflowing steps are skipped"
    source = "apex / DeepSpeed static loss scale"
    adapts = False
    default_init_scale = 128.0

    def next_scale(self, scale: float, stats: StepStats) -> float:
        return scale

    def backs_off_on_overflow(self) -> bool:
        return False  # nothing to lower: as DeepSpeed's static scale, it never aborts

    def deepspeed_config(self, init_scale: float, min_scale: float) -> dict[str, Any]:
        return {"enabled": True, "loss_scale": init_scale}  # any value: DeepSpeed's is a float


class TorchRule(ScaleRule):
    """Exactly ``torch.amp.GradScaler``: x0.5 on overflow, x2 after 2000 clean steps in a row.

    Reproduces ``torch._amp_update_scale_`` (float32 arithmetic, growth only to a finite value),
    so scale sequence, skipped steps and parameters match GradScaler bit for bit while the scale
    stays inside ``[min_scale, max_scale]`` (2^-24 .. 2^64 by default; GradScaler itself can reach
    0, after which every step is NaN).

    Source: ``torch/amp/grad_scaler.py``, ``aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp``.
    """

    description = "torch.amp.GradScaler: x0.5 on overflow, x2 after 2000 clean steps"
    source = "torch.amp.GradScaler (PyTorch)"

    def __init__(
        self,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.growth_factor = check_growth(growth_factor)
        self.backoff_factor = check_backoff(backoff_factor)
        self.growth_interval = check_interval("growth_interval", growth_interval)
        self.growth_tracker = 0

    def next_scale(self, scale: float, stats: StepStats) -> float:
        if stats.found_inf:
            self.growth_tracker = 0
            return f32(scale * self.backoff_factor)
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            grown = f32(scale * self.growth_factor)
            return grown if math.isfinite(grown) else scale
        return scale

    def params(self) -> dict[str, Any]:
        return {
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def state(self) -> dict[str, Any]:
        return {"growth_tracker": self.growth_tracker}

    def load_state(self, state: dict[str, Any]) -> None:
        vars(self).update(int_state(self, state, {"growth_tracker": 0}))

    def deepspeed_config(self, init_scale: float, min_scale: float) -> dict[str, Any]:
        return window_block(
            self,
            init_scale,
            min_scale,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )


class DeepSpeedRule(ScaleRule):
    """DeepSpeed's ``DynamicLossScaler`` with the defaults of its ``fp16`` config block.

    On overflow: if hysteresis is used up, divide by ``scale_factor`` (not below ``min_scale``),
    else spend one unit of hysteresis. Growth: x``scale_factor`` when the steps since the last
    overflow, minus one, are a positive multiple of ``loss_scale_window``, so the first growth comes
    after window+1 clean steps (DeepSpeed's ``stable_interval``). Hysteresis refills on growth, or on
    every clean step with ``consecutive_hysteresis``. ``raise_at_min=True`` reproduces DeepSpeed's
    "Current loss scale already at minimum" abort (off by default: autoscale never kills a run).

    Source: ``deepspeed/runtime/fp16/loss_scaler.py``; config defaults ``initial_scale_power=16``,
    ``loss_scale_window=1000``, ``hysteresis=2``, ``consecutive_hysteresis=false``, ``min_loss_scale=1``.
    """

    description = "DeepSpeed DynamicLossScaler: hysteresis 2, window 1000 (+1), min 1"
    source = "DeepSpeed deepspeed/runtime/fp16/loss_scaler.py"
    default_min_scale = 1.0

    def __init__(
        self,
        *,
        scale_factor: float = 2.0,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
    ) -> None:
        self.scale_factor = check_growth(scale_factor)
        self.loss_scale_window = check_interval("loss_scale_window", loss_scale_window)
        self.hysteresis = check_interval("hysteresis", hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.hysteresis

    def backs_off_on_overflow(self) -> bool:
        return self.hysteresis == 1 or self.cur_hysteresis == 1

    def next_scale(self, scale: float, stats: StepStats) -> float:
        new = scale
        if stats.found_inf:
            if self.backs_off_on_overflow():
                new = scale / self.scale_factor
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable_interval = self.cur_iter - self.last_overflow_iter - 1
            if stable_interval > 0 and stable_interval % self.loss_scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                new = scale * self.scale_factor
        self.cur_iter += 1
        return new

    def params(self) -> dict[str, Any]:
        return {
            "scale_factor": self.scale_factor,
            "loss_scale_window": self.loss_scale_window,
            "hysteresis": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
        }

    def state(self) -> dict[str, Any]:
        return {
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        defaults = {"cur_iter": 0, "last_overflow_iter": -1, "cur_hysteresis": self.hysteresis}
        vars(self).update(int_state(self, state, defaults))

    def deepspeed_config(self, init_scale: float, min_scale: float) -> dict[str, Any]:
        if self.scale_factor != 2.0:
            raise ConfigError(
                f"DeepSpeed's config fixes scale_factor at 2; this rule uses {self.scale_factor:g}"
            )
        return {
            **dynamic_block(self, init_scale, min_scale),
            "loss_scale_window": self.loss_scale_window,
            "hysteresis": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
        }


class MegatronRule(ScaleRule):
    """Megatron-LM's ``DynamicGradScaler``.

    Overflow: reset the growth tracker and spend one unit of hysteresis; once it is used up, multiply
    by ``backoff_factor`` on every further overflow (clamped at ``min_scale``). Hysteresis is refilled
    only when the scale grows, after ``growth_interval`` clean steps in a row.

    Source: ``megatron/core/optimizer/grad_scaler.py``; defaults from Megatron's arguments
    (``initial_loss_scale=2^32``, ``min_loss_scale=1``, ``loss_scale_window=1000``, ``hysteresis=2``).
    """

    description = "Megatron DynamicGradScaler: hysteresis 2 refilled only on growth, window 1000"
    source = "Megatron-LM megatron/core/optimizer/grad_scaler.py"
    default_init_scale = 2.0**32
    default_min_scale = 1.0

    def __init__(
        self,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        self.growth_factor = check_growth(growth_factor)
        self.backoff_factor = check_backoff(backoff_factor)
        self.growth_interval = check_interval("growth_interval", growth_interval)
        self.hysteresis = check_interval("hysteresis", hysteresis)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def backs_off_on_overflow(self) -> bool:
        return self.hysteresis_tracker <= 1

    def next_scale(self, scale: float, stats: StepStats) -> float:
        # float32 products, as Megatron's scale and factor tensors: with a factor that is not a
        # power of two, a double product rounds differently (tests/reference/test_megatron.py)
        if stats.found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                return f32(scale * f32(self.backoff_factor))
            return scale
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            return f32(scale * f32(self.growth_factor))
        return scale

    def params(self) -> dict[str, Any]:
        return {
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
        }

    def state(self) -> dict[str, Any]:
        return {
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        defaults = {"growth_tracker": 0, "hysteresis_tracker": self.hysteresis}
        vars(self).update(int_state(self, state, defaults))

    def deepspeed_config(self, init_scale: float, min_scale: float) -> dict[str, Any]:
        return window_block(
            self,
            init_scale,
            min_scale,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            self.hysteresis,
        )


class JmpRule(ScaleRule):
    """DeepMind jmp's ``DynamicLossScale``: /factor on overflow (not below min), x factor every
    ``period`` finite steps in a row.

    Source: ``jmp/_src/loss_scale.py``; defaults ``period=2000``, ``factor=2``, ``min_loss_scale=1``;
    the initial scale is the user's (2^15 in jmp's examples).
    """

    description = "jmp DynamicLossScale: period 2000, factor 2, min 1"
    source = "DeepMind jmp jmp/_src/loss_scale.py"
    default_init_scale = 2.0**15
    default_min_scale = 1.0

    def __init__(self, *, period: int = 2000, factor: float = 2.0) -> None:
        self.period = check_interval("period", period)
        self.factor = check_growth(factor)
        self.counter = 0

    def next_scale(self, scale: float, stats: StepStats) -> float:
        if stats.found_inf:
            self.counter = 0
            return scale / self.factor
        new = scale * self.factor if self.counter == self.period - 1 else scale
        self.counter = (self.counter + 1) % self.period
        return new

    def params(self) -> dict[str, Any]:
        return {"period": self.period, "factor": self.factor}

    def state(self) -> dict[str, Any]:
        return {"growth_tracker": self.counter}

    def load_state(self, state: dict[str, Any]) -> None:
        self.counter = int_state(self, state, {"growth_tracker": 0})["growth_tracker"]

    def deepspeed_config(self, init_scale: float, min_scale: float) -> dict[str, Any]:
        return window_block(
            self, init_scale, min_scale, self.factor, 1.0 / self.factor, self.period
        )


class FairseqRule(ScaleRule):
    """fairseq's ``DynamicLossScaler``: overflow tolerance and a fixed growth window.

    On overflow, the scale is divided by ``scale_factor`` only when the share of overflowing steps
    since the last rescale reaches ``tolerance`` (0 = always). Growth: x``scale_factor`` when the
    steps since the last overflow are a multiple of ``scale_window``.

    Source: ``fairseq/optim/dynamic_loss_scaler.py``; defaults ``--fp16-init-scale 128``,
    ``--fp16-scale-window`` 2^14 / (world size x update_freq) = 16384 on one device,
    ``--fp16-scale-tolerance 0``, ``--min-loss-scale 1e-4``.
    """

    description = "fairseq DynamicLossScaler: tolerance 0, window 16384, init 128, min 1e-4"
    source = "fairseq fairseq/optim/dynamic_loss_scaler.py"
    default_init_scale = 128.0
    default_min_scale = 1e-4
    grow_window = False

    def __init__(
        self, *, scale_factor: float = 2.0, scale_window: int = 16384, tolerance: float = 0.0
    ) -> None:
        self.scale_factor = check_growth(scale_factor)
        self.scale_window = self.initial_window = check_interval("scale_window", scale_window)
        tolerance = float(tolerance)
        if not 0.0 <= tolerance <= 1.0:
            raise ConfigError(f"tolerance must be a share of steps in [0, 1], got {tolerance!r}")
        self.tolerance = tolerance
        self.iter = 0
        self.last_overflow_iter = -1
        self.last_rescale_iter = -1
        self.overflows_since_rescale = 0

    def _would_rescale(self) -> bool:
        since_rescale = self.iter - self.last_rescale_iter
        return (self.overflows_since_rescale + 1) / float(since_rescale) >= self.tolerance

    def backs_off_on_overflow(self) -> bool:
        return self._would_rescale()

    def next_scale(self, scale: float, stats: StepStats) -> float:
        new = scale
        if stats.found_inf:
            rescale = self._would_rescale()
            self.last_overflow_iter = self.iter
            self.overflows_since_rescale += 1
            if rescale:
                new = scale / self.scale_factor
                if self.grow_window:
                    self.scale_window = max(int(self.scale_window / self.scale_factor), 1)
                self.last_rescale_iter = self.iter
                self.overflows_since_rescale = 0
        elif (self.iter - self.last_overflow_iter) % self.scale_window == 0:
            new = scale * self.scale_factor
            self.last_rescale_iter = self.iter
            if self.grow_window:
                self.scale_window = int(self.scale_window * self.scale_factor)
        self.iter += 1
        return new

    def params(self) -> dict[str, Any]:
        return {
            "scale_factor": self.scale_factor,
            "scale_window": self.initial_window,
            "tolerance": self.tolerance,
        }

    def state(self) -> dict[str, Any]:
        return {
            "iter": self.iter,
            "last_overflow_iter": self.last_overflow_iter,
            "last_rescale_iter": self.last_rescale_iter,
            "overflows_since_rescale": self.overflows_since_rescale,
            "scale_window": self.scale_window,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        defaults = {
            "iter": 0,
            "last_overflow_iter": -1,
            "last_rescale_iter": -1,
            "overflows_since_rescale": 0,
            "scale_window": self.scale_window,
        }
        vars(self).update(int_state(self, state, defaults))


class MetaseqRule(FairseqRule):
    """metaseq's ``DynamicLossScaler``: fairseq's rule whose window doubles on every growth and
    halves (not below 1) on every backoff.

    Source: ``metaseq/optim/dynamic_loss_scaler.py``; defaults ``init_scale=4``, ``scale_window=256``,
    ``tolerance=0``, ``min_loss_scale=2^-5``.
    """

    description = "metaseq DynamicLossScaler: window 256 doubling on growth, halving on backoff"
    source = "metaseq metaseq/optim/dynamic_loss_scaler.py"
    default_init_scale = 4.0
    default_min_scale = 2.0**-5
    grow_window = True

    def __init__(
        self, *, scale_factor: float = 2.0, scale_window: int = 256, tolerance: float = 0.0
    ) -> None:
        super().__init__(scale_factor=scale_factor, scale_window=scale_window, tolerance=tolerance)
