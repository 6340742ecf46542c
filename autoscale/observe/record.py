"""The on-disk record of a training run: what each optimizer step of a scaler did.

A record is a folder::

    runs/x/meta.json            what ran: format version, scaler, command, torch, device, rank
    runs/x/steps-000000.jsonl   one JSON object per step, a chunk written whole (tmp + rename)
    runs/x/steps-000256.jsonl   ...

Chunks are written whole and renamed into place, so a run killed at any moment leaves only whole
chunks (it loses the steps of the chunk it was filling), and a record can be read while the run
goes on. A folder is claimed atomically: ``meta.json`` is linked into place only where none is
(two processes given one folder: one records, the other is refused), never checked and then
written.

Every line is strict JSON (format version 2): a non-finite number is written as the string
``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (the spellings JavaScript's ``Number()`` and most
JSON libraries' number parsers read back), and :func:`read_record` gives it back as a float.
Version 1 records held bare ``NaN`` literals; they still read. Standard library only: the recorder runs inside the user's program. The replay
environments and the search read a record through :func:`autoscale.envs.from_records.trace_from_record`.

A step's fields (``None`` where not known):

- ``step``: index of the step (the scaler's ``update()`` calls).
- ``scale``: the loss scale the step's backward pass used.
- ``found_inf``: a gradient was inf/NaN: the optimizer step was skipped.
- ``loss``: the mean unscaled loss passed to ``scale()`` (NaN/inf when non-finite; None if the
  program scaled something else than a one-element loss).
- ``loss_nonfinite``: the loss itself was non-finite: the step fails at any scale.
- ``amax``, ``rms``: largest and root-mean-square unscaled gradient element (the RMS only on
  the histogram steps, unless the scaler's rule computes it every step; NaN otherwise).
- ``threshold``: log2 of the smallest scale at which this step's backward overflows fp16.
  ``threshold_measured`` says how it was obtained: True, from every fp16 tensor the backward
  produced (``measure_threshold=True``); False, estimated from the parameter gradients' amax
  (``log2(65504 / amax)``; activation gradients inside the backward can be larger); on a step that
  overflowed, only known to lie below the scale used (stored as that scale minus one bit).
- ``hist``: counts of finite non-zero unscaled gradient elements per 1-bit bin of log2|g|
  (``meta["hist_edges"]``), on every ``hist_every``-th step, else None.
- ``lr``: the first parameter group's learning rate at the step.
- ``wall_s``: seconds since the previous step's update (the first: since the recorder started).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError

__all__ = [
    "RECORD_FORMAT",
    "RECORD_VERSION",
    "HIST_EDGES",
    "RecordWriter",
    "RunRecord",
    "read_record",
    "is_record",
    "to_json",
    "underflow_share",
]

RECORD_FORMAT = "autoscale-run-record"
RECORD_VERSION = 2
#: versions that :func:`read_record` reads (1: bare NaN/Infinity literals in the step lines)
READS_VERSIONS = (1, 2)
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
META = "meta.json"
HIST_LO, HIST_HI = -64, 16
#: 1-bit bins of log2|g|, -64 .. +16 (80 bins); the ends are open (elements beyond count there).
HIST_EDGES: tuple[float, ...] = tuple(float(e) for e in range(HIST_LO, HIST_HI + 1))
_CHUNK = re.compile(r"^steps-(\d{6,})\.jsonl$")
FIELDS = (
    "step",
    "scale",
    "found_inf",
    "loss",
    "loss_nonfinite",
    "amax",
    "rms",
    "threshold",
    "threshold_measured",
    "guarded",
    "spiked",
    "lr",
    "wall_s",
    "hist",
)


def underflow_share(hist: list[float], scale: float, min_normal_log2: float = -14.0) -> float:
    """Share of the counted gradient elements that ``scale`` leaves below fp16's normal range.

    Mass is spread uniformly in log2 inside each 1-bit bin of :data:`HIST_EDGES`, as the replay
    environment's precision table has it. NaN for an empty histogram.
    """
    total = float(sum(hist))
    if total <= 0 or not scale > 0:
        return math.nan
    cut = min_normal_log2 - math.log2(scale)  # |g| below 2^cut underflows
    below = 0.0
    for k, n in enumerate(hist):
        lo = HIST_EDGES[k]
        if lo + 1 <= cut:
            below += n
        elif lo < cut:
            below += n * (cut - lo)
        else:
            break
    return below / total


def is_record(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a record's ``meta.json``."""
    return (Path(path) / META).is_file()


class RecordWriter:
    """Writes a record folder: ``meta.json`` now, then whole chunks of steps.

    Args:
        path: The folder. Created if missing; it must not hold a record already (a record is
            never overwritten: choose another folder or delete the old one). Claimed atomically:
            of two writers given one folder at once, one gets it.
        meta: What ran (JSON-serialisable values); format, version and histogram edges are added.

    Raises:
        ConfigError: the folder holds a record already (or another writer claimed it first),
            or cannot be written.
    """

    def __init__(self, path: str | os.PathLike, meta: dict[str, Any]) -> None:
        self.path = Path(path)
        check_writable(self.path)
        self.meta = {
            "format": RECORD_FORMAT,
            "version": RECORD_VERSION,
            "hist_edges": list(HIST_EDGES),
            **meta,
        }
        _claim(self.path / META, to_json(self.meta, indent=1))

    def write_chunk(self, first: int, rows: list[dict[str, Any]]) -> None:
        """Write (or rewrite, with more rows) the chunk whose first step is ``first``."""
        if rows:
            text = "\n".join(to_json(r, separators=(",", ":")) for r in rows) + "\n"
            _write_atomic(self.path / f"steps-{first:06d}.jsonl", text)

    def finish(self, **extra: Any) -> None:
        """Mark the record finished (the run ended and every step is written)."""
        self.meta.update(extra, finished=True)
        _write_atomic(self.path / META, to_json(self.meta, indent=1))


def to_json(obj: Any, **kwargs: Any) -> str:
    """Strict JSON of ``obj``: non-finite floats as the strings ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"`` (``json.dumps`` would write bare literals that strict readers refuse)."""
    return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if obj != obj else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _step_from_json(row: dict[str, Any]) -> dict[str, Any]:
    """A step line read back: the non-finite numbers' strings as floats again."""
    return {k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in row.items()}


_NUMBERS = ("scale", "loss", "amax", "rms", "threshold", "lr", "wall_s")
_SWITCHES = ("found_inf", "loss_nonfinite", "threshold_measured", "guarded", "spiked")


def _read_step(line: str) -> tuple[dict[str, Any], str | None]:
    """A step line read back, and what is wrong with it (None: nothing): strict JSON of a
    mapping with ``scale`` and ``found_inf``, its fields of their kinds (see the module's
    docstring)."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        return {}, f"not JSON: {exc}"
    if not isinstance(row, dict):
        return {}, f"not a mapping: {line[:40]!r}"
    row = _step_from_json(row)
    for key in ("scale", "found_inf"):
        if key not in row:
            return row, f"no '{key}'"
    for key in _NUMBERS:
        v = row.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            return row, f"'{key}' is {v!r}, not a number"
    for key in _SWITCHES:
        if row.get(key) not in (None, True, False):
            return row, f"'{key}' is {row[key]!r}, not true or false"
    hist = row.get("hist")
    if hist is not None and (
        not isinstance(hist, list)
        or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in hist)
    ):
        return row, "'hist' is not a list of counts"
    return row, None


def check_writable(path: Path) -> None:
    """Refuse a folder that holds a record already or cannot be written, before anything runs."""
    if (path / META).exists():
        raise ConfigError(
            f"record folder '{path}' holds a record already; give another folder or delete it"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".autoscale-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"cannot write the record folder '{path}' ({exc.strerror or exc}); give a writable folder"
        ) from None


def _claim(path: Path, text: str) -> None:
    """Create ``path`` holding ``text`` only if nothing is there: a whole file linked into place
    (``os.link`` fails where the name exists), so no two writers both get it and no reader sees
    half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.claim")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise ConfigError(
            f"record folder '{path.parent}' holds a record already (another process claimed "
            "it); give another folder or delete it"
        ) from None
    except OSError:  # a file system without hard links: an exclusive create instead
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise ConfigError(
                f"record folder '{path.parent}' holds a record already (another process "
                "claimed it); give another folder or delete it"
            ) from None
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
    finally:
        tmp.unlink(missing_ok=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


@dataclass
class RunRecord:
    """A record as read back: its meta and the steps of its whole chunks.

    Attributes:
        path: The folder. meta: ``meta.json``. steps: One dict per step (the fields of
        :mod:`autoscale.observe.record`), in order. complete: Every chunk read whole and the steps
        run without a gap. notes: Where the record ends early or a chunk could not be read, in
        words. damaged: The note that says where the steps stop reading (a gap, a chunk or a
        step that does not read), or None.
    """

    path: Path
    meta: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    damaged: str | None = None  # where the steps stop reading (a gap, a chunk, a line), in words

    def column(self, name: str, default: float = math.nan) -> list[Any]:
        """One field of every step (``default`` where it is None)."""
        return [default if s.get(name) is None else s[name] for s in self.steps]

    @property
    def label(self) -> str:
        """The command that ran, or the folder's name."""
        argv = self.meta.get("argv")
        return " ".join(argv) if argv else self.path.name


def read_record(path: str | os.PathLike) -> RunRecord:
    """Read the record in ``path`` (whole chunks only; a chunk cut short is said in ``notes``).

    Raises:
        ConfigError: no record there, one of another format or version, or an unreadable meta.
    """
    path = Path(path)
    meta_path = path / META
    if path.is_file():
        raise ConfigError(
            f"'{path}' is a file, not a record folder; give the folder that autoscale wrap "
            "--record DIR wrote"
        )
    if not path.is_dir():
        raise ConfigError(
            f"no record folder '{path}'; record one with: autoscale wrap --record {path} -- python train.py"
        )
    if not meta_path.is_file():
        inner = sorted(p.parent.name for p in path.glob(f"*/{META}"))
        hint = f" (it holds records in {', '.join(inner)})" if inner else ""
        raise ConfigError(f"'{path}' is not an autoscale record: it has no {META}{hint}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"record '{path}' has an unreadable {META} ({exc}); record the run again"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != RECORD_FORMAT:
        raise ConfigError(f"'{path}' is not an autoscale record ({META} of another format)")
    version = meta.get("version")
    if version not in READS_VERSIONS:
        raise ConfigError(
            f"record '{path}' has format version {version!r}, this autoscale reads version "
            f"{' or '.join(map(str, READS_VERSIONS))}; record the run again with this autoscale"
        )
    record = RunRecord(path, meta)
    chunks = sorted((int(m.group(1)), p) for p in path.iterdir() if (m := _CHUNK.match(p.name)))
    expected = 0
    for first, chunk in chunks:
        if first != expected:
            record.damaged = f"steps {expected}-{first - 1} are missing (no chunk holds them); read up to step {expected - 1}"
            break
        try:
            lines = [line for line in chunk.read_text().splitlines() if line]
        except (OSError, ValueError) as exc:
            record.damaged = f"chunk {chunk.name} does not read ({exc}); the record ends before it"
            break
        for number, line in enumerate(lines, start=1):
            row, problem = _read_step(line)
            if problem is not None:  # the steps before it stand; the record ends there
                record.damaged = (
                    f"step {first + number - 1} (line {number} of {chunk.name}) does not read "
                    f"({problem}); the record ends before it"
                )
                break
            record.steps.append(row)
        if record.damaged is not None:
            break
        expected = first + len(lines)
    if record.damaged is not None:
        record.notes.append(record.damaged)
    if not meta.get("finished") and not record.notes:
        record.notes.append(
            f"the run did not finish its record (killed, or still running): {len(record.steps)} "
            "steps in whole chunks are read; steps after them are lost"
        )
    return record
