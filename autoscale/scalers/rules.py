"""The classic loss-scale rules, each with its published defaults and where it comes from.

Every rule is a pure :class:`~autoscale.scalers.rule.ScaleRule`: hyperparameters in ``__init__``,
the decision in ``next_scale``, counters in ``state``. The counters reproduce the original code
paths step for step (tests hold them to hand-computed sequences and to the upstream code itself),
including their quirks, since learned policies are measured against them.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any, ClassVar

from autoscale.errors import ConfigError
from autoscale.scalers.rule import FP16_MAX, ScaleRule, StepStats, f32

__all__ = [
    "StaticRule",
    "TorchRule",
    "DeepSpeedRule",
    "MegatronRule",
    "JmpRule",
    "FairseqRule",
    "MetaseqRule",
    "AmaxHistoryRule",
    "AmaxCapRule",
    "AmaxLossRule",
    "BUILTIN_RULES",
    "HALF_BIT",
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


def _bits(name: str, value: float) -> float:
    """A margin in bits: a non-negative finite number."""
    out = float(value)
    if not (math.isfinite(out) and out >= 0):
        raise ConfigError(f"{name} must be a non-negative number of bits, got {out!r}")
    return out


def _interval(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) <= 0:
        raise ConfigError(f"{name} must be a positive integer number of steps, got {value!r}")
    return int(value)


def _ints(rule: ScaleRule, state: dict[str, Any], defaults: dict[str, int]) -> dict[str, int]:
    """The integer counters ``defaults`` names, read from ``state`` (missing keys: the default).

    Raises:
        ConfigError: ``state`` is no mapping, or a counter is no integer; names the rule and key.
    """
    if not isinstance(state, dict):
        raise ConfigError(
            f"rule '{rule.name}': state must be a mapping, got {type(state).__name__}; "
            "the checkpoint was not written by this rule"
        )
    out = {}
    for key, default in defaults.items():
        value = state.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                f"rule '{rule.name}': state '{key}' must be an integer, got {value!r}; "
                "the checkpoint was not written by this rule"
            )
        out[key] = value
    return out


def _dynamic_block(rule: ScaleRule, init_scale: float, min_scale: float) -> dict[str, Any]:
    """What every dynamic DeepSpeed ``fp16`` block holds: the initial power and the minimum."""
    power = math.log2(init_scale)
    if power != int(power):
        raise ConfigError(
            f"DeepSpeed takes initial_scale_power (a power of two); init_scale {init_scale:g} is not one"
        )
    # DeepSpeedFP16Config declares min_loss_scale an int: a floor under 1 (torch's rule keeps 2^-24)
    # becomes 1, the lowest DeepSpeed can hold.
    if min_scale > 1 and min_scale != int(min_scale):
        raise ConfigError(
            f"DeepSpeed's min_loss_scale is an integer; min_scale {min_scale:g} is not one "
            f"(use min_scale={int(min_scale)} or {int(min_scale) + 1})"
        )
    return {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": int(power),
        "min_loss_scale": max(1, int(min_scale)),
    }


def _window_block(
    rule: ScaleRule,
    init_scale: float,
    min_scale: float,
    growth: float,
    backoff: float,
    window: int,
    hysteresis: int = 1,
) -> dict[str, Any]:
    """A counter rule with a growth window in DeepSpeed's terms (factors fixed at 2 and 1/2)."""
    if growth != 2.0 or backoff != 0.5:
        raise ConfigError(
            f"DeepSpeed fixes the factors at 2 and 1/2; rule '{rule.name}' uses {growth:g} and {backoff:g}"
        )
    # DeepSpeed's first growth comes after window+1 clean steps, torch/jmp/megatron's after
    # `window`: window-1 matches the first growth; DeepSpeed's later growths then come every
    # window-1 steps instead of every window (DeepSpeed cannot express the rule exactly).
    return {
        **_dynamic_block(rule, init_scale, min_scale),
        "loss_scale_window": max(1, window - 1),
        "hysteresis": hysteresis,
        "consecutive_hysteresis": False,
    }


class StaticRule(ScaleRule):
    """A fixed scale: overflowing steps are skipped, the scale never moves.

    Source: apex/DeepSpeed ``loss_scale: N`` (static loss scaling); 128 is a common hand-picked value.
    """

    description = "fixed scale; overflowing steps are skipped"
    source = "apex / DeepSpeed static loss scale"
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
        self.growth_factor = _growth(growth_factor)
        self.backoff_factor = _backoff(backoff_factor)
        self.growth_interval = _interval("growth_interval", growth_interval)
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
        vars(self).update(_ints(self, state, {"growth_tracker": 0}))

    def deepspeed_config(self, init_scale: float, min_scale: float) -> dict[str, Any]:
        return _window_block(
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
        vars(self).update(_ints(self, state, defaults))

    def deepspeed_config(self, init_scale: float, min_scale: float) -> dict[str, Any]:
        if self.scale_factor != 2.0:
            raise ConfigError(
                f"DeepSpeed's config fixes scale_factor at 2; this rule uses {self.scale_factor:g}"
            )
        return {
            **_dynamic_block(self, init_scale, min_scale),
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
        self.growth_factor = _growth(growth_factor)
        self.backoff_factor = _backoff(backoff_factor)
        self.growth_interval = _interval("growth_interval", growth_interval)
        self.hysteresis = _interval("hysteresis", hysteresis)
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
        vars(self).update(_ints(self, state, defaults))

    def deepspeed_config(self, init_scale: float, min_scale: float) -> dict[str, Any]:
        return _window_block(
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
        self.period = _interval("period", period)
        self.factor = _growth(factor)
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
        self.counter = _ints(self, state, {"growth_tracker": 0})["growth_tracker"]

    def deepspeed_config(self, init_scale: float, min_scale: float) -> dict[str, Any]:
        return _window_block(
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
        self.scale_factor = _growth(scale_factor)
        self.scale_window = self.initial_window = _interval("scale_window", scale_window)
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
        vars(self).update(_ints(self, state, defaults))


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


class AmaxHistoryRule(ScaleRule):
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
        self, *, history_len: int = 16, margin: float = 2.0, backoff_factor: float = 0.5
    ) -> None:
        self.history_len = _interval("history_len", history_len)
        self.margin = _bits("margin", margin)
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

    def params(self) -> dict[str, Any]:
        return {
            "history_len": self.history_len,
            "margin": self.margin,
            "backoff_factor": self.backoff_factor,
        }

    def state(self) -> dict[str, Any]:
        return {"history": [float(a) for a in self.history]}

    def load_state(self, state: dict[str, Any]) -> None:
        history = state.get("history", []) if isinstance(state, dict) else None
        if not isinstance(history, list) or not all(
            isinstance(a, (int, float)) and not isinstance(a, bool) for a in history
        ):
            raise ConfigError(
                f"rule '{self.name}': state 'history' must be a list of numbers, got {history!r}; "
                "the checkpoint was not written by this rule"
            )
        self.history = deque((float(a) for a in history), maxlen=self.history_len)


class AmaxCapRule(AmaxHistoryRule):
    """``amax-history`` under a cap that remembers gradient overflows, blind to failed batches.

    The scale is the smaller of ``amax-history``'s (the largest power of two that keeps the
    gradient amax of the last ``history_len`` clean steps ``margin`` bits below fp16's maximum)
    and a cap. The cap starts unbounded; a gradient overflow sets it to the scale that overflowed
    times ``backoff_factor``, and it doubles after every ``growth_interval`` clean steps in a row,
    as torch's scale does. So spikes that the amax of recent steps cannot foresee (gradients that
    swing by orders of magnitude from batch to batch) are met as torch meets them, at a scale
    that leaves them room, while steady gradients get ``amax-history``'s scale.

    Halving lands anywhere up to a bit below the overflow boundary (half a bit on average), and
    the precision lost there is what a spiky workload pays for its whole run. So once the cap has
    stayed clean for ``probe_after`` steps, it tries the geometric midpoint between itself and the
    scale that overflowed, once: if that overflows too, the cap returns to the level that was
    clean (instead of halving again), and the boundary is known to within half a bit either way.
    A probe costs at most one skipped step per backoff; so does each growth, which also returns
    to the clean level when it overflows.

    A step whose *loss* is non-finite failed in the forward pass, which the loss scale never
    touches, so it would fail at any scale: it changes neither the scale nor the cap (where the
    counter rules halve on every such batch and ratchet down to their minimum). Without a loss
    (``scale()`` never saw a single-element one) every overflow counts as a gradient overflow.
    """

    description = (
        "amax-history under torch's overflow cap, refined by one half-bit probe; "
        "ignores batches whose loss is inf/nan"
    )
    source = "autoscale: Transformer Engine DelayedScaling plus torch.amp.GradScaler's backoff"
    needs_loss = True

    def __init__(
        self,
        *,
        history_len: int = 16,
        margin: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        probe_after: int = 64,
        capped_margin: float = 0.0,
    ) -> None:
        super().__init__(history_len=history_len, margin=margin, backoff_factor=backoff_factor)
        self.capped_margin = _bits("capped_margin", capped_margin)
        self.growth_interval = _interval("growth_interval", growth_interval)
        self.probe_after = _interval("probe_after", probe_after)
        self.cap = math.inf  # no gradient overflow yet
        self.clean = 0  # clean steps in a row since the cap last changed
        self.overflowed = math.inf  # the lowest scale that overflowed since the last backoff
        self.safe = 0.0  # the cap's level before a probe or a growth (0: none to return to)
        self.binding = False  # whether the cap set the last scale (read by rules that regrow)

    def next_scale(self, scale: float, stats: StepStats) -> float:
        if stats.loss_nonfinite:
            return scale  # fails at any scale: nothing to learn about the scale from it
        if stats.found_inf or not math.isfinite(stats.grad_amax):
            if 0.0 < self.safe < scale:  # a probe or a growth overflowed: back to the clean level
                self.cap = self.safe
                self._probe_failed()
            else:
                self.cap = scale * self.backoff_factor
            self.overflowed, self.safe, self.clean = scale, 0.0, 0
            return self.cap
        if math.isfinite(self.cap):
            self.clean += 1
            wait = self._probe_wait()
            if self.clean >= self.growth_interval:
                self.safe, self.cap, self.overflowed = self.cap, self.cap * 2.0, math.inf
                self.clean = 0
            elif (
                self.clean >= wait
                and math.isfinite(self.overflowed)  # after a growth nothing overflowed yet
                and self.overflowed > self.cap * HALF_BIT
            ):
                self.safe, self.cap = self.cap, math.sqrt(self.cap * self.overflowed)
                self.clean = 0
            elif self.regrows and self.binding and self.clean >= wait:  # try above the boundary
                self.safe, self.cap, self.overflowed = self.cap, self.cap * 2.0, math.inf
                self.clean = 0
        if stats.grad_amax > 0:
            self.history.append(stats.grad_amax)
        if not self.history:
            return min(scale, self.cap)
        amax = max(self.history)
        margin = self.margin if math.isinf(self.cap) else self.capped_margin
        wanted = 2.0 ** math.floor(math.log2(FP16_MAX / amax) - margin)
        self.binding = wanted >= self.cap  # the cap, not the amax, sets the scale
        return min(wanted, self.cap)

    regrows: ClassVar[bool] = False  # try above a known boundary again, after _probe_wait()

    def _probe_wait(self) -> int:
        """Clean steps under the cap before it is probed."""
        return self.probe_after

    def _probe_failed(self) -> None:
        """A probe or a growth of the cap overflowed (it is back at its clean level)."""

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "capped_margin": self.capped_margin,
            "growth_interval": self.growth_interval,
            "probe_after": self.probe_after,
        }

    def state(self) -> dict[str, Any]:
        def finite(x: float) -> float | None:  # None: unbounded
            return x if math.isfinite(x) else None

        return {
            **super().state(),
            "cap": finite(self.cap),
            "clean": self.clean,
            "overflowed": finite(self.overflowed),
            "safe": self.safe,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        values = {}
        for key, unbounded in (("cap", math.inf), ("overflowed", math.inf), ("safe", 0.0)):
            v = state.get(key)
            if v is None and unbounded == math.inf:
                values[key] = math.inf
                continue
            v = 0.0 if v is None else v
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ConfigError(
                    f"rule '{self.name}': state '{key}' must be a non-negative number"
                    f"{' or null' if unbounded == math.inf else ''}, got {v!r}; "
                    "the checkpoint was not written by this rule"
                )
            values[key] = float(v)
        if values["cap"] == 0.0:
            raise ConfigError(
                f"rule '{self.name}': state 'cap' must be positive or null, got 0; "
                "the checkpoint was not written by this rule"
            )
        self.cap, self.overflowed, self.safe = values["cap"], values["overflowed"], values["safe"]
        self.clean = _ints(self, state, {"clean": 0})["clean"]


# a gap wider than half a bit; the tolerance covers the float32 rounding of the scale
HALF_BIT = math.sqrt(2.0) * (1.0 + 1e-6)


class AmaxLossRule(AmaxCapRule):
    """``amax-cap`` that reads each step's loss before its backward pass, and regrows its cap.

    Spiky losses (preference/DPO-style log-sigmoids, rare hard batches) make gradients whose size
    follows the loss: measured on the suite's preference members, log2 of the gradient amax
    follows log2 |loss| with slope about 1 (``experiments/results/preference_anatomy.md``). A
    scale that suits the quiet steps overflows on the spikes, and a scale that suits the spikes
    (torch's, and ``amax-cap``'s cap) leaves the quiet steps' gradients below fp16's normal range.

    So the rule keeps the largest gradient amax per unit of loss of the last ``guard_history``
    clean steps, and the scaler lowers each step's scale, on the device when the loss is scaled
    (no host sync), to keep the step's foreseen amax ``guard_margin`` bits below fp16's maximum:
    a spike gets a smaller scale for that step only (:meth:`guard_limit`). A guarded step that
    still overflows raises the amax per loss it remembers and leaves the cap alone; other
    overflows set the cap as ``amax-cap`` does.

    A cap set by spikes the guard now absorbs would hold the quiet steps down for
    ``growth_interval`` steps; so after ``probe_after`` clean steps the cap is probed (towards a
    known overflow half a bit away, else, while the cap and not the amax sets the scale, one bit
    above it), and each probe that overflows doubles the wait before the next, up to
    ``growth_interval``: in a long run the probes cost a few skipped steps, then one per
    ``growth_interval`` steps, as torch's growth does.
    """

    description = (
        "amax-cap, each step's scale lowered on the device to fit its loss; regrows its cap "
        "with backoff"
    )
    source = "autoscale: amax-cap plus a loss-proportional per-step guard"
    has_guard = True
    regrows = True

    def __init__(
        self,
        *,
        history_len: int = 16,
        margin: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        probe_after: int = 16,
        capped_margin: float = 0.0,
        guard_history: int = 16,
        guard_margin: float = 1.0,
    ) -> None:
        super().__init__(
            history_len=history_len,
            margin=margin,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            probe_after=probe_after,
            capped_margin=capped_margin,
        )
        self.guard_margin = _bits("guard_margin", guard_margin)
        self.guard_history = _interval("guard_history", guard_history)
        self.ratios: deque[float] = deque(maxlen=self.guard_history)  # gradient amax per |loss|
        self.wait = self.probe_after  # clean steps before the next probe of the cap
        self.base = math.nan  # the scale next_scale set last (before any guard)

    def guard_limit(self) -> float | None:
        if not self.ratios:
            return None
        return FP16_MAX * 2.0**-self.guard_margin / max(self.ratios)

    def _probe_wait(self) -> int:
        return self.wait

    def _probe_failed(self) -> None:
        self.wait = min(2 * self.wait, self.growth_interval)

    def next_scale(self, scale: float, stats: StepStats) -> float:
        base = self.base if self.base == self.base else scale
        loss = abs(stats.loss) if stats.loss_seen else math.nan
        usable = 0.0 < loss < math.inf
        if stats.found_inf or not math.isfinite(stats.grad_amax):
            if stats.guarded and usable:
                # the guard's foresight fell short: this loss needed at least twice the room
                self.ratios.append(2.0 * FP16_MAX / (scale * loss))
                self.base = base
                return base
        elif usable and stats.grad_amax > 0:
            self.ratios.append(stats.grad_amax / loss)
            if stats.guarded:  # its loss explains its gradients: no amax for the quiet steps
                stats = dataclasses.replace(stats, grad_amax=0.0)
        self.base = super().next_scale(base if stats.guarded else scale, stats)
        return self.base

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "guard_history": self.guard_history,
            "guard_margin": self.guard_margin,
        }

    def state(self) -> dict[str, Any]:
        return {
            **super().state(),
            "ratios": [float(r) for r in self.ratios],
            "wait": self.wait,
            "base": None if self.base != self.base else self.base,
            "binding": self.binding,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        ratios = state.get("ratios", [])
        if not isinstance(ratios, list) or not all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r < math.inf
            for r in ratios
        ):
            raise ConfigError(
                f"rule '{self.name}': state 'ratios' must be a list of positive numbers, got "
                f"{ratios!r}; the checkpoint was not written by this rule"
            )
        base = state.get("base")
        if base is not None and (
            isinstance(base, bool) or not isinstance(base, (int, float)) or not 0 < base < math.inf
        ):
            raise ConfigError(
                f"rule '{self.name}': state 'base' must be a positive number or null, got "
                f"{base!r}; the checkpoint was not written by this rule"
            )
        binding = state.get("binding", False)
        if not isinstance(binding, bool):
            raise ConfigError(
                f"rule '{self.name}': state 'binding' must be true or false, got {binding!r}; "
                "the checkpoint was not written by this rule"
            )
        self.binding = binding
        self.ratios = deque((float(r) for r in ratios), maxlen=self.guard_history)
        self.base = math.nan if base is None else float(base)
        self.wait = min(
            max(_ints(self, state, {"wait": self.probe_after})["wait"], 1), self.growth_interval
        )


# the built-in rules by the name each is registered under (autoscale/scalers/registry.py)
BUILTIN_RULES: dict[str, type[ScaleRule]] = {
    "static": StaticRule,
    "torch": TorchRule,
    "deepspeed": DeepSpeedRule,
    "megatron": MegatronRule,
    "jmp": JmpRule,
    "fairseq": FairseqRule,
    "metaseq": MetaseqRule,
    "amax-history": AmaxHistoryRule,
    "amax-cap": AmaxCapRule,
    "amax-loss": AmaxLossRule,
}
for _name, _cls in BUILTIN_RULES.items():  # the name get_scaler knows each by
    _cls.name = _name
