"""Unscaling on the scaler's hot path: 1/scale as GradScaler computes it, in fewer ops (the
one-pass unscale that reads the amax where GradScaler reads the found-inf flag is
:meth:`~autoscale.scalers.grad_reader.GradReader.unscale`)."""

from __future__ import annotations

import torch

from autoscale.scalers.controller import f32

__all__ = ["InverseScale"]


class InverseScale:
    """1/scale of a step as GradScaler's ``unscale_`` computes it (the reciprocal in float64,
    rounded to float32; in float32 on MPS): one op from the guard's scale where the guard ran on
    the device, else none for a scale seen lately (a tensor kept for each of the last few host
    scales). Valid until the next step's: read it within the step."""

    _KEEP = 16  # the 1/scale tensors of this many host scales (a guard's steps take a few)

    def __init__(self) -> None:
        self._cache: dict[tuple[float, torch.device], torch.Tensor] = {}  # 1/scale by scale
        self._buf: torch.Tensor | None = None  # 1/scale of a guarded step

    def __call__(
        self,
        scale: torch.Tensor,
        host_scale: float,
        guarded: bool,
        guard_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """``scale``: the scaler's scale tensor; ``host_scale``: the scale the rule set;
        ``guarded``: the guard ran this step, its scale in ``guard_scale`` (None where it was
        computed on the host of a CPU scaler: then ``scale`` holds it)."""
        dev = scale.device
        host = host_scale
        if guarded and guard_scale is None and dev.type == "cpu":
            host = float(scale)  # the guard's scale, set on the host (no sync on a CPU)
        elif guarded or dev.type == "mps":
            g = guard_scale if guarded else None
            if g is None:
                g = scale if dev.type == "mps" else scale.double()
            buf = self._buf
            if buf is None or buf.device != dev:
                buf = self._buf = torch.empty((), device=dev)
            return torch.reciprocal(g, out=buf)  # computed in g's dtype, rounded on the way out
        inv = self._cache.get((host, dev))
        if inv is None:
            if len(self._cache) >= self._KEEP:
                self._cache.clear()
            inv = self._cache[host, dev] = torch.full((), f32(1.0 / host), device=dev)
        return inv
