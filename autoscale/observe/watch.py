"""`Watch`: what a scaler did each step, measured once and handed to sinks (a record, live logs).

A :class:`Watch` is an observer of a :class:`~autoscale.scalers.LossScaler`
(:meth:`~autoscale.scalers.LossScaler.add_observer`). It reads what the scaler has already
computed (the step's scale, found-inf, loss, gradient amax and RMS, all on the host after
``update()``: the rule's gradient amax is switched on if it was not) and adds, every
``hist_every`` steps, a log2|g| histogram of the unscaled gradients and their RMS (where the rule
computes no RMS of its own: on other steps the record's RMS is NaN)
(one copy of |g| into a reused buffer, a shift and a ``bincount``: no Python loop over
parameters). Device tensors (the histograms, the backward's amax) are gathered to the host once
every ``flush_every`` steps in one copy, so on CUDA the watch adds no host sync per step beyond
the scaler's own. Imports torch only.
"""

from __future__ import annotations

import atexit
import math
import os
import time
import weakref
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoscale.observe.lifecycle import holding_signals
from autoscale.observe.record import HIST_HI, HIST_LO, RecordWriter, underflow_share
from autoscale.scalers.controller import FP16_MAX
from autoscale.scalers.grad_stats import FlatAbs

__all__ = [
    "BackwardAmaxMode",
    "Sink",
    "StepObserver",
    "Watch",
    "log2_histogram",
]


class StepObserver(Protocol):
    """What :meth:`LossScaler.add_observer` calls (each may do nothing): ``on_scale(scaler,
    loss)`` when a loss is scaled; ``on_grads(scaler, optimizer, grads, inv_scale)`` when the
    gradients are read for the statistics (unscaled when ``inv_scale`` is None, else scaled by
    ``1 / inv_scale``); ``on_update(scaler, stats)`` after the rule set the next scale."""

    def on_scale(self, scaler: Any, loss: torch.Tensor) -> None: ...

    def on_grads(
        self, scaler: Any, optimizer: Any, grads: list[torch.Tensor], inv_scale: float | None
    ) -> None: ...

    def on_update(self, scaler: Any, stats: Any) -> None: ...


class Sink(Protocol):
    """Receives the watched steps, in order, as record rows (see :mod:`autoscale.observe.record`)."""

    def write(self, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def log2_histogram(flat: torch.Tensor, subnormals: bool = True) -> torch.Tensor:
    """Counts (int64, 80 bins of 1 bit, log2 -64 .. +16, ends open) of ``floor(log2|x|)`` over the
    finite non-zero elements of ``flat`` (float32, non-negative, one dimension).

    Read from the float32 exponent bits (exact, where ``log2`` rounds values just below a power
    of two up a bin): one shift and one ``bincount``. Subnormal float32 values (below 2^-126)
    land in the first bin, or, with ``subnormals=False``, in none, like zeros and infinities and
    NaNs: that skips a count of the zeros (a third of the histogram's time on a CPU) and changes
    nothing that a loss scale below 2^100 could keep.
    """
    with torch.no_grad():
        biased = torch.bincount(flat.view(torch.int32) >> 23, minlength=256)
        if subnormals:  # zeros share exponent 0 with subnormals: take them out
            biased[0] -= flat.numel() - torch.count_nonzero(flat)
        else:
            biased[0] = 0
        lo, hi = HIST_LO + 127, HIST_HI - 1 + 127  # biased exponents of the first and last bin
        out = biased[lo : hi + 1].clone()
        out[0] += biased[:lo].sum()
        out[-1] += biased[hi + 1 : 255].sum()  # 255: inf and NaN
        return out


class BackwardAmaxMode(TorchDispatchMode):
    """Tracks ``max |x|`` over every tensor of ``dtype`` that an op produces while active.

    Around ``backward()`` it sees every fp16 tensor of the backward pass, intermediate activation
    gradients included, not only the parameter gradients. With ``backward_only`` it counts only
    ops run with grad mode off (the autograd engine runs backward so), so a forward pass of the
    next micro-batch inside the window is not counted. ``amax`` stays a device tensor (no host
    sync); NaN if any tensor held a NaN, None if none was seen. Costs a Python call per op.
    """

    def __init__(self, dtype: torch.dtype = torch.float16, backward_only: bool = False) -> None:
        super().__init__()
        self.dtype = dtype
        self.backward_only = backward_only
        self.amax: torch.Tensor | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.backward_only and torch.is_grad_enabled():
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == self.dtype and t.numel():
                m = t.detach().abs().amax().float()
                self.amax = m if self.amax is None else torch.maximum(self.amax, m)
        return out


class Watch:
    """Observes one scaler and hands each step, as a record row, to its sinks.

    Args:
        scaler: The :class:`~autoscale.scalers.LossScaler` to watch (attached at once).
        sinks: Where the rows go (:class:`RecordSink`, the live loggers of
            :mod:`autoscale.observe.live`).
        hist_every: A gradient histogram every this many steps (1: every step; 0: never).
        measure_threshold: Measure each step's overflow threshold from every fp16 tensor of its
            backward (:class:`BackwardAmaxMode`: a Python call per backward op, several times the
            step on small models); otherwise it is estimated from the parameter gradients' amax
            and marked so.
        flush_every: Hand rows to the sinks every this many steps, or sooner when
            ``flush_s`` seconds have passed (slow steps), and at :meth:`close`.
    """

    def __init__(
        self,
        scaler: Any,
        sinks: list[Sink],
        *,
        hist_every: int = 8,
        measure_threshold: bool = False,
        flush_every: int = 32,
        flush_s: float = 10.0,
    ) -> None:
        self.sinks = list(sinks)
        self.hist_every = int(hist_every)
        self.measure_threshold = bool(measure_threshold)
        self.flush_every = max(1, int(flush_every))
        self.flush_s = float(flush_s)
        self._flushed = time.monotonic()
        self._flat = FlatAbs()
        self._hist: torch.Tensor | None = None
        self._sumsq: torch.Tensor | None = None
        self._mode: BackwardAmaxMode | None = None
        self._bamax: torch.Tensor | None = None
        self._optimizer: Any = None
        self._pending: list[dict[str, Any]] = []
        self._last = time.monotonic()
        self.closed = False
        # counters for the one-line summary (host values only)
        self.steps = self.skipped = self.at_min = 0
        self.scale_lo = math.inf
        self.scale_hi = 0.0
        self._scaler = weakref.ref(scaler)
        self._pid = os.getpid()  # a forked child inherits the watch, not its files
        scaler.add_observer(self)
        atexit.register(self.close)

    # ------------------------------------------------------------------ observer
    def on_scale(self, scaler: Any, loss: torch.Tensor) -> None:
        if self.measure_threshold and self._mode is None and self._bamax is None:
            self._mode = BackwardAmaxMode(backward_only=True)
            self._mode.__enter__()

    def on_grads(self, scaler: Any, optimizer: Any, grads: list[torch.Tensor], inv_scale) -> None:
        self._end_backward()
        self._optimizer = optimizer
        if not grads or not self._hist_step(scaler.steps):
            return
        flat = self._flat.load(grads)
        if inv_scale is not None:
            flat.mul_(inv_scale)
        hist = log2_histogram(flat, subnormals=False)
        self._hist = hist if self._hist is None else self._hist + hist
        # the RMS from the same buffer, where the rule does not compute it (one dot product)
        sums = torch.stack(
            [torch.dot(flat, flat), torch.full((), float(flat.numel()), device=flat.device)]
        )
        self._sumsq = sums if self._sumsq is None else self._sumsq + sums

    def on_update(self, scaler: Any, stats: Any) -> None:
        self._end_backward()
        now = time.monotonic()
        scale = float(stats.scale)
        row: dict[str, Any] = {
            "step": int(stats.step),
            "scale": scale,
            "found_inf": bool(stats.found_inf),
            "loss": float(stats.loss) if stats.loss_seen else None,
            "loss_nonfinite": bool(stats.loss_nonfinite),
            "amax": float(stats.grad_amax),
            "rms": float(stats.grad_rms),
            "threshold": None,
            "threshold_measured": False,
            "guarded": bool(stats.guarded),
            "spiked": bool(getattr(stats, "spiked", False)),
            "lr": _lr(self._optimizer),
            "wall_s": now - self._last,
            "hist": self._hist,
            "_bamax": self._bamax,
            "_sumsq": self._sumsq if not math.isfinite(float(stats.grad_rms)) else None,
        }
        self._last = now
        self._hist = self._bamax = self._sumsq = None
        self.steps += 1
        self.skipped += row["found_inf"]
        self.at_min += scale <= scaler.min_scale
        self.scale_lo = min(self.scale_lo, scale)
        self.scale_hi = max(self.scale_hi, scale)
        self._pending.append(row)
        if len(self._pending) >= self.flush_every or now - self._flushed >= self.flush_s:
            self.flush()

    # ------------------------------------------------------------------ rows to the sinks
    def flush(self) -> None:
        """Bring the pending steps to the host (one copy) and hand them to the sinks; a signal
        waits until they are there (:func:`~autoscale.observe.lifecycle.holding_signals`)."""
        with holding_signals():
            self._flush()

    def _flush(self) -> None:
        rows, self._pending = self._pending, []
        self._flushed = time.monotonic()
        if not rows:
            return
        hists = [r["hist"] for r in rows if isinstance(r["hist"], torch.Tensor)]
        amaxes = [r["_bamax"] for r in rows if isinstance(r["_bamax"], torch.Tensor)]
        sums = [r["_sumsq"] for r in rows if isinstance(r["_sumsq"], torch.Tensor)]
        host_h = torch.stack(hists).cpu().tolist() if hists else []
        host_a = torch.stack([a.float() for a in amaxes]).cpu().tolist() if amaxes else []
        host_s = torch.stack([x.double() for x in sums]).cpu().tolist() if sums else []
        ih = ia = i_s = 0
        for r in rows:
            sumsq = r.pop("_sumsq")
            if isinstance(sumsq, torch.Tensor):
                total, count = host_s[i_s]
                i_s += 1
                if count > 0 and not r["found_inf"]:
                    r["rms"] = math.sqrt(total / count)
            if isinstance(r["hist"], torch.Tensor):
                r["hist"] = host_h[ih]
                ih += 1
            bamax = r.pop("_bamax")
            if isinstance(bamax, torch.Tensor):
                bamax = host_a[ia]
                ia += 1
            r["threshold"], r["threshold_measured"] = _threshold(r, bamax)
        for sink in list(self.sinks):
            try:
                sink.write(rows)
            except Exception as exc:  # a full disk or a deleted folder must not stop training
                self._drop(sink, exc)

    def sync(self) -> None:
        """Write every step taken so far where it goes (:meth:`flush`, and a record's chunk
        being filled is written now), and keep watching: what a signal handler calls when the
        program may go on."""
        self.flush()
        for sink in list(self.sinks):
            try:
                getattr(sink, "sync", lambda: None)()
            except Exception as exc:
                self._drop(sink, exc)

    def close(self) -> None:
        """Flush and close every sink; stop observing. Safe to call twice (atexit calls it).
        Does nothing in a forked child (the parent's files are the parent's to close)."""
        if self.closed or os.getpid() != self._pid:
            return
        self.closed = True
        self._end_backward()
        try:
            self.flush()
        finally:
            for sink in list(self.sinks):
                try:
                    sink.close()
                except Exception as exc:
                    self._drop(sink, exc)
            scaler = self._scaler()
            if scaler is not None:
                scaler.remove_observer(self)
            atexit.unregister(self.close)

    # ------------------------------------------------------------------ internals
    def _drop(self, sink: Sink, exc: Exception) -> None:
        """Stop writing to a sink that failed, and say so once on stderr."""
        import sys

        self.sinks = [s for s in self.sinks if s is not sink]
        where = getattr(sink, "path", type(sink).__name__)
        print(
            f"autoscale: stopped writing {where} ({type(exc).__name__}: {exc}); training goes on",
            file=sys.stderr,
        )

    def _hist_step(self, step: int) -> bool:
        return self.hist_every > 0 and step % self.hist_every == 0

    def _end_backward(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
            self._bamax = mode.amax


def _lr(optimizer: Any) -> float | None:
    try:
        lr = optimizer.param_groups[0]["lr"]
        return float(lr.item() if isinstance(lr, torch.Tensor) else lr)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return None


def _threshold(row: dict[str, Any], backward_amax: float | None) -> tuple[float, bool]:
    """(log2 overflow threshold, measured?) of a step; see :mod:`autoscale.observe.record`."""
    scale = row["scale"]
    if backward_amax is not None and math.isfinite(backward_amax) and backward_amax > 0:
        return math.log2(FP16_MAX * scale / backward_amax), True
    amax = row["amax"]
    # a step skipped as a loss spike (spike_bits) read its finite gradients: no overflow
    clean = not row["found_inf"] or (row.get("spiked", False) and math.isfinite(amax))
    if clean and math.isfinite(amax) and amax > 0:
        return math.log2(FP16_MAX / amax), False
    if clean and amax == 0:
        # every gradient flushed to zero at this scale: the threshold lies somewhere above
        # log2(65504 * scale / 2^-24), nobody knows where (NaN: replay cannot judge this step)
        return math.nan, False
    return math.log2(scale) - 1.0, False  # overflowed: only known to lie below the scale used


class RecordSink:
    """Writes the watched steps to a record folder (:class:`RecordWriter`), a chunk of
    ``chunk_steps`` at a time, and the chunk being filled every ``chunk_s`` seconds too."""

    def __init__(
        self,
        path: Any,
        meta: dict[str, Any],
        *,
        chunk_steps: int = 256,
        chunk_s: float = 30.0,
    ) -> None:
        self.writer = RecordWriter(path, meta)
        self.path = self.writer.path
        self.chunk_steps = int(chunk_steps)
        self.chunk_s = float(chunk_s)
        self._rows: list[dict[str, Any]] = []
        self._first = 0
        self._written = time.monotonic()
        self.steps = 0

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self._rows.append(row)
            self.steps += 1
            if len(self._rows) >= self.chunk_steps:
                self._write()
        if self._rows and time.monotonic() - self._written >= self.chunk_s:
            self._write()

    def _write(self) -> None:
        self.writer.write_chunk(self._first, self._rows)
        self._written = time.monotonic()
        if len(self._rows) >= self.chunk_steps:
            self._first += len(self._rows)
            self._rows = []

    def sync(self) -> None:
        """Write the chunk being filled now (it is rewritten whole as it fills)."""
        if self._rows:
            self._write()

    def close(self) -> None:
        if self._rows:
            self._write()
        self.writer.finish(steps=self.steps)


def underflow_of(row: dict[str, Any]) -> float | None:
    """The step's share of gradient elements below fp16's normal range, where it has a
    histogram and was not skipped."""
    if row.get("hist") is None or row["found_inf"]:
        return None
    return underflow_share(row["hist"], row["scale"])
