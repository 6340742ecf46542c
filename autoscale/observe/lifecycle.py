"""One wrapped process's side of the exit line: who it is, what it leaves for the launcher, and
what it writes however it ends.

Inside a program run by ``autoscale wrap`` (:mod:`autoscale.observe.wrap` calls :func:`start`
once torch is imported), each process keeps a summary file in the launcher's folder: written at
once (the process imported torch), again as soon as a scaler is built, each time a batch of its
steps is written (every 32 steps or 10 seconds), and at exit. So a process killed by SIGKILL still tells the launcher that
it built a scaler, and at least how many steps it took.

SIGTERM, SIGHUP (and SIGINT where the program set it to the default action) write every step
taken so far (the record's pending chunk, the live logs) and the summary, then end the process as
the signal would have: the program's own handler runs (set before torch was imported: it is
called; set after: it replaces this one, and the exit at its end writes everything), and with the
default action the process dies by the signal (a launcher sees 128+N). Python's own SIGINT
(``KeyboardInterrupt``) needs nothing: the interpreter's exit writes everything. A signal handler
runs between two bytecodes of the main thread: a process blocked in one long C call (a hung
collective) handles it when the call returns, or dies by the launcher's SIGKILL after its grace
period, as without the wrap.

A process's rank comes from ``torch.distributed`` once initialised, else ``RANK`` or
``LOCAL_RANK``; a process with none of these (``torch.multiprocessing.spawn`` before
``init_process_group``, a plain script) is rank 0 if it is the first such process of the command
to build a scaler (an exclusive file in the launcher's folder decides), else it is named by its
process id.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ProgressSink", "process_rank", "start", "write_summary"]

#: signals whose default action ends the process without Python's exit (atexit is skipped)
SIGNALS = ("SIGTERM", "SIGHUP", "SIGINT")
_me: dict[str, Any] = {"folder": None, "built": [], "kept": [], "handling": False, "waiting": {}}


def start(folder: str | None, built: list[dict[str, Any]], kept: list[str]) -> None:
    """Begin this process's summary in ``folder`` (the launcher's; None: no summary is kept),
    for the scalers in ``built`` and the kept subclasses' names in ``kept`` (the wrap's lists,
    read at each write). Catches the signals of :data:`SIGNALS` and notes fp16 autocast."""
    _me.update(folder=folder, built=built, kept=kept)
    _new_process()
    os.register_at_fork(after_in_child=_forked)
    _catch_signals()
    _note_fp16_autocast()
    atexit.register(write_summary, True)
    write_summary(False)


def process_rank() -> tuple[int | None, str]:
    """``(rank, label)`` of this process: the rank from ``torch.distributed`` once initialised,
    else ``RANK``/``LOCAL_RANK``, else 0 for the first process of the command without one that
    asks (an exclusive file decides), else None; the label names it (``rank 3``, ``pid 1234``)."""
    rank: int | None = None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = int(dist.get_rank())
    except Exception:  # noqa: BLE001 - a broken distributed setup is the program's to meet
        rank = None
    if rank is None:
        for var in ("RANK", "LOCAL_RANK"):
            value = os.environ.get(var, "").strip()
            if value.isdigit():
                rank = int(value)
                break
    if rank is None and _claim_first():
        rank = 0
    return rank, f"rank {rank}" if rank is not None else f"pid {os.getpid()}"


class ProgressSink:
    """A watch's sink that rewrites this process's summary as steps are written (at most every
    ``every_s`` seconds; a small JSON file per batch of 32 steps by default): after a SIGKILL the
    launcher still knows the steps up to then."""

    def __init__(self, every_s: float = 0.0) -> None:
        self.every_s = every_s
        self._last = 0.0

    def write(self, rows: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            write_summary(False)

    def close(self) -> None:
        pass


def write_summary(final: bool = False) -> None:
    """Write this process's summary file (``final``: the process is ending and every watch is
    closed). Never raises: a summary is not worth a program's run."""
    folder = _me["folder"]
    if not folder or os.getpid() != _me["pid"]:
        return
    if _me["forked"] and not _me["built"] and not _me["kept"]:
        return  # a forked worker that built nothing is not a process of its own
    rows = [_row(e) for e in _me["built"]]
    out = {
        "pid": os.getpid(),
        "final": bool(final),
        "fp16_autocast": _me.get("fp16_autocast", False),
        "scalers": rows,
        "kept": list(_me["kept"]),
    }
    try:
        path = Path(folder) / f"{_me['id']}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):
        pass


# ---------------------------------------------------------------------------- internals
def _row(entry: dict[str, Any]) -> dict[str, Any]:
    watch = entry.get("watch")
    scaler = entry["scaler"]
    steps = watch.steps if watch else 0
    return {
        "name": entry["name"],
        "index": entry["index"],
        "rank": entry["rank"],
        "label": entry.get("label", f"rank {entry['rank']}"),
        "enabled": scaler.is_enabled(),
        "no_device": not scaler.is_enabled() and _device_missing(str(scaler.device)),
        "steps": steps,
        "skipped": watch.skipped if watch else 0,
        "at_min": watch.at_min if watch else 0,
        "scale_lo": watch.scale_lo if watch and steps else None,
        "scale_hi": watch.scale_hi if watch and steps else None,
        "min_scale": scaler.min_scale,
        "record": entry.get("record"),
        "logs": list(entry.get("logs", [])),
        "ignored": entry["ignored"],
    }


def _device_missing(device: str) -> bool:
    """Whether a scaler on ``device`` was disabled for want of it (as GradScaler disables itself
    on ``cuda`` where CUDA is not available)."""
    import torch

    return device.startswith("cuda") and not torch.cuda.is_available()


def _new_process(forked: bool = False) -> None:
    _me.update(pid=os.getpid(), id=f"{os.getpid()}-{time.time_ns()}", forked=forked)


def _forked() -> None:
    """In a forked child: its own summary, none of the parent's scalers (their files are the
    parent's; the child's own scalers are added as it builds them)."""
    _me["built"].clear()
    _me["kept"].clear()
    _new_process(forked=True)


def _claim_first() -> bool:
    """Whether this process is the first of the command without a rank to ask (kept)."""
    if "first" not in _me:
        folder = _me["folder"]
        if not folder:
            _me["first"] = True
        else:
            try:
                os.close(os.open(Path(folder) / "rank0", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                _me["first"] = True
            except FileExistsError:
                _me["first"] = False
            except OSError:
                _me["first"] = True
    return _me["first"]


def _catch_signals() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # torch imported in another thread: handlers can only be set from the main one
    for name in SIGNALS:
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        previous = signal.getsignal(sig)
        if previous in (signal.SIG_IGN, None) or previous is signal.default_int_handler:
            continue  # ignored, set outside Python, or KeyboardInterrupt (exits through atexit)
        signal.signal(sig, _Handler(previous))


@contextlib.contextmanager
def holding_signals() -> Any:
    """A write of the steps taken (a watch handing its pending rows to its sinks) that a signal
    must not cut: a handler of :data:`SIGNALS` that comes during it waits, as a second signal
    does during a handler's own write, and runs once the write is done. Run inside that write, the
    handler's final write found the rows out of the pending list and not yet in the sinks, and
    the process ended without them (a flush's 32 steps)."""
    if _me["handling"]:  # inside a handler's write already: its end runs what waited
        yield
        return
    _me["handling"] = True
    try:
        yield
    finally:
        _me["handling"] = False
        waiting, _me["waiting"] = _me["waiting"], {}
        for signum, (handler, frame) in waiting.items():
            handler(signum, frame)


class _Handler:
    """Writes every step so far, then does what ``previous`` would have done.

    A signal that arrives during the write waits until the write is done, as the kernel holds a
    signal back while its C handler runs: a job's SIGTERM reaches the program twice (from its
    process group, and again from a launcher that forwards it), and the second one, acted on at
    once, ended the process halfway through the write (the record lost its pending chunk). Each
    signal that waited is handled once, after this one's action (which usually ends the process
    first)."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, signum: int, frame: Any) -> Any:
        if _me["handling"]:
            _me["waiting"].setdefault(signum, (self, frame))
            return None
        ours = signal.getsignal(signum) is self  # else the program's handler chained to this one
        dies = ours and self.previous == signal.SIG_DFL
        _me["handling"] = True
        try:
            _write_all(final=dies)
        finally:
            _me["handling"] = False
        try:
            if callable(self.previous):
                return self.previous(signum, frame)
            if dies:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return None
        finally:
            waiting, _me["waiting"] = _me["waiting"], {}
            for waited, (handler, waited_frame) in waiting.items():
                handler(waited, waited_frame)


def _write_all(final: bool) -> None:
    """Every watch's steps to its sinks (closed when ``final``), and the summary."""
    if os.getpid() != _me["pid"]:
        return
    for entry in list(_me["built"]):
        watch = entry.get("watch")
        if watch is None:
            continue
        with contextlib.suppress(Exception):  # the signal's own action comes next regardless
            watch.close() if final else watch.sync()
    write_summary(final)


def _note_fp16_autocast() -> None:
    """Note when the program enters fp16 autocast: a program that does and builds no GradScaler
    trains with unscaled fp16 gradients, which the exit line says."""
    import torch

    cls = torch.amp.autocast_mode.autocast
    enter = cls.__enter__
    if getattr(enter, "_autoscale", False):
        return

    def __enter__(self: Any) -> Any:
        fp16 = getattr(self, "fast_dtype", None) == torch.float16
        if fp16 and getattr(self, "_enabled", True) and not _me.get("fp16_autocast"):
            _me["fp16_autocast"] = True
            write_summary(False)
        return enter(self)

    __enter__._autoscale = True  # type: ignore[attr-defined]
    cls.__enter__ = __enter__
