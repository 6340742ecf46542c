"""The per-step loss guard: a step's scale lowered from its own loss, before backward.

A rule with a guard (:attr:`~autoscale.scalers.controller.ScaleRule.has_guard`) gives a limit
(:meth:`~autoscale.scalers.controller.ScaleRule.guard_limit`); a step whose ``|loss|`` times the
scale the rule set would pass it takes the largest power of two ``S`` with ``S * |loss| <= limit``
instead, never below the minimum. One arithmetic, :func:`guard_scale_host`, in three places:

- :func:`guard_scale_host`: the arithmetic, in float64 on the host (a CPU scaler's form);
- :func:`apply_guard`: the same ops on the scaler's device, no host sync (float64; float32 on MPS,
  which has no float64: the one place the forms may differ, and only for a loss whose quotient
  float32 cannot hold);
- :func:`guarded_scale`: the environments' and replays' form, :func:`guard_scale_host` itself.

Whether there is a guard at all is decided in one place, :func:`guards`: a rule's limit that is
None or not positive means no guard (no rule gives one <= 0; the device ops would turn a negative
limit into NaN), so the scaler and the environments skip the guard alike.

A policy that acts at scale time (:attr:`~autoscale.scalers.controller.ScaleRule.scale_time`)
decides the step's scale from its loss itself, through the same place in the scaler;
:func:`step_scale_host` is the environments' entry for both.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from autoscale.scalers.ranks import RankAgreement

__all__ = [
    "is_spike",
    "apply_guard",
    "apply_step_scale",
    "guard_on_host",
    "guard_scale_host",
    "guarded_scale",
    "guards",
    "step_scale_host",
]


def guards(limit: float | None) -> bool:
    """Whether a rule's ``limit`` guards a step: a positive limit does; None or <= 0 does not."""
    return limit is not None and limit > 0


def apply_guard(
    scale: torch.Tensor,
    loss: torch.Tensor,
    limit: float,
    min_scale: float,
    set_scale: float,
    group: Any,
) -> torch.Tensor | None:
    """Write this step's guarded scale into ``scale`` (the scaler's scale tensor).

    Returns the guarded scale as a float64 tensor on the device (float32 on MPS), or None where
    it was computed on the host (a CPU scaler outside torch.distributed: reading the loss is no
    sync there). Under torch.distributed the ranks agree on the largest ``|loss|`` first, so that
    they scale alike; a NaN on any rank keeps the set scale everywhere."""
    dev = scale.device
    if dev.type == "cpu" and loss.device.type == "cpu" and group is None:
        guard_on_host(scale, loss, limit, min_scale, set_scale)
        return None
    exact = torch.float32 if dev.type == "mps" else torch.float64  # MPS has no float64
    g = loss.to(dev, exact, copy=True).abs_()  # a copy: every op below works in place
    if group is not None:
        g = RankAgreement.max_loss(g, group)
    # few ops, in place: this runs every step. A non-finite |loss| becomes 0, so the quotient
    # is inf and the clamp keeps the set scale; a zero loss gives inf too
    torch.div(limit, g.nan_to_num_(nan=0.0, posinf=0.0), out=g)
    g.log2_().floor_().exp2_().clamp_(min=min_scale, max=set_scale)
    scale.copy_(g)
    return g  # the same value (a power of two or a bound: float32 holds it)


def guard_on_host(
    scale: torch.Tensor, loss: torch.Tensor, limit: float, min_scale: float, set_scale: float
) -> float:
    """:func:`apply_guard` where ``scale`` and ``loss`` are CPU tensors and no ranks agree: the
    same float64 arithmetic on the host (IEEE division, the C library's log2 as torch's scalar
    kernel calls it, an exact power of two, the clamp) and one fill, instead of nine tensor
    ops. Returns the step's scale (a CPU scaler calls it directly: it knows where it runs).
    ``scale`` holds ``set_scale`` when a step starts: most steps the guard keeps it, no fill."""
    value = guard_scale_host(limit, float(loss), min_scale, set_scale)
    if value != set_scale:
        scale.fill_(value)
    return value


def guard_scale_host(limit: float, loss: float, min_scale: float, max_scale: float) -> float:
    """The guard's scale from a host loss, as :func:`apply_guard`'s device ops compute it: a
    non-finite or zero ``|loss|`` keeps ``max_scale`` (the set scale); else the largest power of
    two S with S * |loss| <= limit, clamped to [min_scale, max_scale]."""
    m = abs(loss)
    q = limit / m if (0.0 < m < math.inf) else math.inf
    if q < math.inf:
        q = 2.0 ** math.floor(math.log2(q)) if q > 0.0 else 0.0
    return min(max(q, min_scale), max_scale)


def guarded_scale(scale: float, loss: float, limit: float | None, min_scale: float) -> float:
    """The scale a step with ``loss`` takes under a rule's guard ``limit`` when the rule set
    ``scale``: :func:`guard_scale_host` where :func:`guards` (the environments' and replays' form
    of what :func:`apply_guard` does on the scaler's device), else ``scale``."""
    return guard_scale_host(limit, loss, min_scale, scale) if guards(limit) else scale


def is_spike(rule: Any, loss: float) -> bool:
    """Whether a step with ``loss`` is a spike ``rule`` skips (its
    :meth:`~autoscale.scalers.controller.ScaleRule.spike_limit`, read before the step): the
    environments' and replays' form of the scaler's test (a finite ``|loss|`` above the limit)."""
    if getattr(rule, "scale_time", False):
        return False
    limit = rule.spike_limit()
    return limit is not None and limit < abs(loss) < math.inf


def step_scale_host(rule: Any, scale: float, loss: float, bounds: Any) -> float:
    """The scale a step with ``loss`` takes under ``rule`` (a rule with a guard, or one acting at
    scale time) when the rule set ``scale``: the environments' and replays' host twin of the
    scaler's device path. ``bounds``: the :class:`~autoscale.scalers.controller.ScaleBounds`."""
    if getattr(rule, "scale_time", False):
        return rule.step_scale(scale, loss, bounds)
    return guarded_scale(scale, loss, rule.guard_limit(), bounds.min_scale)


def apply_step_scale(
    rule: Any, scale: torch.Tensor, loss: torch.Tensor, bounds: Any, set_scale: float, group: Any
) -> torch.Tensor | None:
    """Write the scale a rule acting at scale time picks for this step into ``scale`` (the
    scaler's scale tensor): through the rule's own ``apply_step_scale`` where it has one (an
    exported policy decides on the device), else from the loss read on the host with
    ``rule.step_scale`` (a host sync on a GPU; under torch.distributed the ranks read the
    largest ``|loss|`` first, so that they agree). Returns the scale as a device tensor, or None
    where it was set from the host."""
    own = getattr(rule, "apply_step_scale", None)
    if own is not None:
        return own(scale, loss, bounds, set_scale, group)
    g = loss.detach().reshape(())
    if group is not None:
        g = RankAgreement.max_loss(g.to(scale.device, torch.float32, copy=True).abs_(), group)
    scale.fill_(rule.step_scale(set_scale, float(g), bounds))
    return None
