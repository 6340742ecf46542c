"""The amax rules: a scale set from the gradients' measured amax (amax-history), with a cap that
overflows set and probes (amax-cap), and a per-step guard from the loss (amax-loss)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, ClassVar

from autoscale.errors import ConfigError
from autoscale.scalers.controller import FP16_MAX, ScaleRule, StepStats
from autoscale.scalers.rules.checks import (
    check_backoff,
    check_bits,
    check_interval,
    int_state,
)
from autoscale.scalers.rules.guard import LEARNED, SHORT, LossGuard

__all__ = ["AmaxHistoryRule", "AmaxCapRule", "AmaxLossRule", "HALF_BIT"]


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
        self.history_len = check_interval("history_len", history_len)
        self.margin = check_bits("margin", margin)
        self.backoff_factor = check_backoff(backoff_factor)
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
        self.capped_margin = check_bits("capped_margin", capped_margin)
        self.growth_interval = check_interval("growth_interval", growth_interval)
        self.probe_after = check_interval("probe_after", probe_after)
        self.cap = math.inf  # no gradient overflow yet
        self.clean = 0  # clean steps in a row since the cap last changed
        self.overflowed = math.inf  # the lowest scale that overflowed since the last backoff
        self.safe = 0.0  # the cap's level before a probe or a growth (0: none to return to)
        self.binding = False  # whether the cap set the last scale (read by rules that regrow)

    def next_scale(self, scale: float, stats: StepStats) -> float:
        return self._cap_step(scale, stats, stats.grad_amax)

    def _cap_step(self, scale: float, stats: StepStats, grad_amax: float) -> float:
        """:meth:`next_scale` with the step's gradient amax given apart (a subclass may give 0:
        no amax to remember; without a copy of ``stats``, this runs every step)."""
        if stats.loss_nonfinite:
            return scale  # fails at any scale: nothing to learn about the scale from it
        if stats.found_inf or not math.isfinite(grad_amax):
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
        if grad_amax > 0:
            self.history.append(grad_amax)
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
        self.clean = int_state(self, state, {"clean": 0})["clean"]


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

    A loss of terms of both signs can sit near zero while its gradients do not (RL fine-tuning's
    advantage-weighted ratios); ``guard_floor`` (bits) keeps such a step from teaching the guard
    an amax per loss that foresees the next step's amax far too large
    (:class:`~autoscale.scalers.rules.guard.LossGuard`); 0 keeps every step.

    The guard takes a finite loss spike at a scale of its own, where torch's overflow drops the
    step. With ``spike_bits`` set, a step whose ``|loss|`` is more than that many bits above the
    largest of the last ``spike_memory`` steps taken is skipped instead, up to ``spike_run`` in
    16 steps (then the loss has risen for good, or alternates with far smaller losses, and the
    next is taken); 0 (the default) skips none.
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
        guard_floor: float = 0.0,
        spike_bits: float = 0.0,
        spike_memory: int = 256,
        spike_run: int = 2,
    ) -> None:
        super().__init__(
            history_len=history_len,
            margin=margin,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            probe_after=probe_after,
            capped_margin=capped_margin,
        )
        g = self.guard = LossGuard(
            guard_history, guard_margin, guard_floor, spike_bits, spike_memory, spike_run
        )
        for key in g.params():  # the guard's checked settings, as the rule's attributes
            setattr(self, key, getattr(g, key))
        # clean steps before the next probe of the cap (growth comes first past the interval)
        self.wait = min(self.probe_after, self.growth_interval)
        self.base = math.nan  # the scale next_scale set last (before any guard)

    @property
    def ratios(self) -> deque[float]:
        """The guard's gradient amax per ``|loss|`` of recent clean steps."""
        return self.guard.ratios

    def guard_limit(self) -> float | None:
        return self.guard.guard_limit()

    def spike_limit(self) -> float | None:
        return self.guard.spike_limit()

    def _probe_wait(self) -> int:
        return self.wait

    def _probe_failed(self) -> None:
        self.wait = min(2 * self.wait, self.growth_interval)

    def next_scale(self, scale: float, stats: StepStats) -> float:
        base = self.base if self.base == self.base else scale
        learned = self.guard.observe(scale, stats)
        if learned == SHORT or stats.spiked:  # the cap stays as it was: the guard's foresight
            # fell short, or the step was skipped for its loss
            self.base = base
            return base
        # a guarded step whose loss explains its gradients: no amax for the quiet steps
        amax = 0.0 if learned == LEARNED and stats.guarded else stats.grad_amax
        self.base = self._cap_step(base if stats.guarded else scale, stats, amax)
        return self.base

    def params(self) -> dict[str, Any]:
        return {**super().params(), **self.guard.params()}

    def state(self) -> dict[str, Any]:
        return {
            **super().state(),
            **self.guard.state(),
            "wait": self.wait,
            "base": None if self.base != self.base else self.base,
            "binding": self.binding,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.guard.load_state(state, f"rule '{self.name}'")
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
        self.base = math.nan if base is None else float(base)
        self.wait = min(
            max(int_state(self, state, {"wait": self.probe_after})["wait"], 1), self.growth_interval
        )
