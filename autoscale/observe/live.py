"""Live logs of a watched scaler: CSV, TensorBoard, Weights & Biases.

Each is a sink of :class:`~autoscale.observe.watch.Watch` and logs, per step: the scale (and its
log2), whether the step was skipped, the skipped steps so far, the gradient amax and the share of
gradient elements below fp16's range (on the steps with a histogram). A spec names one:
``csv:PATH``, ``tensorboard:DIR`` (the ``tensorboard`` package: ``pip install
'autoscale[tensorboard]'``), ``wandb:PROJECT`` (the ``wandb`` package: ``pip install
'autoscale[wandb]'``; ``WANDB_MODE=offline`` works without a network). Each sink says where it
writes (``where``), which ``autoscale wrap``'s exit line shows.

Two scalers of one program never share a log: a ``tag`` (``autoscale wrap`` gives the second
scaler ``scaler1``) puts the metrics under ``autoscale/<tag>/`` in TensorBoard and W&B and in
``PATH.<tag>.csv``; a CSV file that a sink of this process holds open already is never reopened
(truncated): the next sink writes ``PATH.2.csv``.
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


def _tagged(path: Path, tag: str) -> Path:
    return path.with_name(f"{path.stem}.{tag}{path.suffix}") if tag else path


class CsvSink(_Counting):
    """One CSV row per step (:data:`COLUMNS`), flushed with each batch of rows; ``PATH.<tag>.csv``
    with a ``tag``, and never a file that another sink of this process holds open."""

    _open: set[Path] = set()  # resolved paths held by this process's sinks

    def __init__(self, path: str | os.PathLike, tag: str = "") -> None:
        super().__init__()
        self.path = _tagged(Path(path), tag)
        n = 1
        while self.path.resolve() in CsvSink._open:
            n += 1
            self.path = _tagged(Path(path), f"{tag}.{n}" if tag else str(n))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.where = f"csv {self.path.resolve()}"
        self._fh = open(self.path, "w", newline="")  # noqa: SIM115 - open for the sink's life
        CsvSink._open.add(self.path.resolve())
        self._csv = csv.DictWriter(self._fh, fieldnames=COLUMNS)
        self._csv.writeheader()

    def write(self, rows: list[dict[str, Any]]) -> None:
        for m in self._each(rows):
            self._csv.writerow({k: ("" if v is None else v) for k, v in m.items()})
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()
        CsvSink._open.discard(self.path.resolve())


class TensorBoardSink(_Counting):
    """Scalars under ``autoscale/`` (``autoscale/<tag>/`` with a ``tag``) in a TensorBoard event
    folder (global step: the scaler's)."""

    def __init__(self, logdir: str | os.PathLike, tag: str = "") -> None:
        super().__init__()
        from torch.utils.tensorboard import SummaryWriter

        self.prefix = f"autoscale/{tag}" if tag else "autoscale"
        self.writer = SummaryWriter(log_dir=str(logdir))
        self.where = f"tensorboard {Path(logdir).resolve()} ({self.prefix}/)"

    def write(self, rows: list[dict[str, Any]]) -> None:
        for m in self._each(rows):
            step = m.pop("step")
            for key, value in m.items():
                if value is not None and not (isinstance(value, float) and math.isnan(value)):
                    self.writer.add_scalar(f"{self.prefix}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink(_Counting):
    """Metrics under ``autoscale/`` (``autoscale/<tag>/`` with a ``tag``) against their own step
    axis ``autoscale/step``, in a W&B run.

    In the program's own run (one was active when the sink was made) every ``log`` is
    ``commit=False``: W&B's step is the program's, and autoscale never moves it (a committed row
    would, and W&B then drops the program's ``log(step=...)`` calls below it). Uncommitted values
    ride along with the program's next committed row, so only the latest step of each batch of
    rows is logged there (the counts, such as ``skipped_total``, lose nothing). With no run active
    the sink opens one in ``project``, its own, and logs every step as a row.
    """

    def __init__(self, project: str, tag: str = "") -> None:
        super().__init__()
        import wandb

        self.wandb = wandb
        self.prefix = f"autoscale/{tag}" if tag else "autoscale"
        self._own = wandb.run is None
        self.run = wandb.run or wandb.init(project=project or None)
        self.where = f"wandb {getattr(self.run, 'url', None) or project} ({self.prefix}/)"
        self.run.define_metric(f"{self.prefix}/step")
        self.run.define_metric(f"{self.prefix}/*", step_metric=f"{self.prefix}/step")

    def write(self, rows: list[dict[str, Any]]) -> None:
        metrics = list(self._each(rows))
        for m in metrics if self._own else metrics[-1:]:
            row = {f"{self.prefix}/{k}": v for k, v in m.items() if v is not None}
            self.run.log(row, commit=self._own)

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
        import difflib

        from autoscale.errors import UnknownNameError

        if not sep and kind.endswith(".csv"):
            near = f"csv:{kind}"  # a file named without its kind
        else:
            near = next(iter(difflib.get_close_matches(kind, list(KINDS), n=1, cutoff=0.4)), "")
        hint = f"; did you mean '{near}'?" if near else ""
        raise UnknownNameError(
            f"unknown log kind '{kind}'{hint} (--log takes csv:FILE, tensorboard:DIR or wandb:PROJECT)"
        )
    what, package = KINDS[kind]
    if not sep or (not target and kind != "wandb"):
        raise ConfigError(
            f"log spec '{spec}' names {what.replace('a ', 'no ', 1)}; write it as "
            f"{kind}:{what.split()[-1].upper()}"
        )
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(  # each such package has an extra of its name (pyproject.toml)
            f"--log {kind} needs the {package} package, which is not installed; "
            f"pip install 'autoscale[{package}]'"
        )
    return kind, target


def check_log_target(kind: str, target: str) -> None:
    """A file log's file (``csv``) or folder (``tensorboard``) can be written: a probe in its
    folder, or in the nearest one that exists (created on the first step). ``wandb`` writes
    elsewhere.

    Raises:
        ConfigError: naming the target and the fix.
    """
    import tempfile
    from pathlib import Path

    from autoscale.errors import ConfigError

    if kind == "wandb":
        return
    path = Path(target)
    if kind == "csv" and path.is_dir():
        raise ConfigError(f"--log csv:{target} is a folder; give the CSV file to write")
    folder = path.parent if kind == "csv" else path
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        tempfile.NamedTemporaryFile(dir=folder, prefix=".autoscale-probe-").close()
    except OSError as exc:
        raise ConfigError(
            f"cannot write --log {kind}:{target} ('{folder}': {exc.strerror or exc}); give a "
            "path in a writable folder"
        ) from None


def make_log_sink(spec: str, tag: str = "") -> Any:
    """The sink a log spec names (see :func:`check_log_spec`); ``tag`` keeps a second scaler's
    metrics apart (its own CSV file, its own TensorBoard and W&B names)."""
    kind, target = check_log_spec(spec)
    if kind == "csv":
        return CsvSink(target, tag)
    if kind == "tensorboard":
        return TensorBoardSink(target, tag)
    return WandbSink(target, tag)
