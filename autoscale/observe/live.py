"""Live logs of a watched scaler: CSV, TensorBoard, Weights & Biases.

Each is a sink of :class:`~autoscale.observe.watch.Watch` and logs, per step: the scale (and its
log2), whether the step was skipped, the skipped steps so far, the gradient amax and the share of
gradient elements below fp16's range (on the steps with a histogram). A spec names one:
``csv:PATH``, ``tensorboard:DIR`` (the ``tensorboard`` package: ``pip install
'autoscale[tensorboard]'``), ``wandb:PROJECT`` (the ``wandb`` package; ``WANDB_MODE=offline``
works without a network).
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError
from autoscale.observe.watch import underflow_of

__all__ = [
    "KINDS",
    "CsvSink",
    "LatestSink",
    "TensorBoardSink",
    "WandbSink",
    "check_log_spec",
    "make_log_sink",
]

#: kind -> (what the rest of the spec names, the package it needs or None)
KINDS = {
    "csv": ("a file", None),
    "tensorboard": ("a folder", "tensorboard"),
    "wandb": ("a project", "wandb"),
}
COLUMNS = (
    "step",
    "scale",
    "log2_scale",
    "skipped",
    "skipped_total",
    "grad_amax",
    "underflow",
    "loss",
    "lr",
)


def _metrics(row: dict[str, Any], skipped_total: int) -> dict[str, Any]:
    scale = row["scale"]
    return {
        "step": row["step"],
        "scale": scale,
        "log2_scale": math.log2(scale) if scale > 0 else math.nan,
        "skipped": int(row["found_inf"]),
        "skipped_total": skipped_total,
        "grad_amax": row["amax"],
        "underflow": underflow_of(row),
        "loss": row["loss"],
        "lr": row["lr"],
    }


class _Counting:
    def __init__(self) -> None:
        self.skipped = 0

    def _each(self, rows: list[dict[str, Any]]):
        for row in rows:
            self.skipped += bool(row["found_inf"])
            yield _metrics(row, self.skipped)


class LatestSink(_Counting):
    """Keeps the latest step's metrics, for a framework's own logger to read
    (:class:`~autoscale.integrations.trainer.ScaleLogCallback`,
    :class:`~autoscale.integrations.lightning.ScaleMonitor`): scale, log2 scale, skipped steps
    in all and since the last :meth:`take`, gradient amax, and the latest underflow share."""

    def __init__(self) -> None:
        super().__init__()
        self.latest: dict[str, Any] = {}
        self._taken = 0

    def write(self, rows: list[dict[str, Any]]) -> None:
        for m in self._each(rows):
            underflow = (
                m["underflow"] if m["underflow"] is not None else self.latest.get("underflow")
            )
            self.latest = {**m, "underflow": underflow}

    def take(self) -> dict[str, float]:
        """The metrics to log now (numbers only), and the skips since the last call."""
        out = {
            k: float(v)
            for k, v in self.latest.items()
            if k in ("scale", "log2_scale", "skipped_total", "grad_amax", "underflow")
            and v is not None
        }
        if self.latest:
            out["skipped_since_last_log"] = float(self.skipped - self._taken)
            self._taken = self.skipped
        return out

    def close(self) -> None:
        pass


class CsvSink(_Counting):
    """One CSV row per step (:data:`COLUMNS`), flushed with each batch of rows."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "w", newline="")  # noqa: SIM115 - open for the sink's life
        self._csv = csv.DictWriter(self._fh, fieldnames=COLUMNS)
        self._csv.writeheader()

    def write(self, rows: list[dict[str, Any]]) -> None:
        for m in self._each(rows):
            self._csv.writerow({k: ("" if v is None else v) for k, v in m.items()})
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class TensorBoardSink(_Counting):
    """Scalars under ``autoscale/`` in a TensorBoard event folder (global step: the scaler's)."""

    def __init__(self, logdir: str | os.PathLike) -> None:
        super().__init__()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir))

    def write(self, rows: list[dict[str, Any]]) -> None:
        for m in self._each(rows):
            step = m.pop("step")
            for key, value in m.items():
                if value is not None and not (isinstance(value, float) and math.isnan(value)):
                    self.writer.add_scalar(f"autoscale/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink(_Counting):
    """Metrics under ``autoscale/`` in the active W&B run (or a new one in ``project``), against
    their own step axis ``autoscale/step`` so they never move the program's own step."""

    def __init__(self, project: str) -> None:
        super().__init__()
        import wandb

        self.wandb = wandb
        self._own = wandb.run is None
        self.run = wandb.run or wandb.init(project=project or None)
        self.run.define_metric("autoscale/step")
        self.run.define_metric("autoscale/*", step_metric="autoscale/step")

    def write(self, rows: list[dict[str, Any]]) -> None:
        for m in self._each(rows):
            self.run.log({f"autoscale/{k}": v for k, v in m.items() if v is not None}, commit=True)

    def close(self) -> None:
        if self._own:
            self.run.finish()


def check_log_spec(spec: str) -> tuple[str, str]:
    """``(kind, target)`` of a log spec, refusing an unknown kind or a missing package.

    Raises:
        ConfigError: the spec is malformed, its kind unknown, or its package not installed.
    """
    kind, sep, target = spec.partition(":")
    if kind not in KINDS:
        from autoscale.errors import unknown_name

        raise unknown_name(
            "log kind", kind, list(KINDS), "--log csv:FILE, tensorboard:DIR or wandb:PROJECT"
        )
    what, package = KINDS[kind]
    if not sep or (not target and kind != "wandb"):
        raise ConfigError(
            f"log spec '{spec}' names no {what}; write it as {kind}:{what.split()[-1].upper()}"
        )
    if package is not None and importlib.util.find_spec(package) is None:
        extra = f"'autoscale[{package}]'" if package == "tensorboard" else package
        raise ConfigError(
            f"--log {kind} needs the {package} package, which is not installed; pip install {extra}"
        )
    return kind, target


def make_log_sink(spec: str) -> Any:
    """The sink a log spec names (see :func:`check_log_spec`)."""
    kind, target = check_log_spec(spec)
    if kind == "csv":
        return CsvSink(target)
    if kind == "tensorboard":
        return TensorBoardSink(target)
    return WandbSink(target)
