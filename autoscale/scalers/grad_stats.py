"""Gradient statistics on the scaler's hot path: the amax of a list of gradients, read in one pass.

:class:`~autoscale.scalers.scaler.LossScaler` calls these once per optimizer step, so they are
written for few tensor ops (each costs some microseconds on a CPU, more right after a backward
pass has evicted the caches) and few passes over the gradients:

- :func:`grad_amax`: ``max |g|`` over every gradient, one read of each;
- :func:`one_pass_grads`: the gradients of an optimizer when they allow the one-pass unscale
  (dense float32 tensors on one device), where ``max |g|`` is read from the scaled gradients and
  gives both the found-inf flag (:func:`nonfinite_flag`) and, times ``1/scale``, the unscaled
  amax: rounding is monotonic, so ``max_i fl(|g_i| * inv) == fl(max_i |g_i| * inv)`` exactly;
- :class:`FlatAbs`: ``|g|`` copied into one reused buffer, for instruments that read it too;
- :func:`grad_stats`: ``[amax, sum of squares, count]`` of the gradients, from that buffer or
  read in place.

Sharded gradients (FSDP2's DTensors) are read as this rank's shard (:func:`local_grad`): each
rank's statistics are of its own elements, and the agreement across ranks
(:mod:`~autoscale.scalers.ranks`) takes the max of the amaxes and the sum of the squares and
counts, which are those of the whole gradient. One-pass unscaling is not used for them: GradScaler's
unscale of DTensors agrees the found-inf flag across ranks by itself.
"""

from __future__ import annotations

import math
import sys

import torch

__all__ = [
    "AbsMax",
    "FlatAbs",
    "dtensor_class",
    "grad_amax",
    "grad_stats",
    "grad_sumsq",
    "grads_of",
    "local_grad",
    "nonfinite_flag",
    "one_pass_grads",
    "stack_on",
    "stats_vector",
]


#: Gradient elements (float32) that stay in a core's cache between two passes over them.
CACHED_ELEMENTS = 1 << 14
_numel = torch.Tensor.numel


def grad_amax(grads: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """max |g| over all gradients, a float32 0-dim tensor on ``dev`` (NaN if any element is NaN,
    inf if any is infinite and none is NaN)."""
    if grads[0].device.type != "cpu":
        return stack_on(torch._foreach_norm(grads, math.inf), dev).amax()
    # On CPU, _foreach_norm(inf) is an unvectorized loop, and abs + max allocates a copy of every
    # gradient (page faults each step); aminmax reads each gradient once without allocating, the
    # cheapest exact max |g| of torch's CPU ops (experiments/results/amax_read.md). max |g| of a
    # tensor is the larger of |min| and |max|: one stack of all of them, one inf-norm (abs and max
    # in one op).
    return torch.linalg.vector_norm(
        stack_on([t for g in grads for t in torch.aminmax(g)], dev), math.inf
    )


def grads_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients of ``optimizer`` that hold elements on this rank (a sparse one's values, a
    sharded one's local shard)."""
    dtensor, plain = dtensor_class(), torch.Tensor
    grads = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            # (isinstance of a Tensor subclass costs far more than the type test most gradients
            # stop at)
            if type(g) is not plain and dtensor is not None and isinstance(g, dtensor):
                g = local_grad(g)
            if g.is_sparse:
                g = g._values()
            if g.numel():
                grads.append(g)
    return grads


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` where that module is imported, else None: a DTensor
    exists only then, and a scaler imports nothing for it."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor gradient (FSDP2's ``fully_shard``), sharing its storage (an
    in-place unscale of it unscales the DTensor); any other gradient as it is. Statistics read
    the shard: DTensor ops on a sharded gradient refuse a reshape of its sharded dimension, and a
    collective on one has no sharding rule."""
    dtensor = dtensor_class()
    if dtensor is None or not isinstance(grad, dtensor):
        return grad
    with torch.no_grad():  # the local tensor itself, not an autograd view of it
        return grad.to_local()


def grad_stats(
    grads: list[torch.Tensor],
    dev: torch.device,
    inv_scale: torch.Tensor | float | None,
    rms: bool,
    flat: FlatAbs | None = None,
    step: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[amax, sumsq, count]`` of ``grads`` (float32 on ``dev``; sumsq NaN unless ``rms``),
    times ``inv_scale`` (and its square) where the gradients are still scaled; and the sum of
    squares of the unscaled gradients where it came from ``flat`` (for a caller that clips),
    else None. No host sync.

    With ``flat`` (CPU gradients), ``|g|`` is copied into it first, for an instrument that reads
    it too, and the statistics come from that copy (one max, one dot); without, each gradient is
    read in place, which is cheaper when nothing else reads the copy (a copy, abs and max costs
    more than aminmax in place: ``experiments/results/amax_read.md``)."""
    if not grads:
        return torch.zeros(3, device=dev), None
    with torch.no_grad():
        norm = None
        if flat is not None and dev.type == "cpu" and all(g.device.type == "cpu" for g in grads):
            buf = flat.load(grads, unscaled=inv_scale is None, step=step)
            amax = buf.max()
            sumsq = torch.dot(buf, buf) if rms else None
            if inv_scale is None and sumsq is not None:
                norm = sumsq
        else:
            amax = grad_amax(grads, dev)
            sumsq = grad_sumsq(grads, dev) if rms else None
        return stats_vector(grads, dev, amax, sumsq, inv_scale), norm


def grad_sumsq(grads: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """The float32 sum of the squares of every gradient element, on ``dev`` (each norm taken
    in float32, float64 gradients' in float64: a norm does not narrow its input)."""
    wide = [g for g in grads if g.dtype is torch.float64]
    if not wide:
        return stack_on(torch._foreach_norm(grads, 2, dtype=torch.float32), dev).square().sum()
    rest = [g for g in grads if g.dtype is not torch.float64]
    norms = list(torch._foreach_norm(wide, 2))
    if rest:
        norms += torch._foreach_norm(rest, 2, dtype=torch.float32)
    return stack_on([n.float() for n in norms], dev).square().sum()


def stats_vector(
    grads: list[torch.Tensor],
    dev: torch.device,
    amax: torch.Tensor,
    sumsq: torch.Tensor | None,
    inv_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``[amax, sumsq, count]`` on ``dev`` (sumsq NaN where None), times ``inv_scale`` (and its
    square) where ``amax`` and ``sumsq`` are of still-scaled gradients."""
    if sumsq is None:
        sumsq = torch.full((), math.nan, device=dev)
    if inv_scale is not None:
        amax, sumsq = amax * inv_scale, sumsq * (inv_scale * inv_scale)
    # torch.full, not torch.tensor: no host-to-device copy (a stream sync on CUDA)
    count = torch.full((), float(sum(g.numel() for g in grads)), device=dev)
    return torch.stack([amax, sumsq, count])


class AbsMax:
    """:func:`grad_amax` of dense float32 gradients (:func:`one_pass_grads`), with each tensor's
    min and max written by ``aminmax`` straight into a buffer kept between steps: no stack of
    2n small tensors per step (on CPU; elsewhere :func:`grad_amax`'s fused norm). :meth:`read`
    also multiplies and takes the sum of squares in the same pass."""

    def __init__(self) -> None:
        self._minmax = self._norms = torch.empty(0)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._norm_outs: list[torch.Tensor] = []

    def _fit(self, n: int) -> None:
        """Buffers for ``n`` gradients: [min, max] of each, then the 2-norm of each."""
        if len(self._pairs) != n:
            buf = torch.empty(3 * n)
            self._minmax, self._norms = buf[: 2 * n], buf[2 * n :]
            self._pairs = list(zip(buf[0 : 2 * n : 2].unbind(), buf[1 : 2 * n : 2].unbind()))
            self._norm_outs = list(self._norms.unbind())

    def __call__(
        self, grads: list[torch.Tensor], dev: torch.device, then_mul: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The amax of ``grads`` as they are; then, with ``then_mul``, each gradient multiplied
        in place by it."""
        return self.read(grads, dev, then_mul)[0]

    def read(
        self,
        grads: list[torch.Tensor],
        dev: torch.device,
        then_mul: torch.Tensor | None = None,
        sumsq: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(amax, sum of squares)`` of ``grads``: the amax as they are; then, with
        ``then_mul``, each gradient multiplied in place by it; then, with ``sumsq``, the float32
        sum of their squares as they are now (else None). On a CPU each gradient gets all three
        right after its own read, while it is still in cache (the multiply costs less than a
        second pass over all of them, ``experiments/results/amax_read.md``); the squares are
        summed per tensor by the kernel ``torch._foreach_norm`` runs there: the same bits.
        Gradients of at most :data:`CACHED_ELEMENTS` elements each stay in cache anyway: all
        are read, then one ``_foreach_mul_`` multiplies them (fewer ops; the same products)."""
        if grads[0].device.type != "cpu":
            amax = grad_amax(grads, dev)
            if then_mul is not None:
                torch._foreach_mul_(grads, then_mul)
            return amax, grad_sumsq(grads, dev) if sumsq else None
        self._fit(len(grads))
        if then_mul is not None and not sumsq and max(map(_numel, grads)) <= CACHED_ELEMENTS:
            # gradients that fit in cache: one multiply over all of them after their reads
            # (each op costs microseconds; a pass per gradient saves nothing here)
            for g, out in zip(grads, self._pairs):
                torch.aminmax(g, out=out)
            torch._foreach_mul_(grads, then_mul)
        else:
            for g, out, norm in zip(grads, self._pairs, self._norm_outs):
                torch.aminmax(g, out=out)
                if then_mul is not None:
                    g.mul_(then_mul)
                if sumsq:
                    torch.linalg.vector_norm(g, 2, dtype=torch.float32, out=norm)
        amax = torch.linalg.vector_norm(self._minmax, math.inf).to(dev)
        return amax, self._norms.square().sum().to(dev) if sumsq else None

    def unscale_on_host(
        self, grads: list[torch.Tensor], inv: torch.Tensor, found: torch.Tensor
    ) -> float:
        """Unscale CPU ``grads`` in place, reading each gradient's min and max first, and set
        the found-inf flag ``found`` (a zero float32 tensor) as GradScaler's unscale does;
        return their amax, as they were, on the host: what :meth:`read` gives, without the
        small ops that make it a tensor and the flag from it (each op costs microseconds on a
        CPU; a read costs none there). Gradients that fit in cache are unscaled by GradScaler's
        own kernel (``torch._amp_foreach_non_finite_check_and_unscale_``: the same products,
        and the flag, in one op); a large gradient is multiplied right after its own read,
        while it is in cache (``experiments/results/amax_read.md``)."""
        self._fit(len(grads))
        small = max(map(_numel, grads)) <= CACHED_ELEMENTS
        for g, out in zip(grads, self._pairs):
            torch.aminmax(g, out=out)
            if not small:
                g.mul_(inv)
        if small:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        ends = self._minmax.tolist()
        if math.isfinite(sum(ends)):  # every element finite (12 floats of float32 sum finite)
            return max(map(abs, ends))
        if not small:
            found.fill_(1.0)
        # an inf or NaN: the norm's order (NaN first, then inf), as read gives
        return torch.linalg.vector_norm(self._minmax, math.inf).item()


def nonfinite_flag(amax: torch.Tensor) -> torch.Tensor:
    """GradScaler's found-inf flag from an amax: float32 1.0 where ``amax`` is inf or NaN, else
    0.0 (two ops: ``amax - amax`` is 0 exactly when it is finite)."""
    return torch.sub(amax, amax).nan_to_num_(nan=1.0)


def one_pass_grads(
    optimizer: torch.optim.Optimizer, dev: torch.device
) -> list[torch.Tensor] | None:
    """The gradients of ``optimizer`` that hold elements, if every gradient is a dense float32
    tensor on ``dev`` and one at least holds elements; else None (another dtype, a sparse
    gradient, several devices, a DTensor, nothing to read: the general path, GradScaler's own,
    handles it).

    For float32 gradients, GradScaler's unscale is ``fl(g * inv)`` in float32, the same product
    as ``torch._foreach_mul_`` computes, so reading the amax first and multiplying after gives
    the gradients, the found-inf flag and the amax of the general path, bit for bit.
    """
    dtensor, plain, f32, strided = dtensor_class(), torch.Tensor, torch.float32, torch.strided
    on_cpu = dev.type == "cpu"  # (is_cpu: no device object made per gradient)
    grads = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if type(g) is not plain and dtensor is not None and isinstance(g, dtensor):
                return None  # GradScaler's unscale of DTensors agrees found-inf across ranks
            if (
                g.dtype is not f32
                or g.layout is not strided
                or not (g.is_cpu if on_cpu else g.device == dev)
            ):
                return None
            if g.numel():
                grads.append(g)
    return grads or None


def stack_on(tensors: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """Stack 0-dim tensors as float32 on ``dev`` (one op unless they live on several devices)."""
    try:
        out = torch.stack(tensors)
    except RuntimeError:  # model split across devices
        out = torch.stack([t.to(dev) for t in tensors])
    return out.to(dev, torch.float32)


class FlatAbs:
    """``|g|`` of a list of gradients in one float32 buffer reused from step to step.

    One batched ``cat`` and an in-place ``abs``: no Python loop over tensors beyond gathering them
    and no allocation per step (on CPU a fresh gradient-sized allocation costs page faults every
    step).
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self._step: int | None = None  # the step whose unscaled gradients the buffer holds

    def load(
        self, grads: list[torch.Tensor], *, unscaled: bool = True, step: int | None = None
    ) -> torch.Tensor:
        """Copy ``|g|`` of every gradient into the buffer (on ``grads[0]``'s device); return it."""
        device = grads[0].device
        n = sum(g.numel() for g in grads)
        if self.buffer is None or self.buffer.numel() != n or self.buffer.device != device:
            self.buffer = torch.empty(n, dtype=torch.float32, device=device)
        with torch.no_grad():
            try:
                torch.cat([g.reshape(-1) for g in grads], out=self.buffer)
            except RuntimeError:  # gradients on several devices, or of several dtypes
                torch.cat([g.reshape(-1).to(device, torch.float32) for g in grads], out=self.buffer)
            self.buffer.abs_()
        self._step = step if unscaled else None
        return self.buffer

    def forget(self) -> None:
        """The buffer no longer holds the current step's gradients (the step ended)."""
        self._step = None

    def current(self, step: int) -> torch.Tensor | None:
        """The buffer if it holds the unscaled gradients of ``step``, else None."""
        return self.buffer if self._step is not None and self._step == step else None
