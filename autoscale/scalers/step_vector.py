"""One step's outcome in one small tensor: packed on the device, read on the host in one sync.

:class:`~autoscale.scalers.scaler.LossScaler` packs, per optimizer, the found-inf flag, the
gradient statistics the rule reads, the losses scaled since the last packing and (on a guarded
step) the step's own scale into one vector (:func:`pack`, or :func:`pack_agreed` across ranks),
and brings every optimizer's vector to the host with one ``tolist`` (:func:`read`). The vector
and its :class:`Layout` travel in the optimizer's GradScaler state under :data:`VEC` and
:data:`LAYOUT`; the host values under :data:`HOST` (a :class:`HostStep`) and :data:`USED`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from autoscale.scalers.controller import StepStats

__all__ = [
    "HOST",
    "LAYOUT",
    "STATS",
    "USED",
    "VEC",
    "HostStep",
    "Layout",
    "pack",
    "pack_agreed",
    "merged_flag",
    "pack_into",
    "mean_spike",
    "mark_spike",
    "read",
    "step_stats",
]

# keys of the packed step in an optimizer's GradScaler state
STATS = "autoscale_stats"  # the statistics tensor: 0-dim amax, or [amax, sumsq, count]
VEC = "autoscale_vec"  # the packed vector on the device
LAYOUT = "autoscale_layout"  # its Layout
HOST = "autoscale_host"  # the HostStep read from it
USED = "autoscale_used"  # a guarded step's scale, read from it


class Layout(NamedTuple):
    """What a packed vector holds, in order: ``[flag, stats..., loss_sum?, scale?]`` on one rank;
    ``[flag, amax, sumsq, count, loss_sum, loss_count, scale?]`` when agreed across ranks."""

    stats: int  # 0 (none), 1 (the amax alone) or 3 (amax, sumsq, count)
    n_loss: int  # losses summed in it on one rank (0: no loss element); -1 when agreed
    agreed: bool  # reduced across ranks: the second form
    guarded: bool  # the step's own scale is the last element (before the spike's)
    spiked: bool = False  # the spike test's outcome (1.0: a spike) is the last element


class HostStep(NamedTuple):
    """The host values of one optimizer's packed step."""

    found: bool
    amax: float
    sumsq: float
    count: float
    loss_sum: float
    loss_count: float
    spiked: bool = False  # skipped as a loss spike (found is set too)


def pack(
    flag: torch.Tensor,
    stats: torch.Tensor | None,
    loss: torch.Tensor | None,
    n_loss: int,
    guard_scale: torch.Tensor | None,
    dev: torch.device,
    spike: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Layout]:
    """One rank's vector: as few ops as possible, this runs every step."""
    parts = [flag] + ([] if stats is None else [stats])
    if loss is not None:
        parts.append(loss.to(dev).float())
    if guard_scale is not None:
        parts.append(guard_scale)
    if spike is not None:
        parts.append(spike.float())
    # statistics: none, the amax alone (0-dim, one stack) or [amax, sumsq, count]
    vec = (
        torch.stack(parts)
        if stats is None or stats.dim() == 0
        else torch.cat([p.reshape(-1) for p in parts])
    )
    layout = Layout(
        0 if stats is None else stats.numel(),
        n_loss if loss is not None else 0,
        False,
        guard_scale is not None,
        spike is not None,
    )
    return vec, layout


def pack_agreed(
    flag: torch.Tensor,
    stats: torch.Tensor | None,
    loss: torch.Tensor | None,
    n_loss: int,
    guard_scale: torch.Tensor | None,
    dev: torch.device,
    gather: Any,
    spike: torch.Tensor | None = None,
    limit: float | None = None,
) -> tuple[torch.Tensor, Layout]:
    """The vector every rank of a group agrees on: found-inf and amax by MAX (a NaN amax, from
    the gradients of an overflowing rank, counts as inf), the rest by SUM. ``gather(local)``
    returns every rank's ``local`` (one all_gather); the reduction is done here. ``spike``: the
    step's spike test, made already (the same on every rank); or ``limit``: make it here, on
    the gathered losses (a spike where any rank's mean ``|loss|`` passes it: every rank skips
    alike, and no collective of its own)."""
    if stats is None:
        stats = torch.full((3,), math.nan, device=dev)
    total = torch.zeros((), device=dev) if loss is None else loss.to(dev).float()
    local = torch.cat(
        [flag.reshape(1), stats, total.reshape(1), torch.full((1,), float(n_loss), device=dev)]
        + ([guard_scale.reshape(1)] if guard_scale is not None else [])
        + ([spike.reshape(1).float()] if spike is not None else [])
    )
    local[1] = torch.where(torch.isnan(local[1]), math.inf, local[1])
    table = torch.stack(gather(local))
    # (a guarded step's scale and a spike test made already, last, are the same on every rank:
    # the loss was agreed)
    parts = [table[:, :2].amax(0), table[:, 2:6].sum(0), table[:, 6:].amax(0)]
    if limit is not None:
        spike = mean_spike(table[:, 4], table[:, 5], limit, dev).any().reshape(1).float()
        parts[0][:1] = torch.maximum(parts[0][:1], spike)  # skipped as an overflow is
        parts.append(spike)
    vec = torch.cat(parts)
    return vec, Layout(3, -1, True, guard_scale is not None, spike is not None)


def mean_spike(
    loss_sum: torch.Tensor, n_loss: torch.Tensor | float, limit: float, dev: torch.device
) -> torch.Tensor:
    """Whether the mean loss ``loss_sum / n_loss`` (float32 sums, as a vector holds them) is
    finite and above the spike ``limit``, as a bool tensor on ``dev``: the host's test (the
    quotient in float64; float32 on MPS, which has none), without a sync. No loss (0 / 0) is
    no spike."""
    exact = torch.float32 if dev.type == "mps" else torch.float64
    m = (loss_sum.to(dev, torch.float32).to(exact) / n_loss).abs()
    return (m > limit).logical_and_(m < math.inf)


def read(states: list[dict[str, Any]]) -> None:
    """Bring the packed vectors of these states to the host in one sync: each state gets its
    :class:`HostStep` (and a guarded step's scale); states read before are left as they are."""
    todo = [s for s in states if HOST not in s]
    if not todo:
        return
    vecs = [s[VEC] for s in todo]
    flat = (vecs[0] if len(vecs) == 1 else torch.cat([v.reshape(-1) for v in vecs])).tolist()
    i = 0
    for s, v in zip(todo, vecs):
        n = v.numel()
        row, i = flat[i : i + n], i + n
        layout: Layout = s[LAYOUT]
        spiked = False
        if layout.spiked:
            spiked, row = row[-1] > 0, row[:-1]
        if layout.guarded:
            s[USED], row = row[-1], row[:-1]
        if layout.agreed:
            s[HOST] = HostStep(row[0] > 0, row[1], row[2], row[3], row[4], row[5], spiked)
            continue
        found = row[0] > 0
        amax, sumsq, count = (
            (row[1], row[2], row[3])
            if layout.stats == 3
            else (row[1] if layout.stats else math.nan, math.nan, 0.0)
        )
        loss_sum = row[-1] if layout.n_loss else 0.0
        s[HOST] = HostStep(found, amax, sumsq, count, loss_sum, float(layout.n_loss), spiked)


def merged_flag(per_device: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """GradScaler's found-inf flags of one optimizer (one per device) as one flag on ``dev``."""
    if len(per_device) == 1 and per_device[0].device == dev:
        return per_device[0]
    if per_device:
        # a copy to the host must block: a non-blocking one would be read (tolist) before it
        # lands; device-bound copies may overlap
        return sum(t.to(dev, non_blocking=dev.type != "cpu") for t in per_device)
    return torch.zeros((), device=dev)  # a loss scaled after every optimizer's agreement


def step_stats(
    states: list[dict[str, Any]], step: int, set_scale: float, with_stats: bool, with_rms: bool
) -> tuple[StepStats, float | None]:
    """The :class:`StepStats` of one step from its optimizers' packed states (read here, one
    sync), and the scale a guarded step used (None when the guard did not run)."""
    if len(states) != 1 or HOST not in states[0]:  # (a CPU scaler read its one already)
        read(states)
    if len(states) == 1:  # one optimizer, most loops: its values as they are
        state = states[0]
        h: HostStep = state[HOST]
        used = state.get(USED)
        found, amax, sumsq, count, spiked = h.found, h.amax, h.sumsq, h.count, h.spiked
        loss = h.loss_sum / h.loss_count if h.loss_count else None
    else:
        host: list[HostStep] = [s[HOST] for s in states]
        used = next((s[USED] for s in states if USED in s), None)
        found = any(h.found for h in host)
        spiked = any(h.spiked for h in host)
        amax = max((h.amax for h in host), default=math.nan)
        sumsq = sum(h.sumsq for h in host)
        count = sum(h.count for h in host)
        loss_count = sum(h.loss_count for h in host)
        loss = sum(h.loss_sum for h in host) / loss_count if loss_count else None
    if not with_stats:
        amax = rms = math.nan
    elif not with_rms:
        rms = math.nan
    else:
        rms = (
            math.sqrt(sumsq / count)
            if count > 0 and math.isfinite(sumsq)
            else (math.inf if count else math.nan)
        )
    stats = StepStats(
        step,
        set_scale if used is None else used,
        found,
        amax,
        rms,
        math.nan if loss is None else loss,
        loss is not None,
        used is not None and used < set_scale,
        spiked,
    )
    return stats, used


def mark_spike(flags: dict[Any, torch.Tensor], spike: torch.Tensor) -> None:
    """Skip a step the spike test flagged as an overflow is skipped: each found-inf flag becomes
    ``max(flag, spike)``, on its device (no host sync)."""
    for f in flags.values():
        torch.maximum(f, spike.to(f.device, f.dtype), out=f)


def pack_into(
    state: dict[str, Any],
    stats: torch.Tensor | None,
    loss: torch.Tensor | None,
    n_loss: int,
    guard: torch.Tensor | None,
    dev: torch.device,
    gather: Any,
    spike: torch.Tensor | None = None,
    limit: float | None = None,
) -> torch.Tensor | None:
    """Pack one optimizer's step into its GradScaler ``state``: the found-inf flag GradScaler
    recorded, ``stats``, the losses scaled since the last packing and a guarded step's scale;
    agreed across ranks where ``gather`` is given (then the flag GradScaler and fused kernels
    read is replaced by the agreed one). The spike test: its outcome where ``spike`` is given
    (made at an earlier agreement of the step), or made here from the mean loss where
    ``limit`` is, the flags set where it is a spike; returns it then (a device tensor), else
    None. No host sync."""
    flags = state["found_inf_per_device"]
    if limit is not None and gather is None:
        if loss is None:
            spike = torch.zeros((), dtype=torch.bool, device=dev)
        else:
            spike = mean_spike(loss, n_loss, limit, dev)
        mark_spike(flags, spike)
    flag = merged_flag(list(flags.values()), dev)
    if gather is None:
        state[VEC], state[LAYOUT] = pack(flag, stats, loss, n_loss, guard, dev, spike)
        return spike if limit is not None else None
    vec, state[LAYOUT] = pack_agreed(flag, stats, loss, n_loss, guard, dev, gather, spike, limit)
    state[VEC] = vec
    if flags:
        state["found_inf_per_device"] = {dev: vec[0].clone()}
    return vec[-1] if limit is not None else None
