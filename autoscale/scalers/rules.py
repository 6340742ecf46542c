"""The classic loss-scale rules, each with its published defaults and where it comes from.

Every rule is a :class:`~autoscale.scalers.base.LossScaler`; they differ only in ``next_scale``.
The counters reproduce the original code paths step for step (tests hold them to hand-computed
sequences), including their quirks, since learned policies are measured against them.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from autoscale.errors import ConfigError
from autoscale.scalers.base import FP16_MAX, LossScaler, StepStats, f32
from autoscale.scalers.registry import register_loss_scaler

__all__ = [
    "StaticScaler",
    "TorchScaler",
    "DeepSpeedScaler",
    "MegatronScaler",
    "JmpScaler",
    "FairseqScaler",
    "MetaseqScaler",
    "AmaxHistoryScaler",
]


def _growth(value: float) -> float:
    value = float(value)
    if not value > 1.0 or not math.isfinite(value):
        raise ConfigError(
            f"growth factor must be > 1 (it multiplies the scale on growth), got {value!r}"
        )
    return value


def _backoff(value: float) -> float:
    value = float(value)
    if not 0.0 < value < 1.0:
        raise ConfigError(
            f"backoff factor must be in (0, 1) (it multiplies the scale on overflow), got {value!r}"
        )
    return value


def _interval(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) <= 0:
        raise ConfigError(f"{name} must be a positive integer number of steps, got {value!r}")
    return int(value)


@register_loss_scaler("static")
class StaticScaler(LossScaler):
    """A fixed scale: overflowing steps are skipped, the scale never moves.

    Source: apex/DeepSpeed ``loss_scale: N`` (static loss scaling); 128 is a common hand-picked value.
    """

    description = "fixed scale; overflowing steps are skipped"
    source = "apex / DeepSpeed static loss scale"

    def __init__(self, device: str | None = None, *, init_scale: float = 128.0, **kw: Any) -> None:
        super().__init__(device, init_scale=init_scale, **kw)

    def next_scale(self, scale: float, stats: StepStats) -> float:
        return scale


@register_loss_scaler("torch")
class TorchScaler(LossScaler):
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
        device: str | None = None,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        **kw: Any,
    ) -> None:
        super().__init__(device, init_scale=init_scale, **kw)
        self._growth_factor = _growth(growth_factor)
        self._backoff_factor = _backoff(backoff_factor)
        self._growth_interval = _interval("growth_interval", growth_interval)
        self.growth_tracker = 0

    def next_scale(self, scale: float, stats: StepStats) -> float:
        if stats.found_inf:
            self.growth_tracker = 0
            return f32(scale * self._backoff_factor)
        self.growth_tracker += 1
        if self.growth_tracker == self._growth_interval:
            self.growth_tracker = 0
            grown = f32(scale * self._growth_factor)
            return grown if math.isfinite(grown) else scale
        return scale

    def rule_params(self) -> dict[str, Any]:
        return {
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
        }

    def rule_state(self) -> dict[str, Any]:
        return {"growth_tracker": self.growth_tracker}

    def load_rule_state(self, state: dict[str, Any]) -> None:
        self.growth_tracker = int(state.get("growth_tracker", 0))


@register_loss_scaler("deepspeed")
class DeepSpeedScaler(LossScaler):
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
        device: str | None = None,
        *,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(device, init_scale=init_scale, **kw)
        self.scale_factor = _growth(scale_factor)
        self.loss_scale_window = _interval("loss_scale_window", loss_scale_window)
        self.hysteresis = _interval("hysteresis", hysteresis)
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
                new = max(scale / self.scale_factor, self.min_scale)
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

    def rule_params(self) -> dict[str, Any]:
        return {
            "scale_factor": self.scale_factor,
            "loss_scale_window": self.loss_scale_window,
            "hysteresis": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
        }

    def rule_state(self) -> dict[str, Any]:
        return {
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_rule_state(self, state: dict[str, Any]) -> None:
        self.cur_iter = int(state.get("cur_iter", 0))
        self.last_overflow_iter = int(state.get("last_overflow_iter", -1))
        self.cur_hysteresis = int(state.get("cur_hysteresis", self.hysteresis))


@register_loss_scaler("megatron")
class MegatronScaler(LossScaler):
    """Megatron-LM's ``DynamicGradScaler``.

    Overflow: reset the growth tracker and spend one unit of hysteresis; once it is used up, multiply
    by ``backoff_factor`` on every further overflow (clamped at ``min_scale``). Hysteresis is refilled
    only when the scale grows, after ``growth_interval`` clean steps in a row.

    Source: ``megatron/core/optimizer/grad_scaler.py``; defaults from Megatron's arguments
    (``initial_loss_scale=2^32``, ``min_loss_scale=1``, ``loss_scale_window=1000``, ``hysteresis=2``).
    """

    description = "Megatron DynamicGradScaler: hysteresis 2 refilled only on growth, window 1000"
    source = "Megatron-LM megatron/core/optimizer/grad_scaler.py"
    default_min_scale = 1.0

    def __init__(
        self,
        device: str | None = None,
        *,
        init_scale: float = 2.0**32,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        **kw: Any,
    ) -> None:
        super().__init__(device, init_scale=init_scale, **kw)
        self.growth_factor = _growth(growth_factor)
        self.backoff_factor = _backoff(backoff_factor)
        self.growth_interval = _interval("growth_interval", growth_interval)
        self.hysteresis = _interval("hysteresis", hysteresis)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def next_scale(self, scale: float, stats: StepStats) -> float:
        # float32 products, as Megatron's scale and factor tensors: with a factor that is not a
        # power of two, a double product rounds differently (tests/reference/test_megatron.py)
        if stats.found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                return max(f32(scale * f32(self.backoff_factor)), self.min_scale)
            return scale
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            return f32(scale * f32(self.growth_factor))
        return scale

    def rule_params(self) -> dict[str, Any]:
        return {
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
        }

    def rule_state(self) -> dict[str, Any]:
        return {
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_rule_state(self, state: dict[str, Any]) -> None:
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))


@register_loss_scaler("jmp")
class JmpScaler(LossScaler):
    """DeepMind jmp's ``DynamicLossScale``: /factor on overflow (not below min), x factor every
    ``period`` finite steps in a row.

    Source: ``jmp/_src/loss_scale.py``; defaults ``period=2000``, ``factor=2``, ``min_loss_scale=1``;
    the initial scale is the user's (2^15 in jmp's examples).
    """

    description = "jmp DynamicLossScale: period 2000, factor 2, min 1"
    source = "DeepMind jmp jmp/_src/loss_scale.py"
    default_min_scale = 1.0

    def __init__(
        self,
        device: str | None = None,
        *,
        init_scale: float = 2.0**15,
        period: int = 2000,
        factor: float = 2.0,
        **kw: Any,
    ) -> None:
        super().__init__(device, init_scale=init_scale, **kw)
        self.period = _interval("period", period)
        self.factor = _growth(factor)
        self.counter = 0

    def next_scale(self, scale: float, stats: StepStats) -> float:
        if stats.found_inf:
            self.counter = 0
            return max(self.min_scale, scale / self.factor)
        new = scale * self.factor if self.counter == self.period - 1 else scale
        self.counter = (self.counter + 1) % self.period
        return new

    def rule_params(self) -> dict[str, Any]:
        return {"period": self.period, "factor": self.factor}

    def rule_state(self) -> dict[str, Any]:
        return {"growth_tracker": self.counter}

    def load_rule_state(self, state: dict[str, Any]) -> None:
        self.counter = int(state.get("growth_tracker", 0))


@register_loss_scaler("fairseq")
class FairseqScaler(LossScaler):
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
    default_min_scale = 1e-4
    grow_window = False

    def __init__(
        self,
        device: str | None = None,
        *,
        init_scale: float = 128.0,
        scale_factor: float = 2.0,
        scale_window: int = 16384,
        tolerance: float = 0.0,
        **kw: Any,
    ) -> None:
        super().__init__(device, init_scale=init_scale, **kw)
        self.scale_factor = _growth(scale_factor)
        self.scale_window = _interval("scale_window", scale_window)
        tolerance = float(tolerance)
        if not 0.0 <= tolerance <= 1.0:
            raise ConfigError(f"tolerance must be a share of steps in [0, 1], got {tolerance!r}")
        self.tolerance = tolerance
        self.iter = 0
        self.last_overflow_iter = -1
        self.last_rescale_iter = -1
        self.overflows_since_rescale = 0

    def next_scale(self, scale: float, stats: StepStats) -> float:
        new = scale
        if stats.found_inf:
            since_rescale = self.iter - self.last_rescale_iter
            self.last_overflow_iter = self.iter
            self.overflows_since_rescale += 1
            if self.overflows_since_rescale / float(since_rescale) >= self.tolerance:
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

    def rule_params(self) -> dict[str, Any]:
        return {
            "scale_factor": self.scale_factor,
            "scale_window": self._initial_window(),
            "tolerance": self.tolerance,
        }

    def _initial_window(self) -> int:
        return getattr(self, "_window0", self.scale_window)

    def rule_state(self) -> dict[str, Any]:
        return {
            "iter": self.iter,
            "last_overflow_iter": self.last_overflow_iter,
            "last_rescale_iter": self.last_rescale_iter,
            "overflows_since_rescale": self.overflows_since_rescale,
            "scale_window": self.scale_window,
        }

    def load_rule_state(self, state: dict[str, Any]) -> None:
        self.iter = int(state.get("iter", 0))
        self.last_overflow_iter = int(state.get("last_overflow_iter", -1))
        self.last_rescale_iter = int(state.get("last_rescale_iter", -1))
        self.overflows_since_rescale = int(state.get("overflows_since_rescale", 0))
        self.scale_window = int(state.get("scale_window", self.scale_window))


@register_loss_scaler("metaseq")
class MetaseqScaler(FairseqScaler):
    """metaseq's ``DynamicLossScaler``: fairseq's rule whose window doubles on every growth and
    halves (not below 1) on every backoff.

    Source: ``metaseq/optim/dynamic_loss_scaler.py``; defaults ``init_scale=4``, ``scale_window=256``,
    ``tolerance=0``, ``min_loss_scale=2^-5``.
    """

    description = "metaseq DynamicLossScaler: window 256 doubling on growth, halving on backoff"
    source = "metaseq metaseq/optim/dynamic_loss_scaler.py"
    default_min_scale = 2.0**-5
    grow_window = True

    def __init__(
        self,
        device: str | None = None,
        *,
        init_scale: float = 4.0,
        scale_factor: float = 2.0,
        scale_window: int = 256,
        tolerance: float = 0.0,
        **kw: Any,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            scale_factor=scale_factor,
            scale_window=scale_window,
            tolerance=tolerance,
            **kw,
        )
        self._window0 = self.scale_window


@register_loss_scaler("amax-history")
class AmaxHistoryScaler(LossScaler):
    """Delayed scaling from gradient amax history, Transformer Engine's FP8 recipe applied to fp16.

    After each clean step the scale becomes the largest power of two that keeps
    ``max(amax over the last history_len clean steps) * scale`` at least ``margin`` bits below the
    fp16 maximum (65504). On overflow the scale is multiplied by ``backoff_factor`` and the history
    is kept. Reads gradient statistics (one fused amax reduction per step).

    Source: Transformer Engine ``DelayedScaling`` (``amax_history_len``, ``amax_compute_algo="max"``,
    ``margin``); fp16 values chosen here: history 16, margin 2 bits (parameter gradients under-read
    the activation gradients' amax by up to about one bit).
    """

    description = "scale from max gradient amax of the last 16 steps, 2 bits below fp16 max"
    source = "Transformer Engine DelayedScaling, adapted to fp16"
    needs_stats = True
    needs_rms = False  # reads the amax only: one reduction pass, not two

    def __init__(
        self,
        device: str | None = None,
        *,
        init_scale: float = 2.0**16,
        history_len: int = 16,
        margin: float = 2.0,
        backoff_factor: float = 0.5,
        **kw: Any,
    ) -> None:
        super().__init__(device, init_scale=init_scale, **kw)
        self.history_len = _interval("history_len", history_len)
        margin = float(margin)
        if not (math.isfinite(margin) and margin >= 0):
            raise ConfigError(f"margin must be a non-negative number of bits, got {margin!r}")
        self.margin = margin
        self.backoff_factor = _backoff(backoff_factor)
        self.history: deque[float] = deque(maxlen=self.history_len)

    def next_scale(self, scale: float, stats: StepStats) -> float:
        if stats.found_inf or not math.isfinite(stats.grad_amax):
            return scale * self.backoff_factor
        if stats.grad_amax > 0:
            self.history.append(stats.grad_amax)
        if not self.history:
            return scale
        amax = max(self.history)
        return 2.0 ** math.floor(math.log2(FP16_MAX / amax) - self.margin)

    def rule_params(self) -> dict[str, Any]:
        return {
            "history_len": self.history_len,
            "margin": self.margin,
            "backoff_factor": self.backoff_factor,
        }

    def rule_state(self) -> dict[str, Any]:
        return {"history": [float(a) for a in self.history]}

    def load_rule_state(self, state: dict[str, Any]) -> None:
        self.history = deque((float(a) for a in state.get("history", [])), maxlen=self.history_len)
