"""`LossScaler`: a `torch.amp.GradScaler` whose scale update is a pluggable rule.

The parent's ``scale``/``unscale_``/``step`` are kept as they are, so fused optimizers, gradient
clipping after ``unscale_`` and every framework that drives a GradScaler keep working. Only the
decision of the next scale changes: a subclass implements :meth:`LossScaler.next_scale`, which sees
the current scale and one :class:`StepStats` record with host floats.

Host syncs: GradScaler reads the found-inf flag once per step in ``step()`` (non-fused optimizers).
LossScaler packs the flag, the gradient statistics and the loss into one small tensor and reads it
in that same place, so the rule costs no extra sync there. Optimizers that unscale inside their own
kernel (``AdamW(fused=True)``) never sync in GradScaler; LossScaler then reads the packed tensor once
in ``update()``: one sync per step.
"""

from __future__ import annotations

import math
import struct
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from autoscale.errors import ConfigError, MinimumLossScaleError

__all__ = ["LossScaler", "StepStats", "FP16_MAX", "FP16_MIN_NORMAL", "default_device"]

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14
STATE_VERSION = 1


def default_device() -> str:
    """``"cuda"`` when a CUDA device is usable, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def f32(x: float) -> float:
    """Round a Python float to float32, as torch's scale tensor stores it."""
    if math.isinf(x) or math.isnan(x):
        return x
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
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
    """

    step: int
    scale: float
    found_inf: bool
    grad_amax: float = math.nan
    grad_rms: float = math.nan
    loss: float = math.nan
    loss_seen: bool = False

    @property
    def loss_nonfinite(self) -> bool:
        """The loss itself was non-finite: the batch fails at any scale."""
        return self.loss_seen and not math.isfinite(self.loss)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LossScaler(torch.amp.GradScaler):
    """Base of every autoscale scaler: a GradScaler with an explicit, pluggable scale rule.

    Subclasses set ``name``/``description``/``source`` (the registry fills ``name``), implement
    :meth:`next_scale`, and keep any state they need as primitives returned by
    :meth:`rule_state` and restored by :meth:`load_rule_state`.

    Args:
        device: ``"cuda"``, ``"cpu"``, ... Defaults to CUDA when present, else CPU. As with
            GradScaler, ``"cuda"`` without CUDA disables scaling with a warning.
        init_scale: Scale of the first step (clamped into ``[min_scale, max_scale]``).
        min_scale: Smallest scale the rule may set; never 0.
        max_scale: Largest scale the rule may set; never inf.
        raise_at_min: Raise :class:`MinimumLossScaleError` on an overflow at the minimum scale that
            the rule would answer by lowering the scale, as DeepSpeed does ("Current loss scale
            already at minimum"; an overflow its hysteresis absorbs does not raise). Off by
            default: the event is counted in ``min_hits`` and training goes on with the step
            skipped.
        collect_stats: Compute gradient amax/RMS each step (two fused foreach reductions). Defaults
            to what the rule needs (``needs_stats``; a rule with ``needs_rms = False`` then skips
            the RMS pass). Passing or setting it True collects both.
        enabled: As in GradScaler.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    source: ClassVar[str] = ""
    needs_stats: ClassVar[bool] = False
    needs_rms: ClassVar[bool] = True
    default_min_scale: ClassVar[float] = 2.0**-24
    default_max_scale: ClassVar[float] = 2.0**64

    def __init__(
        self,
        device: str | None = None,
        *,
        init_scale: float = 2.0**16,
        min_scale: float | None = None,
        max_scale: float | None = None,
        raise_at_min: bool = False,
        collect_stats: bool | None = None,
        enabled: bool = True,
    ) -> None:
        device = device or default_device()
        min_scale = self.default_min_scale if min_scale is None else float(min_scale)
        max_scale = self.default_max_scale if max_scale is None else float(max_scale)
        _check_positive_finite("min_scale", min_scale)
        _check_positive_finite("max_scale", max_scale)
        _check_positive_finite("init_scale", float(init_scale))
        min_scale, max_scale = f32_bound(min_scale, up=True), f32_bound(max_scale, up=False)
        if min_scale > max_scale:
            raise ConfigError(
                f"min_scale ({min_scale:g}) must not exceed max_scale ({max_scale:g}); swap or widen them"
            )
        super().__init__(
            device,
            init_scale=f32(min(max(float(init_scale), min_scale), max_scale)),
            enabled=enabled,
        )
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.raise_at_min = bool(raise_at_min)
        self.collect_stats = self.needs_stats if collect_stats is None else bool(collect_stats)
        # a rule that reads only the amax skips the sum-of-squares pass unless asked for it
        self._collect_rms = self.collect_stats and (self.needs_rms or collect_stats is True)
        self._host_scale = self._init_scale if self._enabled else 1.0
        self.steps = 0
        self.skipped = 0
        self.min_hits = 0
        self.last_stats: StepStats | None = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._loss_host: float | None = None

    @property
    def collect_stats(self) -> bool:
        """Whether gradient statistics are computed each step; switching it on collects all."""
        return self._collect_stats

    @collect_stats.setter
    def collect_stats(self, value: bool) -> None:
        self._collect_stats = self._collect_rms = bool(value)

    # ------------------------------------------------------------------ the rule
    def next_scale(self, scale: float, stats: StepStats) -> float:
        """Return the scale for the next step. Called once per ``update()``.

        Args:
            scale: The scale this step used.
            stats: This step's record (found-inf flag, and gradient statistics when collected).
        """
        raise NotImplementedError

    def backs_off_on_overflow(self) -> bool:
        """Whether an overflow now would lower the scale (False while a rule's hysteresis absorbs it).

        ``raise_at_min`` raises only then, as DeepSpeed does.
        """
        return True

    def start_episode(self, scale: float, features_state: dict[str, Any] | None = None) -> float:
        """Prepare the rule for a run that continues from ``scale``; return the first step's scale.

        Rules that read the shared features (exported policies) load ``features_state``, the
        :class:`~autoscale.scalers.features.FeatureExtractor` state of that point, and take their
        first decision from it, as an agent does at an environment's reset. Counter rules keep
        ``scale``.
        """
        self.set_scale(scale)
        return self.get_scale()

    def rule_params(self) -> dict[str, Any]:
        """The rule's hyperparameters as primitives (what ``get_scaler`` accepts to rebuild it)."""
        return {}

    def rule_state(self) -> dict[str, Any]:
        """The rule's mutable state as primitives (counters, histories)."""
        return {}

    def load_rule_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`rule_state` returned."""

    def spec(self) -> dict[str, Any]:
        """A dict that rebuilds this scaler: ``get_scaler(**spec)``."""
        return {
            "name": self.name,
            "init_scale": self._init_scale_spec(),
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            **self.rule_params(),
        }

    def _init_scale_spec(self) -> float:
        return float(getattr(self, "_first_scale", self._host_scale))

    # ------------------------------------------------------------------ GradScaler overrides
    def scale(self, outputs):  # noqa: D401 - same contract as GradScaler.scale
        """Multiply a loss (or tensors) by the current scale; also remembers the loss."""
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
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if self._enabled:
            self._agree_on_found_inf(optimizer)
            if self.collect_stats:
                self._collect_grad_stats(optimizer, inv_scale=None)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # The fused-optimizer path checks for infs without unscaling: statistics need 1/scale.
        if self.collect_stats:
            self._found_inf_from_amax(optimizer)
            found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        else:
            found = super()._check_inf_per_device(optimizer)
        self._agree_on_found_inf(optimizer)
        return found

    def _found_inf_from_amax(self, optimizer: torch.optim.Optimizer) -> None:
        """Derive found-inf from the gradient amax the rule reads anyway (fused-optimizer path).

        The amax is non-finite exactly when some gradient element is (NaN and inf propagate
        through it), so GradScaler's separate found-inf pass over every gradient is skipped. The
        flag lives on the scale's device, where GradScaler's fused path gathers it anyway.
        """
        self._collect_grad_stats(optimizer, inv_scale=1.0 / self._host_scale)
        state = self._per_optimizer_states[id(optimizer)]
        amax = state["autoscale_stats"][0]
        state["found_inf_per_device"] = {
            self._scale.device: (~torch.isfinite(amax)).to(torch.float32)
        }

    def _agree_on_found_inf(self, optimizer: torch.optim.Optimizer) -> None:
        # Fused optimizers (AdamW(fused=True)) skip the step inside their kernel from the device
        # found-inf flag and never pass through _maybe_opt_step: without DDP averaging the
        # gradients, a rank whose gradients are finite would step while another skips. Reduce the
        # flag on the device (no host sync) so that every rank skips together.
        if (
            getattr(optimizer, "_step_supports_amp_scaling", False)
            and dist.is_available()
            and dist.is_initialized()
        ):
            for flag in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        self._sync_states([optimizer_state])
        if not optimizer_state["autoscale_host"][0]:
            return optimizer.step(*args, **kwargs)
        return None

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Set the next scale: from ``new_scale`` if given, else from the rule."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("update")
        if new_scale is not None:
            value = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
            self._set_scale(self.clamp(value))
            self._end_step()
            return
        states = list(self._per_optimizer_states.values())
        states = [s for s in states if s["found_inf_per_device"]]
        if not states:
            raise AssertionError("No inf checks were recorded prior to update.")
        self._sync_states(states)
        found = any(s["autoscale_host"][0] for s in states)
        amax = max((s["autoscale_host"][1] for s in states), default=math.nan)
        sumsq = sum(s["autoscale_host"][2] for s in states)
        count = sum(s["autoscale_host"][3] for s in states)
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
        loss = self._loss_host if self._loss_host is not None else math.nan
        stats = StepStats(
            self.steps, self._host_scale, bool(found), amax, rms, loss, self._loss_host is not None
        )
        self.last_stats = stats
        self.steps += 1
        if found:
            self.skipped += 1
            if self._host_scale <= self.min_scale:
                self.min_hits += 1
                if self.raise_at_min and self.backs_off_on_overflow():
                    self._end_step()
                    raise MinimumLossScaleError(
                        f"Current loss scale already at minimum ({self.min_scale:g}) and the step "
                        f"overflowed again (rule '{self.name}'); lower min_scale or set raise_at_min=False"
                    )
        self._set_scale(self.clamp(float(self.next_scale(self._host_scale, stats))))
        self._end_step()

    def set_scale(self, value: float) -> None:
        """Set the scale of the next step (clamped to ``[min_scale, max_scale]``), between steps.

        Used by controllers outside the rule, such as the environment that lets an agent choose.
        """
        if self._enabled:
            self._set_scale(self.clamp(float(value)))

    def get_scale(self) -> float:
        """The current scale as a Python float (no device sync: autoscale keeps a host copy)."""
        return self._host_scale if self._enabled else 1.0

    @property
    def hit_min(self) -> bool:
        """Whether an overflow ever happened at the minimum scale."""
        return self.min_hits > 0

    def state_dict(self) -> dict[str, Any]:
        """Primitive-only state (loads under ``torch.load(weights_only=True)``).

        Keeps GradScaler's keys, so tools that read ``state["scale"]`` still work, and adds an
        ``"autoscale"`` entry with the rule's name, bounds, counters and state.
        """
        if not self._enabled:
            return {}
        return {
            "scale": self._host_scale,
            "growth_factor": float(self._growth_factor),
            "backoff_factor": float(self._backoff_factor),
            "growth_interval": int(self._growth_interval),
            "_growth_tracker": int(self.rule_state().get("growth_tracker", 0)),
            "autoscale": {
                "version": STATE_VERSION,
                "rule": self.name,
                "min_scale": self.min_scale,
                "max_scale": self.max_scale,
                "steps": self.steps,
                "skipped": self.skipped,
                "min_hits": self.min_hits,
                "rule_state": self.rule_state(),
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a plain GradScaler state restores the scale and tracker."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        ours = state_dict.get("autoscale")
        if ours is not None:
            if ours.get("rule") != self.name:
                raise ConfigError(
                    f"scaler state was saved by rule '{ours.get('rule')}', not '{self.name}'; "
                    f"load it with get_scaler('{ours.get('rule')}')"
                )
            self.min_scale = float(ours["min_scale"])
            self.max_scale = float(ours["max_scale"])
            self.steps = int(ours["steps"])
            self.skipped = int(ours["skipped"])
            self.min_hits = int(ours["min_hits"])
            self.load_rule_state(dict(ours["rule_state"]))
        else:
            self.load_rule_state({"growth_tracker": int(state_dict.get("_growth_tracker", 0))})
        self._set_scale(float(state_dict["scale"]))

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_loss_sum"] = None
        return state

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.rule_params().items())
        return f"{type(self).__name__}(name={self.name!r}, scale={self._host_scale:g}{', ' if params else ''}{params})"

    # ------------------------------------------------------------------ internals
    def clamp(self, value: float) -> float:
        """``value`` clamped to ``[min_scale, max_scale]`` and rounded to float32 (NaN -> min)."""
        if math.isnan(value):
            value = self.min_scale
        return f32(min(max(value, self.min_scale), self.max_scale))

    def _set_scale(self, value: float) -> None:
        if self._scale is None:
            self._init_scale = value
        elif value != self._host_scale:  # most steps keep the scale: no op then
            self._scale.fill_(value)
        self._host_scale = value

    def _end_step(self) -> None:
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._loss_sum = None
        self._loss_count = 0
        self._loss_host = None

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
        if not grads:
            state["autoscale_stats"] = torch.zeros(3, device=dev)
            return
        with torch.no_grad():
            amax = _grad_amax(grads, dev)
            if self._collect_rms:
                norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
                sumsq = _stack_on(norms, dev).square().sum()
            else:
                sumsq = torch.full((), math.nan, device=dev)
            if inv_scale is not None:
                amax, sumsq = amax * inv_scale, sumsq * (inv_scale * inv_scale)
            # torch.full, not torch.tensor: no host-to-device copy (a stream sync on CUDA)
            count = torch.full((), float(sum(g.numel() for g in grads)), device=dev)
            state["autoscale_stats"] = torch.stack([amax, sumsq, count])

    def _sync_states(self, states: list[dict[str, Any]]) -> None:
        """Read found-inf (and stats, and the loss) of these optimizer states in one host sync."""
        todo = [s for s in states if "autoscale_host" not in s]
        with_loss = self._loss_sum is not None and self._loss_host is None
        if not todo and not with_loss:
            return
        dev = self._scale.device
        # per optimizer: [found] or [found, amax, sumsq, count]; then [loss sum]. Few ops: this
        # runs every step, and each op costs microseconds of Python and dispatch.
        width = 4 if self.collect_stats else 1
        flags = []
        for s in todo:
            per_device = list(s["found_inf_per_device"].values())
            if len(per_device) == 1 and per_device[0].device == dev:
                flags.append(per_device[0])
            else:
                flags.append(sum(t.to(dev, non_blocking=True) for t in per_device))
        loss = [self._loss_sum.to(dev)] if with_loss else []
        if width == 1:
            vec = torch.stack(flags + loss)  # all 0-dim: one op
        else:
            parts = []
            for s, flag in zip(todo, flags):
                stats = s.get("autoscale_stats")
                if stats is None:
                    stats = torch.full((3,), math.nan, device=dev)
                parts += [flag.reshape(1), stats]
            vec = torch.cat(parts + [t.reshape(1) for t in loss])
        if dist.is_available() and dist.is_initialized():
            vec = self._reduce(vec, len(todo), width, with_loss)
        values = vec.tolist()  # the one host sync
        for i, s in enumerate(todo):
            row = values[width * i : width * (i + 1)]
            s["autoscale_host"] = (
                (row[0] > 0, *row[1:]) if width == 4 else (row[0] > 0, math.nan, math.nan, 0.0)
            )
        if with_loss:
            self._loss_host = values[-1] / self._loss_count

    @staticmethod
    def _reduce(vec: torch.Tensor, n_states: int, width: int, with_loss: bool) -> torch.Tensor:
        # Every rank must take the same decision: found-inf and amax by MAX; the sum of squares,
        # the element count and the loss by SUM (the loss then averaged over ranks).
        body = vec[: width * n_states].reshape(n_states, width)
        maxed = body[:, :2].contiguous()
        # a NaN amax (the gradients of an overflowing rank) must win the MAX, which drops NaN
        maxed = torch.where(torch.isnan(maxed), math.inf, maxed)
        summed = torch.cat([body[:, 2:].reshape(-1), vec[width * n_states :]])
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
        if summed.numel():
            dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        out = [
            torch.cat([maxed, summed[: 2 * n_states].reshape(n_states, 2)], dim=1)
            if width == 4
            else maxed
        ]
        if with_loss:
            out.append(summed[-1:] / dist.get_world_size())
        return torch.cat([o.reshape(-1) for o in out])


def _grad_amax(grads: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """max |g| over all gradients, a float32 0-dim tensor on ``dev`` (NaN if any element is NaN)."""
    if grads[0].device.type != "cpu":
        return _stack_on(torch._foreach_norm(grads, math.inf), dev).max()
    # On CPU, _foreach_norm(inf) is an unvectorized loop (2.7 ms for 1M fp32 elements), and
    # abs + max allocates a copy of every gradient (page faults: ~1.5 ms per step measured);
    # aminmax reads each gradient once without allocating.
    lo, hi = zip(*(torch.aminmax(g) for g in grads))
    return torch.maximum(_stack_on(hi, dev).max(), -_stack_on(lo, dev).min())


def _stack_on(tensors: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """Stack 0-dim tensors as float32 on ``dev`` (one op unless they live on several devices)."""
    try:
        out = torch.stack(tensors)
    except RuntimeError:  # model split across devices
        out = torch.stack([t.to(dev) for t in tensors])
    return out.to(dev, torch.float32)


def _check_positive_finite(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
