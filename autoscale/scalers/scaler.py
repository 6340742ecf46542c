"""`LossScaler`: a `torch.amp.GradScaler` that hosts a :class:`~autoscale.scalers.controller.ScaleRule`.

The parent's ``scale``/``unscale_``/``step`` are kept, so fused optimizers, clipping after
``unscale_`` and every framework that drives a GradScaler keep working. The rest is delegated:
reading gradients (:mod:`~autoscale.scalers.grad_reader`), the loss guard
(:mod:`~autoscale.scalers.loss_guard`), agreement across ranks (:mod:`~autoscale.scalers.ranks`),
the packed step (:mod:`~autoscale.scalers.step_vector`), checkpoints
(:mod:`~autoscale.scalers.checkpoint`) and the decision (the rule, through a
:class:`~autoscale.scalers.controller.ScaleController`). Only this module touches GradScaler's
private members.

Host syncs: one per step, where GradScaler has its own (the found-inf flag in ``step()``), which
also carries the statistics and the loss; with a fused optimizer (no sync in GradScaler), one in
``update()``. On a CPU, where a read is no sync and every small tensor op costs microseconds, the
same values are read one by one instead of packed (:meth:`LossScaler._read_on_host`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from autoscale.errors import ConfigError
from autoscale.scalers import step_vector as sv
from autoscale.scalers.checkpoint import read_state, rule_for, write_state
from autoscale.scalers.controller import (
    ScaleBounds,
    ScaleController,
    ScaleRule,
    StepStats,
    positive_finite,
)
from autoscale.scalers.grad_reader import GradReader
from autoscale.scalers.grad_stats import one_pass_grads
from autoscale.scalers.loss_guard import apply_guard, apply_step_scale, guard_on_host, guards
from autoscale.scalers.ranks import RankAgreement
from autoscale.scalers.unscale import InverseScale

__all__ = ["LossScaler", "default_device"]

# called with each LossScaler built (``autoscale wrap`` observes the ones a program builds itself)
BUILT_HOOKS: list[Any] = []


def _of_controller(name: str, doc: str, bounds: bool = False) -> property:
    """A read-only property of the scaler answered by its controller (or its bounds)."""
    if bounds:
        return property(lambda self: getattr(self.controller.bounds, name), doc=doc)
    return property(lambda self: getattr(self.controller, name), doc=doc)


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
            minimum that the rule answers by lowering the scale, as DeepSpeed does. Off by
            default: counted in ``min_hits``, the step skipped, training goes on.
        collect_stats: Compute gradient amax/RMS each step. Default: what the rule needs
            (``needs_stats``, ``needs_rms``). Passing or setting it True collects both.
        enabled: As in GradScaler.
        name: The name checkpoints and ``spec()`` carry (an exported policy's); default the rule's.
        process_group: Under ``torch.distributed``, the ranks that take one decision (default:
            the world group): they skip the same steps and keep the same scale, agreed with one
            collective per optimizer step.
        identical_grads: The gradients are already identical on every rank (DDP averaged them):
            no collective, unless the rule reads the loss (``needs_loss``).

    Attributes:
        rule: The rule. controller: Its :class:`ScaleController` (bounds and counters).
        name: Registry name. last_stats: The last step's :class:`StepStats`.
        grads: Its :class:`~autoscale.scalers.grad_reader.GradReader` (how it reads gradients;
            an instrument that reads every gradient too may have it keep a copy of ``|g|``).
    """

    # (class defaults: a scaler pickled before these existed loads, on the general path)
    _cpu = False  # the scale tensor is on a CPU, where reads are no syncs (set when made)
    _step_scale: float | None = None
    _step_group: tuple[Any] | None = None
    # this step's spike test (ScaleRule.spike_limit), made at its first agreement: None before
    # it, a bool where it ran on the host, a bool tensor on the device
    _spike: bool | torch.Tensor | None = None
    # GradScaler's own scale(), unscale_() and _unscale_grads_() come next in the class order:
    # their product, 1/scale and the sort of the gradients are done here, in fewer ops (set for
    # each subclass: __init_subclass__)
    _plain_gradscaler = True
    # the scale tensor as this scaler last left it holding _host_scale, and its version: code
    # that writes GradScaler's `_scale` itself shows as another tensor or version (_adopt_written)
    _synced: tuple[torch.Tensor, int] | None = None
    # the scale tensor and its version as this step's guard left it (None: no guard this step)
    _guard_wrote: tuple[torch.Tensor, int] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        later = cls.__mro__[cls.__mro__.index(LossScaler) + 1 :]
        gradscaler = LossScaler.__bases__[0]  # (torch.amp.GradScaler, which `wrap` replaces)
        cls._plain_gradscaler = all(
            next((c.__dict__[m] for c in later if m in c.__dict__), None) is gradscaler.__dict__[m]
            for m in ("scale", "unscale_", "_unscale_grads_")
        )

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
        self.grads = GradReader()
        self.collect_stats = rule.needs_stats if collect_stats is None else bool(collect_stats)
        # a rule that reads only the amax skips the sum-of-squares pass unless asked for it
        self.grads.rms = self.collect_stats and (rule.needs_rms or collect_stats is True)
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
        self._step_scale = None  # that scale on the host, once read
        self._inverse = InverseScale()
        self._ranks = RankAgreement(process_group, identical_grads)
        self._step_group = None  # (this step's process group,) once looked up
        self._observers: list[Any] = []
        if self._enabled:  # a policy takes its first decision now, as the env does at reset
            self._set_scale(self.controller.start(first))
        for hook in BUILT_HOOKS:
            hook(self)

    @property
    def collect_stats(self) -> bool:
        """Whether gradient statistics are computed each step; switching it on collects all."""
        return self._collect_stats

    @collect_stats.setter
    def collect_stats(self, value: bool) -> None:
        self._collect_stats = self.grads.rms = bool(value)

    # ------------------------------------------------------------------ what the controller keeps
    @property
    def device(self) -> str:
        """The device type of the scale tensor (``"cuda"``, ``"cpu"``, ...)."""
        return self._device

    min_scale = _of_controller("min_scale", "Smallest scale the rule may set.", bounds=True)
    max_scale = _of_controller("max_scale", "Largest scale the rule may set.", bounds=True)
    steps = _of_controller("steps", "Optimizer steps seen (``update()`` calls that ran the rule).")
    skipped = _of_controller("skipped", "Steps skipped because a gradient was inf/NaN.")
    min_hits = _of_controller("min_hits", "Overflows that happened at the minimum scale.")
    hit_min = _of_controller("hit_min", "Whether an overflow ever happened at the minimum scale.")

    @property
    def raise_at_min(self) -> bool:
        """Raise on an overflow at the minimum that the rule answers by lowering the scale."""
        return self.controller.raise_at_min

    @raise_at_min.setter
    def raise_at_min(self, value: bool) -> None:
        self.controller.raise_at_min = bool(value)

    # GradScaler's getters and setters of growth_factor / backoff_factor / growth_interval act on
    # the rule's parameter of that name (the torch rule has all three, megatron's the factors
    # and interval); a rule without it has nothing to set.
    def get_growth_factor(self) -> float:
        return float(self.controller.knob("growth_factor", self._growth_factor))

    def get_backoff_factor(self) -> float:
        return float(self.controller.knob("backoff_factor", self._backoff_factor))

    def get_growth_interval(self) -> int:
        return int(self.controller.knob("growth_interval", self._growth_interval))

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = self.controller.set_knob("growth_factor", float(new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = self.controller.set_knob("backoff_factor", float(new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = self.controller.set_knob("growth_interval", new_interval)

    def spec(self) -> dict[str, Any]:
        """A dict that rebuilds this scaler: ``get_scaler(**spec)``."""
        bounds = {"min_scale": self.min_scale, "max_scale": self.max_scale}
        return {"name": self.name, "init_scale": self.init_scale, **bounds, **self.rule.params()}

    # ------------------------------------------------------------------ GradScaler overrides
    def scale(self, outputs):  # noqa: D401 - same contract as GradScaler.scale
        """Multiply a loss (or tensors) by the current scale; also remembers the loss.

        With a rule that guards each step (``has_guard``), the first loss of a step may lower
        that step's scale (on the device, no host sync; the losses of later micro-batches take
        the same scale)."""
        if self._enabled and isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            if not self._guarded:
                self._adopt_written()
            # as few ops as possible on the hot path: float32 only when losses accumulate
            loss = outputs.detach()
            if loss.dim():
                loss = loss.reshape(())
            if self._loss_sum is None:
                self._loss_sum = loss
            else:
                self._loss_sum = self._loss_sum.float() + loss.float()
            self._loss_count += 1
            rule = self.guard_rule if self.guard_rule is not None else self.rule
            if rule.has_guard and not self._guarded:  # (scale_time comes with has_guard)
                self._guard(loss, rule)
            for obs in self._observers:
                obs.on_scale(self, loss)
            if self._plain_gradscaler:
                scale = self._scale
                if scale is None:
                    self._lazy_init_scale_growth_tracker(outputs.device)
                    scale = self._scale
                if scale.device == outputs.device:  # GradScaler's product, without a no-op .to
                    return outputs * scale
        return super().scale(outputs)

    def _guard(self, loss: torch.Tensor, rule: ScaleRule) -> None:
        """Lower this step's scale to ``rule``'s guard (see ScaleRule.guard_limit), on the
        device: :func:`~autoscale.scalers.loss_guard.apply_guard` (on a CPU with nothing to
        agree, its host form, whose value is then known); or let a rule that acts at scale time
        set it from the loss (``scale_time``)."""
        if rule.scale_time:
            limit = None
        else:
            limit = rule.guard_limit()
            if not guards(limit):
                return
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(loss.device)
        scale, group, bounds = self._scale, self._group(), self.controller.bounds
        self._guarded = True
        if limit is not None and self._cpu and group is None and loss.is_cpu:
            self._guard_scale = None
            self._step_scale = guard_on_host(scale, loss, limit, bounds.min_scale, self._host_scale)
        else:
            self._guard_scale = (
                apply_step_scale(rule, scale, loss, bounds, self._host_scale, group)
                if rule.scale_time
                else apply_guard(scale, loss, limit, bounds.min_scale, self._host_scale, group)
            )
            # set on the host of a CPU (no tensor returned): read once, for get_scale and 1/scale
            self._step_scale = scale.item() if self._guard_scale is None and self._cpu else None
        self._guard_wrote = (scale, scale._version)  # a later write is other code's

    def _spike_limit(self) -> float | None:
        """The ``|loss|`` above which this step is a spike to skip (the rule's
        :meth:`~autoscale.scalers.controller.ScaleRule.spike_limit`), or None."""
        rule = self.guard_rule if self.guard_rule is not None else self.rule
        return None if rule.scale_time else rule.spike_limit()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        grads = self._one_pass_grads(optimizer) if self._enabled and self._collect_stats else None
        if grads is not None:
            self._unscale_with_amax(optimizer, grads)
        else:
            scale = self._scale if self._enabled and self._plain_gradscaler else None
            if scale is not None and (self._cpu or scale.device.type != "mps"):
                self._unscale(optimizer)
            else:
                super().unscale_(optimizer)
            if self._enabled and self._collect_stats:
                self._collect_grad_stats(optimizer, inv_scale=None)
        if self._enabled and getattr(optimizer, "_step_supports_amp_scaling", False):
            # a fused optimizer skips inside its kernel from the found-inf flag: agree on it
            # before that kernel runs (on the device: no host sync)
            self._agree(self._per_optimizer_states[id(optimizer)])

    def _unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """GradScaler's ``unscale_`` with 1/scale from :meth:`_inv_scale` (the same float32
        value, computed once for a scale instead of three ops a step); dense float32 gradients
        on the scale's device go straight to its kernel (:meth:`GradReader.unscale_plain`), any
        others through GradScaler's ``_unscale_grads_`` (its errors, sparse gradients, dtypes,
        devices, DTensors; and a replaced ``GradScaler._unscale_grads_``)."""
        state = self._unscale_state(optimizer)
        dev = self._scale.device
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=dev)
        inv = self._inv_scale()
        # (a GradScaler whose sort another library replaced, as extensions for other devices
        # do, keeps it)
        grads = one_pass_grads(optimizer, dev) if type(self)._unscale_grads_ is _SORT else None
        if grads is None:
            state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv, found_inf, False)
        else:
            self.grads.unscale_plain(grads, inv, found_inf)
            state["found_inf_per_device"] = {dev: found_inf}
        state["stage"] = OptState.UNSCALED

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
        """Found-inf from the gradient amax the rule reads anyway (fused-optimizer path): no
        separate found-inf pass; the flag on the scale's device, as GradScaler's fused path."""
        # a guarded step's scale is on the device only
        inv = self._inv_scale() if self._guarded else 1.0 / self._host_scale
        state = self._per_optimizer_states[id(optimizer)]
        dev = self._scale.device
        grads = self._one_pass_grads(optimizer)
        if grads is None:
            self._collect_grad_stats(optimizer, inv_scale=inv)
        else:  # one read of each gradient, in cache for all it gives
            self.grads.amax(state, grads, inv, dev)
            for obs in self._observers:
                obs.on_grads(self, optimizer, grads, inv)
        self.grads.found_inf(state, dev)

    def _one_pass_grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor] | None:
        """The gradients, where their statistics are read in the pass that finds infs; or None."""
        if not self._collect_stats or self.grads.keep_abs:
            return None
        self._check_scale_growth_tracker("unscale_")
        if self._group() is not None:  # statistics agreed across ranks: the general layout
            return None
        return one_pass_grads(optimizer, self._scale.device)

    def _unscale_with_amax(
        self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]
    ) -> None:
        """GradScaler's ``unscale_`` with the amax read in the same place
        (:meth:`~autoscale.scalers.grad_reader.GradReader.unscale`)."""
        state = self._unscale_state(optimizer)
        self.grads.unscale(state, grads, self._inv_scale(), self._scale.device, host=self._cpu)
        for obs in self._observers:
            obs.on_grads(self, optimizer, grads, None)
        state["stage"] = OptState.UNSCALED

    def _unscale_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state of this step, with GradScaler's errors where it was unscaled
        or stepped already."""
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        return state

    def _inv_scale(self) -> torch.Tensor:
        if not self._guarded:
            self._adopt_written()
        elif self._cpu and self._step_scale is not None:
            # a guarded step's scale, known on the host: 1/scale as for any host scale
            return self._inverse(self._scale, self._step_scale, False, None)
        return self._inverse(self._scale, self._host_scale, self._guarded, self._guard_scale)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        self._agree(optimizer_state)
        if sv.HOST not in optimizer_state:  # (read already on a CPU)
            sv.read([optimizer_state])
        if not optimizer_state[sv.HOST].found:
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
        if self._guarded and self._written_since_guard():
            # other code wrote the tensor within a guarded step: its value is the scale set
            # from now on, as outside one (the loss took the guard's: the step keeps that)
            self._guarded, self._synced = False, None
        if not self._guarded:
            self._adopt_written()
        states = [s for s in self._per_optimizer_states.values() if s["found_inf_per_device"]]
        if not states:
            raise AssertionError("No inf checks were recorded prior to update.")
        if self._loss_sum is not None and all(sv.VEC in s or sv.HOST in s for s in states):
            # a loss scaled after the last optimizer step agreed its flags: one more agreement
            states.append(_refresh_per_optimizer_state())
        for state in states:
            if sv.HOST not in state and sv.VEC not in state:  # (most were at their step)
                self._agree(state)
        stats, used = sv.step_stats(
            states, self.controller.steps, self._host_scale, self._collect_stats, self.grads.rms
        )
        self.last_stats = stats
        if used == self._host_scale:  # the guard kept the set scale: no fill if the rule does too
            self._guarded = False
            self._note_synced()
        try:
            self._set_scale(self.controller.step(stats), adopted=True)
        except BaseException:  # (raise_at_min): the tensor goes back to the scale a step starts at
            if self._guarded:
                self._scale.fill_(self._host_scale)
            raise
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

        Valid after ``step()`` (before or after ``update()``), for plain and fused optimizers;
        with several, True when any skipped. False before the first step and when disabled.
        """
        if not self._enabled:
            return False
        states = [
            s for s in self._per_optimizer_states.values() if s["stage"] is OptState.STEPPED
        ] or self._last_stepped
        if not states:
            return False
        sv.read(states)  # no-op when step() or update() read the flags already
        return any(s[sv.HOST].found for s in states)

    def add_observer(self, observer: Any) -> None:
        """Call ``observer`` at each step as :class:`autoscale.observe.StepObserver` describes
        (``on_scale``, ``on_grads``, ``on_update``); observers read, never change, the step.
        Switches the gradient amax on (an observer reads it)."""
        self._collect_stats = True
        self._observers.append(observer)

    def remove_observer(self, observer: Any) -> None:
        """Stop calling ``observer`` (see :meth:`add_observer`)."""
        self._observers = [o for o in self._observers if o is not observer]

    @property
    def observers(self) -> tuple[Any, ...]:
        """The observers :meth:`add_observer` added, in order."""
        return tuple(self._observers)

    def set_scale(self, value: float) -> None:
        """Set the scale of the next step (clamped to ``[min_scale, max_scale]``), between steps,
        for a controller outside the rule (an environment that lets an agent choose)."""
        if self._enabled:
            self._set_scale(self.controller.bounds.clamp(float(value)))

    def get_scale(self) -> float:
        """The scale as GradScaler's ``get_scale`` gives it, a Python float (1.0 when disabled).

        Between ``scale()`` and ``update()``: the factor this step's losses were multiplied by,
        so that ``p.grad / get_scale()`` unscales and logs show what the step used. Under a rule
        that guards each step (``has_guard``, the shipped ``auto``) that is the guard's scale,
        which may lie below :meth:`get_base_scale`; on a GPU reading it is a host sync, as every
        GradScaler ``get_scale()`` is (read once a step). Otherwise (after ``update()``, before
        the first ``scale()``): the scale the next step starts from, :meth:`get_base_scale`,
        from a host copy (no sync).
        """
        if not self._enabled:
            return 1.0
        if self._guarded:
            if self._step_scale is None:  # the guard wrote it on the device
                self._step_scale = float(self._scale.item())
            return self._step_scale
        self._adopt_written()
        return self._host_scale

    def get_base_scale(self) -> float:
        """The scale the rule set at the last ``update()`` (or load, or ``set_scale``): the
        scale the next step starts from, before a guarded rule's per-step guard lowers it for
        one step (:meth:`get_scale` gives the step's own). Always from a host copy (no sync);
        1.0 when disabled."""
        return self._host_scale if self._enabled else 1.0

    def state_dict(self) -> dict[str, Any]:
        """Primitive-only state (loads under ``torch.load(weights_only=True)``).

        Keeps GradScaler's keys, so tools that read ``state["scale"]`` (and a plain GradScaler)
        still work, and adds an ``"autoscale"`` entry with the rule's name, bounds, counters and
        state (see :mod:`~autoscale.scalers.checkpoint`).
        """
        if not self._enabled:
            return {}
        knobs = {
            "growth_factor": self.get_growth_factor(),
            "backoff_factor": self.get_backoff_factor(),
            "growth_interval": self.get_growth_interval(),
        }
        return write_state(self.name, self._host_scale, knobs, self.controller)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` or any GradScaler's, the scale clamped into this scaler's
        bounds (a warning where they differ). A state of this rule restores its settings too, as
        GradScaler restores ``growth_factor``, ``backoff_factor`` and ``growth_interval``: the
        run continues as the saving scaler's would have, whatever this one was built with (a
        plain GradScaler's state gives the ``torch`` rule those three). Another rule's state
        gives its scale; this rule keeps its settings and its memory starts fresh (one
        warning). ConfigError: a newer autoscale's state, a missing or malformed entry, settings
        the rule refuses (:mod:`~autoscale.scalers.checkpoint`)."""
        if not self._enabled:
            return
        loaded = read_state(state_dict, self.name, self.controller.bounds)
        rule = rule_for(self.controller, loaded, self.name)
        if rule is not self.rule:  # saved with other settings: the rule that has them
            self.rule = self.controller.rule = rule
            self._growth_factor = self.get_growth_factor()
            self._backoff_factor = self.get_backoff_factor()
            self._growth_interval = self.get_growth_interval()
        if loaded.counters is not None:
            self.controller.load_counters(loaded.counters)
            self.grads.forget()  # its step number may come back: not these gradients
        self._set_scale(loaded.scale)
        self._guarded = False  # loaded after scale(): the step goes on at the loaded scale
        self._step_group = None  # (a rule of other settings may read other things)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:  # a copy starts a step at the rule's scale (GradScaler's get_scale())
            state.update(_init_scale=self._host_scale, _guarded=False)
        # (observers: recorders and loggers hold files of this process)
        state.update(
            _loss_sum=None,
            _last_stepped=[],
            _observers=[],
            _guard_scale=None,
            _step_scale=None,
            _step_group=None,
            _spike=None,
            _synced=None,
            _guard_wrote=None,
        )
        state["_inverse"] = InverseScale()
        return state

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.rule.params().items())
        return f"{type(self).__name__}(name={self.name!r}, scale={self._host_scale:g}{', ' if params else ''}{params})"

    # ------------------------------------------------------------------ internals
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._cpu = self._scale.device.type == "cpu"
        if self._init_scale != self._host_scale:  # written by other code (GradScaler's
            self._synced = None  # load_state_dict before a first step): taken as the scale set
            self._adopt_written()
        else:
            self._note_synced()

    def _note_synced(self) -> None:
        """The scale tensor holds the scale set (``_host_scale``) now, as this scaler wrote it."""
        scale = self._scale
        self._synced = (scale, scale._version)

    def _moved(self, mark: tuple[torch.Tensor, int] | None) -> bool:
        """Whether the scale tensor is no longer ``mark``'s tensor at ``mark``'s version (a
        ``(tensor, version)`` noted after a write of this scaler's; None: not known, moved)."""
        scale = self._scale
        return mark is None or mark[0] is not scale or mark[1] != scale._version

    def _written(self) -> bool:
        """Whether code other than this scaler's wrote the scale tensor since it last set it."""
        return self._moved(self._synced)

    def _written_since_guard(self) -> bool:
        """Whether code other than this scaler's wrote the scale tensor since this step's guard
        set it."""
        return self._guard_wrote is not None and self._moved(self._guard_wrote)

    def _adopt_written(self) -> None:
        """Take the scale tensor's value as the scale set where code other than this scaler's
        wrote it since (GradScaler's private ``_scale``, filled or replaced; as ``set_scale``
        would make it, the rule continuing from it): the loss is multiplied by that tensor, so
        1/scale, ``get_scale()`` and the rule follow it, as GradScaler's would. A check of the
        tensor's identity and version; the read (a sync on a GPU) only after such a write.
        Not within a guarded step (the guard writes the tensor)."""
        scale, synced = self._scale, self._synced
        if scale is None or (
            synced is not None and synced[0] is scale and synced[1] == scale._version
        ):
            return  # (_written, inline: this runs up to three times a step)
        value = float(scale)
        self._host_scale = value
        self._guard_scale = self._step_scale = None
        self.rule.adopt(value)
        self._note_synced()

    def _set_scale(self, value: float, adopted: bool = False) -> None:
        """Make ``value`` the scale of the next step (``adopted``: the rule knows it already, and
        :meth:`update`, which passes it, took any write to the tensor first)."""
        scale = self._scale
        if scale is None:
            self._init_scale = value
        elif value != self._host_scale or self._guarded or (not adopted and self._written()):
            scale.fill_(value)
            self._note_synced()
        self._host_scale = value
        self._guard_scale = self._step_scale = None  # no longer this step's scale
        if not adopted:  # set from outside the rule: it continues from this scale
            self.rule.adopt(value)

    def _end_step(self) -> None:
        # step_was_skipped answers for these until the next step()
        self._last_stepped = [
            s for s in self._per_optimizer_states.values() if s["stage"] is OptState.STEPPED
        ]
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._loss_sum = None
        self._loss_count = 0
        self._guarded = False
        self._guard_scale = self._step_scale = self._step_group = self._spike = None
        self._guard_wrote = None
        self.grads.forget()  # grad_abs answers for the step that filled it only

    def _collect_grad_stats(self, optimizer: torch.optim.Optimizer, inv_scale: Any) -> None:
        def observe(grads: list[torch.Tensor]) -> None:
            for obs in self._observers:
                obs.on_grads(self, optimizer, grads, inv_scale)

        state = self._per_optimizer_states[id(optimizer)]
        self.grads.collect(optimizer, state, self._scale.device, inv_scale, self.steps, observe)

    # ------------------------------------------------------------------ agreement across ranks
    @property
    def identical_grads(self) -> bool:
        """The gradients are identical on every rank (no collective unless the rule reads loss)."""
        return self._ranks.identical_grads

    def _group(self) -> Any:
        """The process group decisions are agreed over, or None (nothing to agree); looked up
        once a step (several parts of a step ask)."""
        if self._step_group is None:
            self._step_group = (self._ranks.group(self._scale.device, self.rule.needs_loss),)
        return self._step_group[0]

    def _agree(self, state: dict[str, Any]) -> None:
        """Pack this optimizer's step into one vector, agreed across ranks (no host sync); on a
        CPU with nothing to agree, read its values at once instead (:meth:`_read_on_host`).

        The first agreement of a step also decides whether the step is a loss spike to skip,
        from the mean of the losses scaled until then (the replays' loss of the step), and sets
        the found-inf flags where it is (the later agreements of the step take that decision)."""
        if sv.VEC in state or sv.HOST in state:
            return
        spike, limit = self._spike, None
        if spike is None:
            limit = self._spike_limit()
            if limit is None:
                spike = self._spike = False
        elif spike is True:  # a spike, known on the host: the step is skipped as an overflow is
            for flag in state["found_inf_per_device"].values():
                flag.fill_(1.0)
        elif spike is not False:  # on the device
            sv.mark_spike(state["found_inf_per_device"], spike)
        group = self._group()
        loss, n_loss, self._loss_sum, self._loss_count = self._loss_sum, self._loss_count, None, 0
        stats = state.get(sv.STATS) if self._collect_stats else None
        if group is None and self._cpu:
            self._read_on_host(state, stats, loss, n_loss, limit)
            return
        dev = self._scale.device
        gather = None if group is None else (lambda local: self._ranks.gather(local, group))
        guard = self._scale if self._guarded else None  # the step's own scale travels along
        if limit is None:  # decided already (or no test): the decision travels along
            spiked = spike if isinstance(spike, torch.Tensor) else None
            sv.pack_into(state, stats, loss, n_loss, guard, dev, gather, spiked)
            return
        self._spike = sv.pack_into(state, stats, loss, n_loss, guard, dev, gather, limit=limit)

    def _read_on_host(
        self,
        state: dict[str, Any],
        stats: torch.Tensor | None,
        loss: Any,
        n_loss: int,
        limit: float | None,
    ) -> None:
        """The :class:`~autoscale.scalers.step_vector.HostStep` that packing and reading would
        give (the loss summed in float32, as the vector holds it), read from the CPU tensors
        themselves: a read is no sync on a CPU, and a vector costs ops every step. ``limit``:
        the step's spike test is made here (see :meth:`_agree`)."""
        found = False
        for flag in state["found_inf_per_device"].values():
            found = found or flag.item() > 0
        amax, sumsq, count = math.nan, math.nan, 0.0
        if stats is not None:
            if isinstance(stats, float):  # read on the host already (GradReader.unscale)
                amax = stats
            elif stats.dim():
                amax, sumsq, count = stats.tolist()
            else:
                amax = stats.item()
        loss_sum = 0.0
        if loss is not None:  # float32's sum: a float64 loss rounds to it, a narrower one is exact
            loss_sum = loss.float().item() if loss.dtype is torch.float64 else loss.item()
        if limit is not None:  # the step's spike test, on its mean loss
            self._spike = bool(n_loss) and limit < abs(loss_sum / n_loss) < math.inf
            if self._spike:  # skipped as an overflow is
                for flag in state["found_inf_per_device"].values():
                    flag.fill_(1.0)
        spiked = bool(self._spike)  # (a flag computed on the device reads here too)
        state[sv.HOST] = sv.HostStep(
            found or spiked, amax, sumsq, count, loss_sum, float(n_loss), spiked
        )
        if self._guarded:
            state[sv.USED] = self._step_scale if self._step_scale is not None else self.get_scale()


# GradScaler's own sort of the gradients by device and dtype (LossScaler._unscale goes around it)
_SORT = LossScaler.__bases__[0].__dict__["_unscale_grads_"]
