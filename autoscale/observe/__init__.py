"""A training run as it happens: watch a scaler, record its steps, log them live, and wrap a
program so that its own GradScaler is autoscale's (``autoscale wrap``).

Sits just above :mod:`autoscale.scalers` and imports torch only, so it can run inside any user's
program. The record format is :mod:`autoscale.observe.record`; the replay environments read it
through :func:`autoscale.envs.from_records.trace_from_record`.

Example::

    scaler = autoscale.get_scaler("auto", record="runs/x", log="csv:runs/x.csv")
    # ... train as with torch.amp.GradScaler; the record is written in chunks as it goes
    # then: autoscale report runs/x
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from autoscale.observe.record import RunRecord, is_record, read_record
from autoscale.observe.watch import RecordSink, Watch

__all__ = ["RunRecord", "Watch", "is_record", "read_record", "watch_scaler"]


def watch_scaler(
    scaler: Any,
    *,
    record: str | None = None,
    log: str | Sequence[str] | None = None,
    hist_every: int = 8,
    measure_threshold: bool = False,
    meta: dict[str, Any] | None = None,
    log_tag: str = "",
) -> Watch:
    """Watch ``scaler``: record its steps to a folder and/or log them live.

    Args:
        scaler: An autoscale scaler (:class:`~autoscale.scalers.LossScaler`).
        record: A folder for the record (created; it must not hold one already). Read it with
            :func:`read_record`, ``autoscale report`` or ``autoscale search --traces``.
        log: One or more live-log specs: ``csv:FILE``, ``tensorboard:DIR``, ``wandb:PROJECT``.
        hist_every: A gradient histogram every this many steps (the record's precision loss;
            steps between take the last one). 8 by default: a histogram costs a pass over every
            gradient element (a ``bincount``), and one every step adds a large share to a small
            model's step (``experiments/results/record_overhead.md``, "record hist 1").
        measure_threshold: Measure each step's overflow threshold from the backward's own fp16
            tensors (a Python call per backward op) instead of estimating it from the gradients.
        meta: More to keep in the record's ``meta.json``.
        log_tag: Keeps this scaler's live logs apart from another's of the same program
            (``PATH.<tag>.csv``, ``autoscale/<tag>/`` names in TensorBoard and W&B).

    Returns:
        The :class:`Watch`; it closes itself at exit (call ``close()`` to end the record sooner).

    Raises:
        ConfigError: an unwritable record folder or one that holds a record, a bad log spec.
    """
    import torch

    from autoscale import __version__
    from autoscale.observe.live import make_log_sink

    specs = [log] if isinstance(log, str) else list(log or [])
    sinks: list[Any] = [make_log_sink(s, log_tag) for s in specs]
    if record is not None:
        info = {
            "autoscale": __version__,
            "torch": torch.__version__,
            "scaler": scaler.name,
            "spec": scaler.spec(),
            "min_scale": scaler.min_scale,
            "max_scale": scaler.max_scale,
            "device": scaler.device,
            "argv": list(sys.argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "hist_every": hist_every,
            "threshold": "measured" if measure_threshold else "estimated",
            **(meta or {}),
        }
        sinks.insert(0, RecordSink(record, info))
    return Watch(scaler, sinks, hist_every=hist_every, measure_threshold=measure_threshold)
