"""`LossScaler`: a `torch.amp.GradScaler` that hosts a :class:`~autoscale.scalers.rule.ScaleRule`.

The parent's ``scale``/``unscale_``/``step`` are kept as they are, so fused optimizers, gradient
clipping after ``unscale_`` and every framework that drives a GradScaler keep working. What a
GradScaler cannot do is added here: gradient statistics for the rule, their reduction across ranks,
and checkpoints of the rule's state. The decision itself is the rule's, made through a
:class:`~autoscale.scalers.rule.ScaleController` (bounds, minimum), as in the environments.

Host syncs: GradScaler reads the found-inf flag once per step in ``step()`` (non-fused optimizers).
LossScaler packs the flag, the gradient statistics and the loss into one small tensor and reads it
in that same place, so the rule costs no extra sync there. Optimizers that unscale inside their own
kernel (``AdamW(fused=True)``) never sync in GradScaler; LossScaler then reads the packed tensor once
in ``update()``: one sync per step.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from autoscale.errors import ConfigError
from autoscale.scalers.grad_stats import (
    AbsMax,
    FlatAbs,
    grad_amax,
    nonfinite_flag,
    one_pass_grads,
    stack_on,
)
from autoscale.scalers.rule import (
    FP16_MAX,
    FP16_MIN_NORMAL,
    ScaleBounds,
    ScaleController,
    ScaleRule,
    StepStats,
    f32,
    positive_finite,
)

__all__ = ["LossScaler", "StepStats", "FP16_MAX", "FP16_MIN_NORMAL", "default_device", "f32"]

STATE_VERSION = 1


def default_device() -> str:
    """``"cuda"`` when a CUDA device is usable, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class LossScaler(torch.amp.GradScaler):
    """Every autoscale scaler: a GradScaler whose scale update is a rule's.

    Build one with :func:`autoscale.get_scaler`, which also finds exported policies; or directly
    from a rule object.

    Args:
        rule: The :class:`ScaleRule` deciding the scale (this scaler keeps and checkpoints it).
        device: ``"cuda"``, ``"cpu"``, ... Defaults to CUDA when present, else CPU. As with
            GradScaler, ``"cuda"`` without CUDA disables scaling with a warning.
        init_scale: Scale of the first step (clamped into ``[min_scale, max_scale]``); default:
            the rule's ``default_init_scale``.
        min_scale: Smallest scale the rule may set; never 0. Default: the rule's.
        max_scale: Largest scale the rule may set; never inf. Default: the rule's.
        raise_at_min: Raise :class:`~autoscale.errors.MinimumLossScaleError` on an overflow at the
            minimum scale that the rule would answer by lowering the scale, as DeepSpeed does
            ("Current loss scale already at minimum"; an overflow that hysteresis or a tolerance
            absorbs does not raise). Off by default: the event is counted in ``min_hits`` and
            training goes on with the step skipped.
        collect_stats: Compute gradient amax/RMS each step (two fused foreach reductions). Defaults
            to what the rule needs (``needs_stats``; a rule with ``needs_rms = False`` then skips
            the RMS pass). Passing or setting it True collects both.
        enabled: As in GradScaler.
        name: The name checkpoints and ``spec()`` carry (an exported policy's); default the rule's.
        process_group: Under ``torch.distributed``, the ranks that take one decision (default:
            the world group). Every rank of the group skips the same steps and keeps the same
            scale; the found-inf flag, the statistics the rule reads and the loss are agreed with
            one collective per optimizer step.
        identical_grads: The gradients are already identical on every rank (plain DDP averages
            them in backward): no collective at all, unless the rule reads the loss
            (``needs_loss``), which each rank computes on its own batch.

    Attributes:
        rule: The rule. controller: Its :class:`ScaleController` (bounds and counters).
        name: Registry name. last_stats: The last step's :class:`StepStats`.
        keep_grad_abs: On CPU, take the statistics from a copy of ``|g|`` kept for
            :meth:`grad_abs` (for an instrument that reads every gradient too, as
            :class:`~autoscale.training.TrainingRun` does); off by default, where reading each
            gradient in place is cheaper.
    """

    def __init__(
        self,
        rule: ScaleRule,
        device: str | None = None,
        *,
        init_scale: float | None = None,
        min_scale: float | None = None,
        max_scale: float | None = None,
        raise_at_min: bool = False,
        collect_stats: bool | None = None,
        enabled: bool = True,
        name: str | None = None,
        process_group: Any = None,
        identical_grads: bool = False,
    ) -> None:
        if not isinstance(rule, ScaleRule):
            raise ConfigError(
                f"LossScaler hosts a ScaleRule, got {type(rule).__name__}; build scalers with "
                "autoscale.get_scaler(NAME)"
            )
        device = device or default_device()
        bounds = ScaleBounds.of(
            rule.default_min_scale if min_scale is None else min_scale,
            rule.default_max_scale if max_scale is None else max_scale,
        )
        first = bounds.clamp(
            positive_finite(
                "init_scale", rule.default_init_scale if init_scale is None else init_scale
            )
        )
        knobs = rule.params()
        super().__init__(
            device,
            init_scale=first,
            growth_factor=float(knobs.get("growth_factor", 2.0)),
            backoff_factor=float(knobs.get("backoff_factor", 0.5)),
            growth_interval=int(knobs.get("growth_interval", 2000)),
            enabled=enabled,
        )
        self.rule = rule
        self.controller = ScaleController(rule, bounds, raise_at_min)
        self.name = name or rule.name
        self.init_scale = first  # as configured, for spec(): the rule moves the scale from here
        self.collect_stats = rule.needs_stats if collect_stats is None else bool(collect_stats)
        # a rule that reads only the amax skips the sum-of-squares pass unless asked for it
        self._collect_rms = self.collect_stats and (rule.needs_rms or collect_stats is True)
        self._host_scale = first if self._enabled else 1.0
        self.last_stats: StepStats | None = None
        self._last_stepped: list[dict[str, Any]] = []
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        # the rule whose per-step guard this scaler applies (None: its own; an environment that
        # drives a static scaler by another rule's decisions sets that rule here)
        self.guard_rule: ScaleRule | None = None
        self._guarded = False  # this step's guard ran: _scale holds the step's scale
        self._guard_scale: torch.Tensor | None = None  # that scale, float64, for 1/scale
        self._inv_cache: tuple[float, torch.Tensor] | None = None  # (host scale, 1/scale)
        self._inv_buf: torch.Tensor | None = None  # 1/scale of a guarded step
        self._abs_max = AbsMax()
        # keep_grad_abs: CPU statistics from |g| of each optimizer's gradients copied into a flat
        # buffer kept between steps, for an instrument that reads them too (grad_abs)
        self.keep_grad_abs = False
        self._flat: dict[int, FlatAbs] = {}
        if process_group is not None and not (
            dist.is_available() and isinstance(process_group, dist.ProcessGroup)
        ):
            raise ConfigError(
                f"process_group must be a torch.distributed ProcessGroup (from new_group), got "
                f"{type(process_group).__name__}; or leave it out for the world group"
            )
        self._process_group = process_group
        self.identical_grads = bool(identical_grads)
        self._checked = False  # the one-time handshake of the ranks
        self._observers: list[Any] = []
        if self._enabled:  # a policy takes its first decision now, as the env does at reset
            self._set_scale(self.controller.start(first))

    @property
    def collect_stats(self) -> bool:
        """Whether gradient statistics are computed each step; switching it on collects all."""
        return self._collect_stats

    @collect_stats.setter
    def collect_stats(self, value: bool) -> None:
        self._collect_stats = self._collect_rms = bool(value)

    # ------------------------------------------------------------------ what the controller keeps
    @property
    def device(self) -> str:
        """The device type of the scale tensor (``"cuda"``, ``"cpu"``, ...)."""
        return self._device

    @property
    def min_scale(self) -> float:
        return self.controller.bounds.min_scale

    @property
    def max_scale(self) -> float:
        return self.controller.bounds.max_scale

    @property
    def raise_at_min(self) -> bool:
        return self.controller.raise_at_min

    @raise_at_min.setter
    def raise_at_min(self, value: bool) -> None:
        self.controller.raise_at_min = bool(value)

    @property
    def steps(self) -> int:
        """Optimizer steps this scaler has seen (``update()`` calls that ran the rule)."""
        return self.controller.steps

    @property
    def skipped(self) -> int:
        """Steps skipped because a gradient was inf/NaN."""
        return self.controller.skipped

    @property
    def min_hits(self) -> int:
        """Overflows that happened at the minimum scale."""
        return self.controller.min_hits

    @property
    def hit_min(self) -> bool:
        """Whether an overflow ever happened at the minimum scale."""
        return self.controller.hit_min

    # GradScaler's getters and setters of growth_factor / backoff_factor / growth_interval act on
    # the rule's parameter of that name (the torch rule has all three, megatron's the factors
    # and interval); a rule without it has nothing to set.
    def get_growth_factor(self) -> float:
        return float(self.rule.params().get("growth_factor", self._growth_factor))

    def get_backoff_factor(self) -> float:
        return float(self.rule.params().get("backoff_factor", self._backoff_factor))

    def get_growth_interval(self) -> int:
        return int(self.rule.params().get("growth_interval", self._growth_interval))

    def set_growth_factor(self, new_factor: float) -> None:
        self._set_knob("growth_factor", float(new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        self._set_knob("backoff_factor", float(new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        self._set_knob("growth_interval", new_interval)

    def _set_knob(self, key: str, value: Any) -> None:
        params = self.rule.params()
        if key not in params:
            raise ConfigError(
                f"rule '{self.rule.name}' has no {key} (its parameters: {', '.join(params) or 'none'})"
            )
        checked = type(self.rule)(**{**params, key: value})  # the rule's own validation
        setattr(self.rule, key, getattr(checked, key))
        setattr(self, f"_{key}", getattr(checked, key))

    def spec(self) -> dict[str, Any]:
        """A dict that rebuilds this scaler: ``get_scaler(**spec)``."""
        return {
            "name": self.name,
            "init_scale": self.init_scale,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            **self.rule.params(),
        }

    # ------------------------------------------------------------------ GradScaler overrides
    def scale(self, outputs):  # noqa: D401 - same contract as GradScaler.scale
        """Multiply a loss (or tensors) by the current scale; also remembers the loss.

        With a rule that guards each step (``has_guard``), the first loss of a step may lower
        that step's scale (on the device, no host sync; the losses of later micro-batches take
        the same scale)."""
        if self._enabled and isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            # as few ops as possible on the hot path: float32 only when losses accumulate
            loss = outputs.detach()
            if loss.dim():
                loss = loss.reshape(())
            if self._loss_sum is None:
                self._loss_sum = loss
            else:
                self._loss_sum = self._loss_sum.float() + loss.float()
            self._loss_count += 1
            if not self._guarded:
                self._guard(loss)
            for obs in self._observers:
                obs.on_scale(self, loss)
        return super().scale(outputs)

    def _guard(self, loss: torch.Tensor) -> None:
        """Lower this step's scale to the rule's guard (see ScaleRule.guard_limit), on the device:
        the largest power of two S with S * |loss| <= limit where that is below the scale the
        rule set, never below the minimum; a non-finite loss keeps the set scale. Under
        torch.distributed the ranks agree on the largest |loss| first, so that they scale alike."""
        rule = self.guard_rule if self.guard_rule is not None else self.rule
        if not rule.has_guard:
            return
        limit = rule.guard_limit()
        if limit is None:
            return
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(loss.device)
        dev = self._scale.device
        group = self._group()
        if dev.type == "cpu" and loss.device.type == "cpu" and group is None:
            # on the CPU, reading the loss is no sync: the same float64 arithmetic on the host
            # (IEEE division, the C library's log2 as torch's scalar kernel calls it, an exact
            # power of two, the clamp) and one fill, instead of nine tensor ops
            self._scale.fill_(_guarded_scale(limit, float(loss), self.min_scale, self._host_scale))
            self._guard_scale = None
            self._guarded = True
            return
        exact = torch.float32 if dev.type == "mps" else torch.float64  # MPS has no float64
        g = loss.to(dev, exact, copy=True).abs_()  # a copy: every op below works in place
        if group is not None:  # a NaN on any rank: every rank keeps the set scale
            g = torch.nan_to_num(g, nan=math.inf)
            dist.all_reduce(g, op=dist.ReduceOp.MAX, group=group)
        # few ops, in place: this runs every step. A non-finite |loss| becomes 0, so the quotient
        # is inf and the clamp keeps the set scale; a zero loss gives inf too
        torch.div(limit, g.nan_to_num_(nan=0.0, posinf=0.0), out=g)
        g.log2_().floor_().exp2_().clamp_(min=self.min_scale, max=self._host_scale)
        self._scale.copy_(g)
        self._guard_scale = g  # the same value (a power of two or a bound: float32 holds it)
        self._guarded = True

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        grads = self._one_pass_grads(optimizer) if self._enabled else None
        if grads is not None:
            self._unscale_with_amax(optimizer, grads)
        else:
            super().unscale_(optimizer)
            if self._enabled and self.collect_stats:
                self._collect_grad_stats(optimizer, inv_scale=None)
        if self._enabled and getattr(optimizer, "_step_supports_amp_scaling", False):
            # a fused optimizer skips inside its kernel from the found-inf flag: agree on it
            # before that kernel runs (on the device: no host sync)
            self._agree(self._per_optimizer_states[id(optimizer)])

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # The fused-optimizer path checks for infs without unscaling: statistics need 1/scale.
        state = self._per_optimizer_states[id(optimizer)]
        if self.collect_stats:
            self._found_inf_from_amax(optimizer)
        else:
            super()._check_inf_per_device(optimizer)
        self._agree(state)
        return state["found_inf_per_device"]

    def _found_inf_from_amax(self, optimizer: torch.optim.Optimizer) -> None:
        """Derive found-inf from the gradient amax the rule reads anyway (fused-optimizer path).

        The amax is non-finite exactly when some gradient element is (NaN and inf propagate
        through it), so GradScaler's separate found-inf pass over every gradient is skipped. The
        flag lives on the scale's device, where GradScaler's fused path gathers it anyway.
        """
        # a guarded step's scale is on the device only
        inv = self._inv_scale() if self._guarded else 1.0 / self._host_scale
        state = self._per_optimizer_states[id(optimizer)]
        grads = self._one_pass_grads(optimizer)
        if grads is None:
            self._collect_grad_stats(optimizer, inv_scale=inv)
            amax = state["autoscale_stats"][0]
        else:  # the amax alone: no statistics vector to build
            dev = self._scale.device
            with torch.no_grad():
                amax = self._abs_max(grads, dev) * inv
            for obs in self._observers:
                obs.on_grads(self, optimizer, grads, inv)
            state["autoscale_stats"] = amax
        state["found_inf_per_device"] = {self._scale.device: nonfinite_flag(amax)}

    def _one_pass_grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor] | None:
        """The gradients when this step's statistics are the amax alone and they allow reading it
        in the one pass that also finds infs (see :func:`one_pass_grads`); else None."""
        if not self._collect_stats or self._collect_rms or self.keep_grad_abs:
            return None
        self._check_scale_growth_tracker("unscale_")
        if self._group() is not None:  # statistics agreed across ranks: the general layout
            return None
        return one_pass_grads(optimizer, self._scale.device)

    def _unscale_with_amax(
        self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]
    ) -> None:
        """GradScaler's ``unscale_`` with the amax read in the same place: one read of the scaled
        gradients gives the amax, whose finiteness is the found-inf flag, then one multiply by
        1/scale unscales them (GradScaler's kernel multiplies while it checks, and the amax was a
        second read of every gradient). Same gradients, flag and amax, bit for bit."""
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv = self._inv_scale()
        with torch.no_grad():
            amax = self._abs_max(grads, self._scale.device)  # of the scaled gradients
            state["found_inf_per_device"] = {self._scale.device: nonfinite_flag(amax)}
            torch._foreach_mul_(grads, inv)
            state["autoscale_stats"] = amax * inv  # monotonic rounding: the unscaled amax
        for obs in self._observers:
            obs.on_grads(self, optimizer, grads, None)
        state["stage"] = OptState.UNSCALED

    def _inv_scale(self) -> torch.Tensor:
        """1/scale of this step as GradScaler's ``unscale_`` computes it (the reciprocal in
        float64, rounded to float32; in float32 on MPS), in fewer ops: one from the guard's
        scale where it ran, else none while the host scale stays (a tensor kept for it). Valid
        until the next step's: read it within the step."""
        dev = self._scale.device
        host = self._host_scale
        if self._guarded and self._guard_scale is None and dev.type == "cpu":
            host = float(self._scale)  # the guard's scale, set on the host (no sync on a CPU)
        elif self._guarded or dev.type == "mps":
            g = self._guard_scale if self._guarded else None
            if g is None:
                g = self._scale if dev.type == "mps" else self._scale.double()
            buf = self._inv_buf
            if buf is None or buf.device != dev:
                buf = self._inv_buf = torch.empty((), device=dev)
            return torch.reciprocal(g, out=buf)  # computed in g's dtype, rounded on the way out
        cached = self._inv_cache
        if cached is None or cached[0] != host or cached[1].device != dev:
            inv = torch.full((), f32(1.0 / host), device=dev)
            cached = self._inv_cache = (host, inv)
        return cached[1]

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        self._agree(optimizer_state)
        self._read([optimizer_state])
        if not optimizer_state["autoscale_host"][0]:
            return optimizer.step(*args, **kwargs)
        return None

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Set the next scale: from ``new_scale`` if given, else from the rule."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("update")
        bounds = self.controller.bounds
        if new_scale is not None:
            value = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
            self._set_scale(bounds.clamp(value))
            self._end_step()
            return
        states = list(self._per_optimizer_states.values())
        states = [s for s in states if s["found_inf_per_device"]]
        if not states:
            raise AssertionError("No inf checks were recorded prior to update.")
        if self._loss_sum is not None and all("autoscale_vec" in s for s in states):
            # a loss scaled after the last optimizer step agreed its flags: one more agreement
            states.append(_refresh_per_optimizer_state())
        for state in states:
            self._agree(state)
        self._read(states)
        host = [s["autoscale_host"] for s in states]
        used = next((s["autoscale_used"] for s in states if "autoscale_used" in s), None)
        found = any(h[0] for h in host)
        amax = max((h[1] for h in host), default=math.nan)
        sumsq = sum(h[2] for h in host)
        count = sum(h[3] for h in host)
        loss_count = sum(h[5] for h in host)
        loss = sum(h[4] for h in host) / loss_count if loss_count else None
        if not self.collect_stats:
            amax = rms = math.nan
        elif not self._collect_rms:
            rms = math.nan
        else:
            rms = (
                math.sqrt(sumsq / count)
                if count > 0 and math.isfinite(sumsq)
                else (math.inf if count else math.nan)
            )
        stats = StepStats(
            self.steps,
            self._host_scale if used is None else used,
            bool(found),
            amax,
            rms,
            math.nan if loss is None else loss,
            loss is not None,
            used is not None and used < self._host_scale,
        )
        self.last_stats = stats
        if used == self._host_scale:  # the guard kept the set scale: no fill if the rule does too
            self._guarded = False
        try:
            self._set_scale(self.controller.step(stats))
        finally:
            self._end_step()
        for obs in self._observers:
            obs.on_update(self, stats)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` skipped the optimizer update (a gradient was inf/NaN).

        GradScaler has no such question (torch issue 67590); keep a learning-rate scheduler
        from advancing on a skipped step with it::

            scaler.step(optimizer)
            scaler.update()
            if not scaler.step_was_skipped:
                scheduler.step()

        Valid after ``step()`` (before or after ``update()``, also ``update(new_scale)``), for
        plain optimizers, which ``step()`` does not call on such a step, and fused ones
        (``AdamW(fused=True)``), whose kernel skips it from the same found-inf flag; with several
        optimizers, True when any of them skipped. On a fused optimizer read before
        ``update()``, it brings forward the one host sync ``update()`` makes. False before the
        first step and when scaling is disabled.
        """
        if not self._enabled:
            return False
        states = [
            s for s in self._per_optimizer_states.values() if s["stage"] is OptState.STEPPED
        ] or self._last_stepped
        if not states:
            return False
        self._read(states)  # no-op when step() or update() read the flags already
        return any(s["autoscale_host"][0] for s in states)

    def add_observer(self, observer: Any) -> None:
        """Call ``observer`` at each step, as :class:`autoscale.observe.StepObserver` describes:
        ``on_scale(scaler, loss)`` when a loss is scaled, ``on_grads(scaler, optimizer, grads,
        inv_scale)`` when the gradients are read for the statistics (unscaled when ``inv_scale``
        is None, else scaled by ``1 / inv_scale``), ``on_update(scaler, stats)`` after the rule
        set the next scale. Observers read; they never change the step. Switches the gradient
        amax on (an observer reads it); the RMS pass stays as the rule wants it."""
        self._collect_stats = True
        self._observers.append(observer)

    def remove_observer(self, observer: Any) -> None:
        """Stop calling ``observer`` (see :meth:`add_observer`)."""
        self._observers = [o for o in self._observers if o is not observer]

    def set_scale(self, value: float) -> None:
        """Set the scale of the next step (clamped to ``[min_scale, max_scale]``), between steps.

        Used by controllers outside the rule, such as the environment that lets an agent choose.
        """
        if self._enabled:
            self._set_scale(self.controller.bounds.clamp(float(value)))

    def get_scale(self) -> float:
        """The current scale as a Python float (no device sync: autoscale keeps a host copy)."""
        return self._host_scale if self._enabled else 1.0

    def state_dict(self) -> dict[str, Any]:
        """Primitive-only state (loads under ``torch.load(weights_only=True)``).

        Keeps GradScaler's keys, so tools that read ``state["scale"]`` (and a plain GradScaler)
        still work, and adds an ``"autoscale"`` entry with the rule's name, bounds, counters and
        state.
        """
        if not self._enabled:
            return {}
        state = self.rule.state()
        return {
            "scale": self._host_scale,
            "growth_factor": self.get_growth_factor(),
            "backoff_factor": self.get_backoff_factor(),
            "growth_interval": self.get_growth_interval(),
            "_growth_tracker": int(state.get("growth_tracker", 0)),
            "autoscale": {
                "version": STATE_VERSION,
                "rule": self.name,
                "min_scale": self.min_scale,
                "max_scale": self.max_scale,
                **self.controller.counters(),
                "rule_state": state,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a plain GradScaler state restores the scale and tracker.

        The loaded scale is clamped into this scaler's bounds (its own ``min_scale`` and
        ``max_scale`` are kept: they are configuration, not state); bounds that differ from the
        checkpoint's, or a scale that had to be clamped, are warned about.

        Raises:
            ConfigError: a state of another rule, of a newer autoscale, or with a missing or
                malformed entry (named in the message).
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, dict):
            raise ConfigError(
                f"scaler state must be a mapping (a state_dict()), got {type(state_dict).__name__}"
            )
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        scale = state_dict.get("scale")
        scale = scale.item() if isinstance(scale, torch.Tensor) else scale
        try:
            scale = positive_finite("scale", scale)
        except ConfigError:
            raise ConfigError(
                f"scaler state has scale {scale!r}, not a positive finite number; the checkpoint "
                "is corrupt or was saved after the scale reached 0 or inf"
            ) from None
        ours = state_dict.get("autoscale")
        if ours is None:  # a plain GradScaler's state
            tracker = state_dict.get("_growth_tracker", 0)
            tracker = tracker.item() if isinstance(tracker, torch.Tensor) else tracker
            self.rule.load_state({"growth_tracker": int(tracker)})
        else:
            self._load_ours(ours)
        bounds = self.controller.bounds
        if bounds.clamp(scale) != f32(scale):
            warnings.warn(
                f"checkpoint scale {scale:g} lies outside this scaler's [{bounds.min_scale:g}, "
                f"{bounds.max_scale:g}]; continuing from {bounds.clamp(scale):g}",
                stacklevel=2,
            )
        self._set_scale(bounds.clamp(scale))

    def _load_ours(self, ours: Any) -> None:
        if not isinstance(ours, dict):
            raise ConfigError(
                "scaler state's 'autoscale' entry must be a mapping; the checkpoint is corrupt"
            )
        version = ours.get("version", STATE_VERSION)
        if not isinstance(version, int) or version > STATE_VERSION:
            raise ConfigError(
                f"scaler state has format {version!r}, this autoscale reads up to {STATE_VERSION}; "
                "upgrade autoscale to load it"
            )
        if ours.get("rule") != self.name:
            raise ConfigError(
                f"scaler state was saved by rule '{ours.get('rule')}', not '{self.name}'; "
                f"load it with get_scaler('{ours.get('rule')}')"
            )
        missing = [k for k in ("steps", "skipped", "min_hits", "rule_state") if k not in ours]
        if missing:
            raise ConfigError(
                f"scaler state of rule '{self.name}' lacks {missing}; the checkpoint is corrupt"
            )
        counters = {k: ours[k] for k in ("steps", "skipped", "min_hits")}
        bad = {
            k: v
            for k, v in counters.items()
            if isinstance(v, bool) or not isinstance(v, int) or v < 0
        }
        if bad:
            raise ConfigError(
                f"scaler state of rule '{self.name}' has counters {bad}, not integers >= 0; the "
                "checkpoint is corrupt"
            )
        self.rule.load_state(ours["rule_state"])
        self.controller.load_counters(counters)
        for buf in self._flat.values():  # its step number may come back: not these gradients
            buf.forget()
        saved = (ours.get("min_scale"), ours.get("max_scale"))
        if saved != (None, None) and saved != (self.min_scale, self.max_scale):
            warnings.warn(
                f"checkpoint of rule '{self.name}' was saved with scale bounds {saved}; this scaler "
                f"keeps its own ({self.min_scale:g}, {self.max_scale:g})",
                stacklevel=3,
            )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_loss_sum"] = None
        state["_last_stepped"] = []
        state["_flat"] = {}  # gradient-sized buffers keyed by optimizers of this process
        state["_observers"] = []  # recorders and loggers hold files of this process
        state["_guard_scale"] = state["_inv_cache"] = state["_inv_buf"] = None
        state["_abs_max"] = AbsMax()
        return state

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.rule.params().items())
        return f"{type(self).__name__}(name={self.name!r}, scale={self._host_scale:g}{', ' if params else ''}{params})"

    # ------------------------------------------------------------------ internals
    def _set_scale(self, value: float) -> None:
        if self._scale is None:
            self._init_scale = value
        elif value != self._host_scale or self._guarded:  # most steps keep it: no op then
            self._scale.fill_(value)
        self._host_scale = value
        self._guard_scale = None  # no longer this step's scale

    def _end_step(self) -> None:
        # step_was_skipped answers for these until the next step()
        self._last_stepped = [
            s for s in self._per_optimizer_states.values() if s["stage"] is OptState.STEPPED
        ]
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._loss_sum = None
        self._loss_count = 0
        self._guarded = False
        self._guard_scale = None
        for buf in self._flat.values():  # grad_abs answers for the step that filled it only
            buf.forget()

    def _collect_grad_stats(
        self, optimizer: torch.optim.Optimizer, inv_scale: float | None
    ) -> None:
        grads = [
            p.grad._values() if p.grad.is_sparse else p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None and p.grad.numel()
        ]
        state = self._per_optimizer_states[id(optimizer)]
        dev = self._scale.device
        for obs in self._observers:
            obs.on_grads(self, optimizer, grads, inv_scale)
        if not grads:
            state["autoscale_stats"] = torch.zeros(3, device=dev)
            return
        with torch.no_grad():
            flat = None
            if (
                self.keep_grad_abs
                and dev.type == "cpu"
                and all(g.device.type == "cpu" for g in grads)
            ):
                # The copy an instrument reads anyway (grad_abs), then one max and one dot over it.
                # Without such a reader the per-tensor path below is cheaper: aminmax reads each
                # gradient once and writes nothing (on an MLP of 1M parameters the copy, abs and
                # max cost amax-history 1.09x GradScaler's step, aminmax 1.04x).
                buf = self._flat.get(id(optimizer))
                if buf is None:
                    buf = self._flat[id(optimizer)] = FlatAbs()
                flat = buf.load(grads, unscaled=inv_scale is None, step=self.steps)
                amax = flat.max()
                sumsq = torch.dot(flat, flat) if self._collect_rms else None
            else:
                amax = grad_amax(grads, dev)
                sumsq = None
                if self._collect_rms:
                    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
                    sumsq = stack_on(norms, dev).square().sum()
            if sumsq is None:
                sumsq = torch.full((), math.nan, device=dev)
            if inv_scale is not None:
                amax, sumsq = amax * inv_scale, sumsq * (inv_scale * inv_scale)
            elif (
                flat is not None
                and self._collect_rms
                and not any(
                    p.grad.is_sparse
                    for group in optimizer.param_groups
                    for p in group["params"]
                    if p.grad is not None
                )
            ):  # (an uncoalesced sparse gradient's values repeat indices: no norm of it here)
                # the 2-norm of the unscaled gradients, for a caller that clips (grad_norm)
                state["autoscale_norm"] = (self.steps, sumsq)
            # torch.full, not torch.tensor: no host-to-device copy (a stream sync on CUDA)
            count = torch.full((), float(sum(g.numel() for g in grads)), device=dev)
            state["autoscale_stats"] = torch.stack([amax, sumsq, count])

    def grad_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The 2-norm of ``optimizer``'s unscaled gradients (a float32 device tensor, no host
        sync) where this step's statistics computed it from the ``grad_abs`` copy; else None.
        For a caller that clips, instead of a second pass over every gradient."""
        state = self._per_optimizer_states.get(id(optimizer))  # get: adds no state
        entry = state.get("autoscale_norm") if state is not None else None
        return entry[1].sqrt() if entry is not None and entry[0] == self.steps else None

    def grad_abs(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """``|g|`` of ``optimizer``'s unscaled gradients, flat (float32), if this step's statistics
        put them in a buffer (on CPU, after ``unscale_``, with ``keep_grad_abs`` set); else None.
        Valid until the next step's ``unscale_``; for instruments that would otherwise copy the
        gradients once more."""
        buf = self._flat.get(id(optimizer))
        return buf.current(self.steps) if buf is not None else None

    # ------------------------------------------------------------------ agreement across ranks
    def _group(self) -> Any:
        """The process group decisions are agreed over, or None when there is nothing to agree
        (not distributed, one rank)."""
        if not (dist.is_available() and dist.is_initialized()):
            if self._process_group is not None:
                raise ConfigError(
                    "process_group was given but torch.distributed is not initialized; call "
                    "torch.distributed.init_process_group first, or drop process_group"
                )
            return None
        group = self._process_group or dist.group.WORLD
        if not self._checked:
            self._handshake(group)
        if dist.get_world_size(group) <= 1 or (self.identical_grads and not self.rule.needs_loss):
            return None
        return group

    def _handshake(self, group: Any) -> None:
        """Once, over every rank: check that this rank is in its group and that the ranks of a
        group agree on it (its size, and whether gradients are identical); else every rank raises
        the same error instead of hanging in a collective the others never join."""
        self._checked = True
        world, rank = dist.get_world_size(), dist.get_rank()
        size = dist.get_world_size(group)
        member = dist.get_rank(group) >= 0 if group is not dist.group.WORLD else True
        ranks = dist.get_process_group_ranks(group) if member else []
        key = float(sum((r + 1) * 7919**i for i, r in enumerate(ranks)) % 2**40)
        dev = self._scale.device
        mine = torch.tensor(
            [float(member), float(size), key, float(self.identical_grads)], device=dev
        )
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        rows = [t.tolist() for t in gathered]
        if not member:
            raise ConfigError(
                f"rank {rank} is not a member of the process_group given to its scaler; give each "
                "rank a group it belongs to (or none: the world group)"
            )
        peers = [r for r in range(world) if rows[r][2] == key]
        if len(peers) != size:
            raise ConfigError(
                f"the ranks of rank {rank}'s process group ({len(ranks)} ranks: {ranks}) do not all "
                f"use that group for their scaler ({len(peers)} do); every rank of a group must pass "
                "the same process_group"
            )
        flags = {rows[r][3] for r in peers}
        if len(flags) > 1:
            raise ConfigError(
                f"the ranks of process group {ranks} disagree on identical_grads; pass the same value "
                "on every rank (True only where DDP has already averaged the gradients)"
            )

    def _agree(self, state: dict[str, Any]) -> None:
        """Pack this optimizer's found-inf flag, gradient statistics and the losses scaled since
        the last agreement into one vector on the scale's device, agreed across ranks with one
        collective where there is anything to agree; no host sync."""
        if "autoscale_vec" in state:
            return
        dev = self._scale.device
        per_device = list(state["found_inf_per_device"].values())
        if len(per_device) == 1 and per_device[0].device == dev:
            flag = per_device[0]
        elif per_device:
            # a copy to the host must block: a non-blocking one would be read (tolist) before
            # it lands; device-bound copies may overlap
            flag = sum(t.to(dev, non_blocking=dev.type != "cpu") for t in per_device)
        else:  # a loss scaled after every optimizer's agreement: no flag of its own
            flag = torch.zeros((), device=dev)
        loss, n_loss = self._loss_sum, self._loss_count
        self._loss_sum, self._loss_count = None, 0
        stats = state.get("autoscale_stats") if self.collect_stats else None
        group = self._group()
        guarded = self._guarded  # the step's own scale travels with the flag (last element)
        if group is None:  # as few ops as possible: this runs every step
            parts = [flag] + ([] if stats is None else [stats])
            if loss is not None:
                parts.append(loss.to(dev).float())
            if guarded:
                parts.append(self._scale)
            # statistics: none, the amax alone (0-dim, one stack) or [amax, sumsq, count]
            vec = (
                torch.stack(parts)
                if stats is None or stats.dim() == 0
                else torch.cat([p.reshape(-1) for p in parts])
            )
            state["autoscale_vec"] = vec
            state["autoscale_layout"] = (
                0 if stats is None else stats.numel(),
                n_loss if loss is not None else 0,
                False,
                guarded,
            )
            return
        if stats is None:
            stats = torch.full((3,), math.nan, device=dev)
        total = torch.zeros((), device=dev) if loss is None else loss.to(dev).float()
        local = torch.cat(
            [flag.reshape(1), stats, total.reshape(1), torch.full((1,), float(n_loss), device=dev)]
            + ([self._scale.reshape(1)] if guarded else [])
        )
        # every rank takes the same decision: found-inf and amax by MAX (a NaN amax, from the
        # gradients of an overflowing rank, counts as inf), the rest by SUM; one all_gather
        # carries both, reduced here
        local[1] = torch.where(torch.isnan(local[1]), math.inf, local[1])
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, local, group=group)
        table = torch.stack(rows)
        # (a guarded step's scale, last, is the same on every rank: the loss was agreed)
        vec = torch.cat(
            [table[:, :2].amax(0), table[:, 2:6].sum(0)]
            + ([table[:, 6:].amax(0)] if guarded else [])
        )
        state["autoscale_vec"] = vec
        state["autoscale_layout"] = (3, -1, True, guarded)
        if state["found_inf_per_device"]:  # what GradScaler and fused kernels read: the agreed flag
            state["found_inf_per_device"] = {dev: vec[0].clone()}

    def _read(self, states: list[dict[str, Any]]) -> None:
        """Bring the agreed vectors of these states to the host in one sync, as
        ``(found, amax, sumsq, count, loss_sum, loss_count)``."""
        todo = [s for s in states if "autoscale_host" not in s]
        if not todo:
            return
        vecs = [s["autoscale_vec"] for s in todo]
        flat = (vecs[0] if len(vecs) == 1 else torch.cat([v.reshape(-1) for v in vecs])).tolist()
        i = 0
        for s, v in zip(todo, vecs):
            n = v.numel()
            row, i = flat[i : i + n], i + n
            with_stats, n_loss, distributed, guarded = s["autoscale_layout"]  # with_stats: 0, 1, 3
            if guarded:
                s["autoscale_used"], row = row[-1], row[:-1]
            if distributed:  # [found, amax, sumsq, count, loss_sum, loss_count], all ranks
                s["autoscale_host"] = (row[0] > 0, row[1], row[2], row[3], row[4], row[5])
                continue
            found = row[0] > 0
            amax, sumsq, count = (
                (row[1], row[2], row[3])
                if with_stats == 3
                else (row[1] if with_stats else math.nan, math.nan, 0.0)
            )
            loss_sum = row[-1] if n_loss else 0.0
            s["autoscale_host"] = (found, amax, sumsq, count, loss_sum, float(n_loss))


def _guarded_scale(limit: float, loss: float, min_scale: float, max_scale: float) -> float:
    """The guard's scale from a host loss, as the device ops compute it: a non-finite or zero
    |loss| keeps ``max_scale`` (the set scale); else the largest power of two S with
    S * |loss| <= limit, clamped to [min_scale, max_scale]."""
    m = abs(loss)
    q = limit / m if (0.0 < m < math.inf) else math.inf
    if q < math.inf:
        q = 2.0 ** math.floor(math.log2(q)) if q > 0.0 else 0.0
    return min(max(q, min_scale), max_scale)
