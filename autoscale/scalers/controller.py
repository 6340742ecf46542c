"""The rule interface: what decides the next loss scale, apart from any GradScaler.

A :class:`ScaleRule` is small and pure (host floats in, a float out, no torch): it sees the scale a
step used and that step's :class:`StepStats`, and returns the scale it wants next. It may keep
state (counters, histories) as primitives, and it may say how DeepSpeed's ``fp16`` config block
expresses it.

A :class:`ScaleController` hosts one rule between explicit bounds. It is where, in a scaler, a
rule's wish becomes the next scale (clamped into ``[min_scale, max_scale]``, rounded to float32)
and where overflows at the minimum are counted. :class:`~autoscale.scalers.scaler.LossScaler` (the
GradScaler that trains) drives its rule through it. The environments (which evaluate rules,
policies and agents) call the same rule methods on their own host state
(:class:`~autoscale.envs.base.ScaleEnvBase`), clamping into the same :class:`ScaleBounds`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from autoscale.errors import ConfigError, MinimumLossScaleError

__all__ = [
    "ScaleRule",
    "ScaleBounds",
    "ScaleController",
    "StepStats",
    "FP16_MAX",
    "FP16_MIN_NORMAL",
    "f32",
]

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14


_F32 = struct.Struct("f")
_F32_OF: dict[float, float] = {}  # f32 of positive finite floats that ScaleBounds.clamp saw
_F32_CACHE_SIZE = 1 << 16


def f32(x: float) -> float:
    """Round a Python float to float32, as torch's scale tensor stores it."""
    if x != x or x == math.inf or x == -math.inf:  # NaN or infinite: as they are
        return x
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def f32_bound(x: float, up: bool) -> float:
    """The float32 nearest to a positive ``x`` on one side: >= x when ``up``, else <= x.

    Bounds are stored this way so that a scale rounded to float32 never crosses them (1e-4 rounds
    to 9.99999997e-05 < 1e-4).
    """
    r = f32(x)
    if (r < x) if up else (r > x):
        bits = struct.unpack("I", struct.pack("f", r))[0] + (1 if up else -1)
        r = struct.unpack("f", struct.pack("I", bits))[0]
    return r


def positive_finite(name: str, value: Any) -> float:
    """``value`` as a float, or ConfigError naming ``name`` unless it is positive and finite."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = math.nan
    if isinstance(value, bool) or not (out > 0 and math.isfinite(out)):
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
    return out


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step looked like, as the scale rule and the feature extractor see it.

    Attributes:
        step: Index of the step (0-based) in this scaler's life.
        scale: The loss scale the step's backward pass used.
        found_inf: Whether any gradient was non-finite (the optimizer step was skipped).
        grad_amax: Largest absolute unscaled gradient element (``nan`` when not collected; ``inf``
            or ``nan`` when ``found_inf``).
        grad_rms: Root mean square of the unscaled gradient elements (same conventions).
        loss: Mean of the unscaled losses passed to ``scale()`` this step (``nan`` if none was a
            single-element tensor). A non-finite loss means the batch fails at any scale.
        loss_seen: Whether ``scale()`` received a single-element loss this step.
        guarded: The rule's per-step guard (:meth:`ScaleRule.guard_limit`) lowered this step's
            scale below the one the rule set at the last update: ``scale`` is the lowered one.
        spiked: The rule named this step's finite loss a spike (:meth:`ScaleRule.spike_limit`)
            and the scaler skipped it (``found_inf`` is set too: the step was skipped), whatever
            its gradients were.
    """

    step: int
    scale: float
    found_inf: bool
    grad_amax: float = math.nan
    grad_rms: float = math.nan
    loss: float = math.nan
    loss_seen: bool = False
    guarded: bool = False
    spiked: bool = False

    @property
    def loss_nonfinite(self) -> bool:
        """The loss itself was non-finite: the batch fails at any scale."""
        return self.loss_seen and not math.isfinite(self.loss)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ScaleRule:
    """Decides the next loss scale from the current one and one step's :class:`StepStats`.

    Subclasses take their hyperparameters as keyword arguments (validated in ``__init__``),
    implement :meth:`next_scale`, and keep mutable state as primitives in :meth:`state` /
    :meth:`load_state` so that checkpoints carry it. Register one with
    :func:`~autoscale.scalers.registry.register_loss_scaler`; ``get_scaler(NAME)`` then hosts it in
    a GradScaler.

    Class attributes:
        name: Registry id (set by the registry).
        description, source: One line each for ``autoscale list``.
        needs_stats: :meth:`next_scale` reads ``grad_amax`` or ``grad_rms`` (the scaler then
            computes them each step).
        needs_rms: With ``needs_stats``, whether ``grad_rms`` is read (False spares a pass).
        needs_loss: :meth:`next_scale` reads ``loss`` (under DDP each rank's loss differs, so it
            is agreed across ranks even when the gradients are identical).
        has_guard: :meth:`guard_limit` may return a limit: the scale of each step is lowered, on
            the device when the loss is scaled, to keep ``scale * |loss|`` under it.
        scale_time: With ``has_guard``, the rule decides each step's scale itself when the loss
            is scaled (``step_scale`` on the host, ``apply_step_scale`` on the device; an exported
            policy that acts at scale time) instead of through :meth:`guard_limit`.
        adapts: The scale follows the gradients (False for a fixed scale: a search exports
            such a rule only when the user asks for its family, since a run's gradients drift by
            orders of magnitude over 10^4 to 10^6 steps).
        default_init_scale, default_min_scale, default_max_scale: The scale bounds a scaler of this
            rule gets unless the user gives others.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    source: ClassVar[str] = ""
    needs_stats: ClassVar[bool] = False
    needs_rms: ClassVar[bool] = True
    needs_loss: ClassVar[bool] = False
    has_guard: ClassVar[bool] = False
    scale_time: ClassVar[bool] = False
    adapts: ClassVar[bool] = True
    default_init_scale: ClassVar[float] = 2.0**16
    default_min_scale: ClassVar[float] = 2.0**-24
    default_max_scale: ClassVar[float] = 2.0**64

    def next_scale(self, scale: float, stats: StepStats) -> float:
        """The scale wanted for the next step (the controller clamps it). Called once per step.

        Args:
            scale: The scale this step used.
            stats: This step's record (found-inf flag; gradient statistics when ``needs_stats``).
        """
        raise NotImplementedError

    def guard_limit(self) -> float | None:
        """The largest ``scale * |loss|`` the next step may take, or None (no guard).

        Where a rule has one (``has_guard``), the scaler lowers the next step's scale, when its
        loss is scaled, to the largest power of two ``S`` with ``S * |loss| <= limit`` if that is
        below the scale :meth:`next_scale` set (never below the minimum; a non-finite loss keeps
        the set scale): a loss the rule foresees to make larger gradients gets a smaller scale for
        that step only. The step's :class:`StepStats` then carry the lowered scale and
        ``guarded``. Read once per step, after :meth:`next_scale`.
        """
        return None

    def spike_limit(self) -> float | None:
        """The ``|loss|`` above which the next step is skipped as a spike, or None (none is).

        Read by the scaler at the first agreement of a step (its first optimizer's ``unscale_``
        or ``step``; a rule with ``has_guard`` only): a step whose finite mean ``|loss|`` (the
        losses scaled until then) passes it is skipped as an overflowing one is, its
        :class:`StepStats` carry ``spiked``, and it is not counted as an overflow at the
        minimum."""
        return None

    def backs_off_on_overflow(self) -> bool:
        """Whether an overflow now would lower the scale (False while hysteresis or a tolerance
        would absorb it). ``raise_at_min`` raises only then, as DeepSpeed does."""
        return True

    def start(self, scale: float, features_state: dict[str, Any] | None = None) -> float:
        """Prepare for a run that continues from ``scale``; return the scale wanted for its first
        step. Counter rules keep ``scale``; policies that read the shared features load
        ``features_state`` (a :class:`~autoscale.scalers.features.FeatureExtractor` state) and take
        their first decision, as an agent does at an environment's reset."""
        return scale

    def adopt(self, scale: float) -> None:
        """The scale the controller set from this rule's wish (clamped into the bounds). A rule
        whose guard may lower a step's scale, and that must continue from the scale it set
        rather than the one the step used, keeps it here."""

    def params(self) -> dict[str, Any]:
        """The hyperparameters as primitives: ``type(self)(**rule.params())`` rebuilds the rule."""
        return {}

    def state(self) -> dict[str, Any]:
        """The mutable state as primitives (counters, histories)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned.

        Raises:
            ConfigError: ``state`` does not fit this rule (a key missing or of the wrong type).
        """

    def deepspeed_config(self, init_scale: float, min_scale: float) -> dict[str, Any]:
        """The DeepSpeed ``fp16`` config block that runs this rule, where DeepSpeed can express it.

        Raises:
            ConfigError: DeepSpeed cannot express the rule (the default).
        """
        raise ConfigError(
            f"rule '{self.name}' cannot be expressed in DeepSpeed's fp16 block (it supports static "
            "scales and the hysteresis/window rule only); use autoscale's scaler through a torch "
            "training loop instead"
        )

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({params})"


@dataclass(frozen=True)
class ScaleBounds:
    """The interval a scale lives in: ``[min_scale, max_scale]``, float32 values, never 0 or inf."""

    min_scale: float
    max_scale: float

    @classmethod
    def of(cls, min_scale: Any, max_scale: Any) -> ScaleBounds:
        """Validated bounds, rounded inwards to float32 so that a clamped scale never crosses them.

        Raises:
            ConfigError: a bound that is not positive and finite, or min above max.
        """
        lo = f32_bound(positive_finite("min_scale", min_scale), up=True)
        hi = f32_bound(positive_finite("max_scale", max_scale), up=False)
        if lo > hi:
            raise ConfigError(
                f"min_scale ({lo:g}) must not exceed max_scale ({hi:g}); swap or widen them"
            )
        return cls(lo, hi)

    def clamp(self, value: float) -> float:
        """``value`` clamped into the bounds and rounded to float32 (NaN -> the minimum)."""
        # comparisons rather than min/max/isnan, and a cache of f32: this runs twice a replayed
        # step, and scales repeat
        if value != value or value < self.min_scale:  # NaN -> the minimum
            value = self.min_scale
        elif value > self.max_scale:
            value = self.max_scale
        if type(value) is not float:
            return f32(value)
        out = _F32_OF.get(value)
        if out is None:
            out = f32(value)
            if len(_F32_OF) < _F32_CACHE_SIZE:
                _F32_OF[value] = out
        return out

    def overflow_at_min(self, scale: float, found_inf: bool) -> bool:
        """Whether a step at ``scale`` that overflowed (``found_inf``) did so at the minimum."""
        return bool(found_inf) and scale <= self.min_scale


class ScaleController:
    """A rule between bounds, with the counters of the run it drives.

    Every scaler turns its rule's wish into the next scale here (:meth:`step`), so clamping and
    the minimum are handled in one place.

    Args:
        rule: The rule.
        bounds: The interval scales stay in.
        raise_at_min: Raise :class:`~autoscale.errors.MinimumLossScaleError` on an overflow at the
            minimum that the rule would answer by lowering the scale (DeepSpeed's abort).

    Attributes:
        steps: Steps seen. skipped: Steps that overflowed. min_hits: Overflows at the minimum.
    """

    def __init__(self, rule: ScaleRule, bounds: ScaleBounds, raise_at_min: bool = False) -> None:
        self.rule, self.bounds, self.raise_at_min = rule, bounds, bool(raise_at_min)
        self.steps = self.skipped = self.min_hits = 0

    @property
    def hit_min(self) -> bool:
        """Whether an overflow ever happened at the minimum scale."""
        return self.min_hits > 0

    def start(self, scale: float, features_state: dict[str, Any] | None = None) -> float:
        """The first scale of a run continuing from ``scale`` (see :meth:`ScaleRule.start`)."""
        out = self.bounds.clamp(self.rule.start(self.bounds.clamp(scale), features_state))
        self.rule.adopt(out)
        return out

    def step(self, stats: StepStats) -> float:
        """Count ``stats`` and return the next scale (clamped).

        Raises:
            MinimumLossScaleError: with ``raise_at_min``, an overflow at the minimum that the rule
                would answer by lowering the scale. The step is counted first.
        """
        self.steps += 1
        if stats.found_inf:
            self.skipped += 1
            if not stats.spiked and self.bounds.overflow_at_min(stats.scale, True):
                self.min_hits += 1
                if self.raise_at_min and self.rule.backs_off_on_overflow():
                    raise MinimumLossScaleError(
                        f"Current loss scale already at minimum ({self.bounds.min_scale:g}) and the step "
                        f"overflowed again (rule '{self.rule.name}'); lower min_scale or set raise_at_min=False"
                    )
        out = self.bounds.clamp(float(self.rule.next_scale(stats.scale, stats)))
        self.rule.adopt(out)
        return out

    def with_params(self, params: dict[str, Any]) -> ScaleRule | None:
        """The rule with the settings ``params`` names (the keys this rule's :meth:`ScaleRule.params`
        has; the others keep their values): this rule where they are its own, else a new rule of
        its class built with them, whose memory is a fresh rule's (load its state next); None
        for a rule that its parameters do not rebuild (values that are not numbers, booleans or
        strings describe parts, as a policy's may; or its constructor takes other arguments).
        The controller hosts it once it is assigned to :attr:`rule`.

        Raises:
            ConfigError: a value the rule's own validation refuses.
        """
        current = self.rule.params()
        changed = {k: v for k, v in params.items() if k in current and current[k] != v}
        if not changed:
            return self.rule
        if not all(isinstance(v, bool | int | float | str) for v in current.values()):
            return None  # parameters that describe parts (a policy's), not constructor values
        try:
            return type(self.rule)(**{**current, **changed})
        except TypeError:
            return None
        except (ConfigError, ValueError) as exc:
            raise ConfigError(
                f"rule '{self.rule.name}' cannot take the settings {changed}: {exc}"
            ) from None

    def knob(self, key: str, default: Any) -> Any:
        """The rule's parameter ``key`` (GradScaler's growth_factor, ...), else ``default``."""
        return self.rule.params().get(key, default)

    def set_knob(self, key: str, value: Any) -> Any:
        """Set the rule's parameter ``key`` through the rule's own validation; return the value
        set. ConfigError when the rule has no such parameter or refuses the value."""
        params = self.rule.params()
        if key not in params:
            raise ConfigError(
                f"rule '{self.rule.name}' has no {key} (its parameters: {', '.join(params) or 'none'})"
            )
        checked = getattr(type(self.rule)(**{**params, key: value}), key)
        setattr(self.rule, key, checked)
        return checked

    def counters(self) -> dict[str, int]:
        return {"steps": self.steps, "skipped": self.skipped, "min_hits": self.min_hits}

    def load_counters(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.skipped = int(state["skipped"])
        self.min_hits = int(state["min_hits"])
