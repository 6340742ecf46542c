"""How a scaler reads an optimizer's gradients each step: the rule's statistics, the found-inf
flag from the amax where that saves a pass, and the ``|g|`` copy kept for an instrument.

:class:`GradReader` is :class:`~autoscale.scalers.scaler.LossScaler`'s delegate for this; it
works on one optimizer's GradScaler state (a dict) and writes the statistics tensor under
:data:`~autoscale.scalers.step_vector.STATS`, never a GradScaler member.
"""

from __future__ import annotations

from typing import Any

import torch

from autoscale.scalers import step_vector as sv
from autoscale.scalers.controller import f32
from autoscale.scalers.grad_stats import (
    AbsMax,
    FlatAbs,
    grad_stats,
    grads_of,
    nonfinite_flag,
    stats_vector,
)

__all__ = ["GradReader"]


def _grad_off() -> bool:
    """Turn autograd off, as ``torch.no_grad()`` does on entry; return whether it was on (for
    :func:`_grad_back`). Without the context's objects and calls: on the hot path of every step,
    ``with torch.no_grad()`` was a measurable share of a CPU step's cost
    (``experiments/results/scaler_overhead.md``)."""
    on = torch.is_grad_enabled()
    if on:
        torch._C._set_grad_enabled(False)
    return on


def _grad_back(on: bool) -> None:
    """Turn autograd back on where :func:`_grad_off` found it on."""
    if on:
        torch._C._set_grad_enabled(True)


class GradReader:
    """Reads gradients for a scaler: ``rms`` says whether the sum of squares is wanted,
    ``keep_abs`` whether ``|g|`` is copied into a buffer kept for :meth:`grad_abs`."""

    def __init__(self) -> None:
        self.rms = False
        self.keep_abs = False
        self._abs_max = AbsMax()
        self._flat: dict[int, FlatAbs] = {}  # per optimizer, for keep_abs
        self._norm: dict[int, tuple[int, torch.Tensor]] = {}  # per optimizer: (step, sumsq)

    def __getstate__(self) -> dict[str, Any]:
        # gradient-sized buffers keyed by optimizers of this process: not carried
        return {"rms": self.rms, "keep_abs": self.keep_abs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
        self.rms, self.keep_abs = state["rms"], state["keep_abs"]

    def unscale(
        self,
        state: dict[str, Any],
        grads: list[torch.Tensor],
        inv: torch.Tensor,
        dev: torch.device,
        host: bool = False,
    ) -> None:
        """Unscale ``grads`` (:func:`~autoscale.scalers.grad_stats.one_pass_grads`) in place,
        reading their amax first: one read of the scaled gradients gives the amax, whose
        finiteness is the found-inf flag, then one multiply by ``inv`` (GradScaler's kernel
        multiplies while it checks, and the amax was a second read of every gradient); with
        ``rms``, the sum of squares of the unscaled gradients in the same pass. The flag goes
        into ``state`` as GradScaler keeps it, the statistics under
        :data:`~autoscale.scalers.step_vector.STATS`: the unscaled amax (0-dim), or with ``rms``
        :func:`~autoscale.scalers.grad_stats.stats_vector`. The same gradients, flag and
        statistics as GradScaler's unscale followed by a read of them, bit for bit (rounding is
        monotonic). With ``host`` (a CPU scaler that reads its step on the host, without
        ``rms``), the amax goes under STATS as a host float, the same value
        (:meth:`~autoscale.scalers.grad_stats.AbsMax.unscale_on_host`)."""
        grad_mode = _grad_off()
        try:
            if host and not self.rms:
                found = torch.zeros((), device=dev)
                amax = self._abs_max.unscale_on_host(grads, inv, found)
                state[sv.STATS] = f32(amax * inv.item())  # float32's product of two float32s
                state["found_inf_per_device"] = {dev: found}
                return
            amax, sumsq = self._abs_max.read(grads, dev, then_mul=inv, sumsq=self.rms)
            unscaled = amax * inv
            state[sv.STATS] = stats_vector(grads, dev, unscaled, sumsq) if self.rms else unscaled
            state["found_inf_per_device"] = {dev: nonfinite_flag(amax)}
        finally:
            _grad_back(grad_mode)

    def unscale_plain(
        self, grads: list[torch.Tensor], inv: torch.Tensor, found: torch.Tensor
    ) -> None:
        """GradScaler's unscale of ``grads`` (:func:`~autoscale.scalers.grad_stats.one_pass_grads`:
        dense float32 on the flag's device) into the zero flag ``found``: its kernel, with
        autograd off as GradScaler runs it, without its ``_unscale_grads_``, which sorts every
        gradient by device and dtype in Python first (most of GradScaler's ``unscale_`` on a
        CPU: ``experiments/results/scaler_overhead.md``). No statistics are read."""
        grad_mode = _grad_off()
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        finally:
            _grad_back(grad_mode)

    def amax(
        self, state: dict[str, Any], grads: list[torch.Tensor], inv: Any, dev: torch.device
    ) -> None:
        """The statistics of still-scaled ``grads`` times ``inv``: the amax alone, or with
        ``rms`` the statistics vector (both read in one pass over each gradient)."""
        grad_mode = _grad_off()
        try:
            amax, sumsq = self._abs_max.read(grads, dev, sumsq=self.rms)
            state[sv.STATS] = stats_vector(grads, dev, amax, sumsq, inv) if self.rms else amax * inv
        finally:
            _grad_back(grad_mode)

    def collect(
        self,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        dev: torch.device,
        inv_scale: Any,
        step: int,
        observe: Any,
    ) -> None:
        """The statistics of every gradient of ``optimizer`` (scaled by ``1/inv_scale`` when
        that is given), after ``observe(grads)``."""
        grads = grads_of(optimizer)
        observe(grads)
        flat = None
        if self.keep_abs and dev.type == "cpu":
            flat = self._flat.get(id(optimizer))
            if flat is None:
                flat = self._flat[id(optimizer)] = FlatAbs()
        state[sv.STATS], norm = grad_stats(grads, dev, inv_scale, self.rms, flat, step)
        if norm is not None and not any(
            p.grad.is_sparse
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ):  # (an uncoalesced sparse gradient's values repeat indices: no norm of it here)
            self._norm[id(optimizer)] = (step, norm)

    @staticmethod
    def found_inf(state: dict[str, Any], dev: torch.device) -> None:
        """The found-inf flag from the statistics' amax (non-finite exactly when a gradient
        element is: NaN and inf propagate through it)."""
        stats = state[sv.STATS]
        state["found_inf_per_device"] = {
            dev: nonfinite_flag(stats if stats.dim() == 0 else stats[0])
        }

    def grad_norm(self, optimizer: torch.optim.Optimizer, step: int) -> torch.Tensor | None:
        """The 2-norm of ``optimizer``'s unscaled gradients at ``step`` (a float32 device tensor,
        no host sync) where the statistics computed it from the ``|g|`` copy; else None. For a
        caller that clips, instead of a second pass over every gradient."""
        entry = self._norm.get(id(optimizer))
        return entry[1].sqrt() if entry is not None and entry[0] == step else None

    def grad_abs(self, optimizer: torch.optim.Optimizer, step: int) -> torch.Tensor | None:
        """``|g|`` of ``optimizer``'s unscaled gradients at ``step``, flat (float32), if the
        statistics put them in the buffer (on CPU, after ``unscale_``, with ``keep_abs``); else
        None. Valid until the next step's ``unscale_``."""
        buf = self._flat.get(id(optimizer))
        return buf.current(step) if buf is not None else None

    def forget(self) -> None:
        """The kept ``|g|`` and norm no longer hold the current step's gradients."""
        for buf in self._flat.values():
            buf.forget()
        self._norm.clear()
