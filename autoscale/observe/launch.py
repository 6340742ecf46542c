"""The parent side of ``autoscale wrap``: check what was asked, run the command with the boot
folder on its ``PYTHONPATH``, and gather what each of its scalers did.

Everything that can be refused is refused before the command starts (an unknown scaler, an
unwritable record folder, a log kind whose package is missing, a command that is not found), so
nothing of the program runs or is half-written. The command's exit status is returned as it is
(a command ended by signal N: 128+N). SIGTERM and SIGHUP sent to the launcher are passed on to the
command, and Ctrl-C reaches it through the terminal's process group. A signal to the whole group
(``scancel``, a shell's job control, torchrun's teardown) so reaches the command twice; the second
waits until the first one's handler has written every step (:mod:`autoscale.observe.lifecycle`).

Each Python of the command leaves files in a folder of the launcher's (see
:mod:`autoscale.observe.lifecycle`): one when it starts wrapped, one when it imports torch,
updated as it builds scalers and takes steps, written last at its exit or at a signal. The exit
line is read from them, so it says what happened: the steps of each scaler (at least so many for
a process killed before its exit), or why none was built.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError
from autoscale.observe.record import check_writable

__all__ = ["WrapPlan", "WrapResult", "run_wrapped", "summary_lines"]

BOOT = Path(__file__).resolve().parent / "boot"


@dataclass(frozen=True)
class WrapPlan:
    """What ``autoscale wrap`` runs, checked (:meth:`check`) before the command starts."""

    command: tuple[str, ...]
    scaler: str | None = None
    scaler_params: tuple[tuple[str, Any], ...] = ()  # the rule's settings (--scaler-param)
    record: str | None = None
    log: tuple[str, ...] = ()
    all_ranks: bool = False
    hist_every: int = 8
    measure_threshold: bool = False

    def check(self) -> None:
        """Refuse what cannot work, in one line each (nothing runs, nothing is written but the
        record folder).

        Raises:
            ConfigError / UnknownNameError: as the message says.
        """
        if not self.command:
            raise ConfigError(
                "no command to run; write it after --, e.g. autoscale wrap -- python train.py"
            )
        if shutil.which(self.command[0]) is None:
            raise ConfigError(
                f"command '{self.command[0]}' not found (not a file or on PATH); check its name or give its path"
            )
        if self.scaler_params and self.scaler is None:
            raise ConfigError(
                "--scaler-param sets the replacing scaler's settings: give --scaler NAME too "
                "(e.g. --scaler auto --scaler-param spike_bits=8)"
            )
        if self.scaler is not None:
            from autoscale.scalers import make_scaler

            # unknown names, settings the rule does not take and broken policies fail here
            make_scaler(self.scaler, device="cpu", **dict(self.scaler_params))
        if isinstance(self.hist_every, bool) or self.hist_every < 0:
            raise ConfigError(f"--hist-every must be an integer >= 0, got {self.hist_every!r}")
        from autoscale.observe.live import check_log_spec, check_log_target

        for spec in self.log:
            check_log_target(*check_log_spec(spec))
        if self.record is not None:
            check_writable(Path(self.record))


@dataclass
class WrapResult:
    """What came back: the command's exit status and one summary per scaler it built."""

    returncode: int
    scalers: list[dict[str, Any]] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    processes: int = 0  # Pythons of the command that imported torch
    started: int = 0  # Pythons of the command that started wrapped
    failures: list[str] = field(default_factory=list)  # why the wrap could not install
    fp16_autocast: bool = False  # a process entered fp16 autocast
    signal: int | None = None  # the signal that ended the command


def run_wrapped(plan: WrapPlan) -> WrapResult:
    """Run ``plan.command`` wrapped; return its status and the scalers' summaries."""
    plan.check()
    with tempfile.TemporaryDirectory(prefix="autoscale-wrap-") as summary_dir:
        config = {
            "scaler": plan.scaler,
            "scaler_params": dict(plan.scaler_params),
            "record": str(Path(plan.record).resolve()) if plan.record else None,
            "log": list(plan.log),
            "all_ranks": plan.all_ranks,
            "hist_every": plan.hist_every,
            "measure_threshold": plan.measure_threshold,
            "summary_dir": summary_dir,
            "argv": list(plan.command),
        }
        env = dict(os.environ)
        path = env.get("PYTHONPATH")
        extra = _package_path(Path(summary_dir))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BOOT), extra, path) if p)
        env["AUTOSCALE_WRAP"] = json.dumps(config)
        proc = subprocess.Popen(list(plan.command), env=env)
        # Ctrl-C reaches the command's process group; let the command handle it and end
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        passed = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
        forward = {s: signal.signal(s, lambda n, f: proc.send_signal(n)) for s in passed}
        try:
            code = proc.wait()
        finally:
            signal.signal(signal.SIGINT, previous)
            for s, handler in forward.items():
                signal.signal(s, handler)
        result = WrapResult(128 - code if code < 0 else code, signal=-code if code < 0 else None)
        _read_summaries(Path(summary_dir), result)
    result.scalers.sort(
        key=lambda s: (s["rank"] is None, s["rank"] or 0, s.get("label", ""), s["index"])
    )
    return result


def _package_path(folder: Path) -> str | None:
    """A folder that makes this autoscale importable in the command's Python, where it is not
    installed in a site-packages (a checkout, an editable install): a folder holding only a link
    to the package, so that nothing else of the checkout (its tests, its experiments) lands on
    the command's import path. None where autoscale is installed (the command's Python imports
    its own; this one's site-packages would leak other packages into it)."""
    package = BOOT.parents[1]
    if package.parent.name in ("site-packages", "dist-packages"):
        return None
    link = folder / "path"
    try:
        link.mkdir()
        (link / package.name).symlink_to(package, target_is_directory=True)
    except OSError:  # no symbolic links here: the checkout's root, as before
        return str(package.parent)
    return str(link)


def _read_summaries(folder: Path, result: WrapResult) -> None:
    """What the command's processes left in ``folder`` (see :mod:`autoscale.observe.lifecycle`)."""
    result.started = len(list(folder.glob("*.boot")))
    for f in sorted(folder.glob("*.fail")):
        try:
            result.failures.append(f.read_text().strip())
        except OSError:
            continue
    for f in sorted(folder.glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        result.processes += 1
        result.fp16_autocast |= bool(data.get("fp16_autocast"))
        final = bool(data.get("final", True))
        result.scalers.extend({**s, "final": final} for s in data.get("scalers", []))
        result.kept.extend(data.get("kept", []))


def _scale(value: float | None) -> str:
    import math

    if value is None:
        return "-"
    e = math.log2(value) if value > 0 else math.nan
    return f"2^{int(e)}" if e == int(e) else f"{value:g}"


def summary_lines(result: WrapResult, plan: WrapPlan) -> list[str]:
    """One line per scaler the command built, or a line saying it built none."""
    lines = []
    for s in result.scalers:
        label = s.get("label", f"rank {s['rank']}")
        who = f"{s['name']} ({label}{', scaler ' + str(s['index']) if s['index'] else ''})"
        cut = (
            "" if s.get("final", True) else " (its process ended before its exit summary: killed?)"
        )
        if not s["enabled"]:
            why = (
                "no CUDA device here (GradScaler disables itself so too)"
                if s.get("no_device")
                else "by the program (enabled=False)"
            )
            lines.append(f"{who}: disabled, {why}; nothing scaled")
            continue
        steps, skipped = s["steps"], s["skipped"]
        if steps == 0:
            lines.append(
                f"{who}: built, but {'no step was seen' if cut else 'the program took no step with it'}{cut}"
            )
            continue
        share = f" ({100 * skipped / steps:.1f}%)" if steps else ""
        where = f"; record: {s['record']}" if s.get("record") else ""
        where += "".join(f"; log: {log}" for log in s.get("logs", []))
        lines.append(
            f"{who}: {'at least ' if cut else ''}{steps} steps, {skipped} skipped{share}, scale "
            f"{_scale(s['scale_lo'])} .. {_scale(s['scale_hi'])}, {s['at_min']} steps at the "
            f"minimum ({_scale(s['min_scale'])}){where}{cut}"
        )
    for name in result.kept:
        lines.append(
            f"{name}: the program's own GradScaler subclass, kept as it is (not autoscale's)"
        )
    if not result.scalers and not result.kept:
        lines.append(f"the command built no GradScaler ({_why_none(result, plan)})")
        if result.fp16_autocast:
            lines.append(
                "it ran under fp16 autocast (torch.autocast(dtype=torch.float16)) without a "
                "GradScaler: if it trained there, its gradients were never scaled (those below "
                "2^-24 flush to zero in fp16, above 65504 overflow), and --record has no scaler's "
                "steps to record; build a torch.amp.GradScaler and wrap the run again"
            )
    if result.signal is not None:
        name = signal.Signals(result.signal).name if result.signal in _SIGNAL_NUMBERS else ""
        lines.append(
            f"the command ended by signal {result.signal}{f' ({name})' if name else ''}; exit "
            f"status {result.returncode}"
        )
    return lines


_SIGNAL_NUMBERS = {int(s) for s in signal.Signals}


def _why_none(result: WrapResult, plan: WrapPlan) -> str:
    """Why no scaler was built, as far as the command's processes tell."""
    if result.failures:
        return f"autoscale could not install in the command's Python: {result.failures[0]}"
    if result.started == 0:
        flags = python_flags(plan.command)
        if flags:
            return (
                f"python {' '.join('-' + f for f in flags)} runs without "
                f"{'sitecustomize' if flags == ['S'] else 'PYTHONPATH or sitecustomize'}, which "
                f"the wrap needs: the run was not wrapped; run it without {'/'.join('-' + f for f in flags)}"
            )
        return (
            "no Python of the command started wrapped: it ran no Python, or ran one with -I, -E "
            "(no PYTHONPATH) or -S (no sitecustomize), which the wrap needs"
        )
    if result.processes == 0:
        ended = (
            f"exited with status {result.returncode} before importing torch"
            if result.returncode
            else "never imported torch"
        )
        return f"the command's Python {ended}; nothing was scaled or recorded"
    return (
        "no torch.amp.GradScaler was built; Accelerate and the Hugging Face Trainer build one "
        "for fp16 only on a GPU; nothing was scaled or recorded"
    )


def python_flags(command: tuple[str, ...] | list[str]) -> list[str]:
    """Which of ``-I``, ``-E``, ``-S`` a ``python ...`` command passes (letters, in order);
    empty for a command that is not a Python interpreter."""
    if not command or not re.fullmatch(r"python[\d.]*", Path(command[0]).name):
        return []
    found: list[str] = []
    args = iter(command[1:])
    for arg in args:
        if not arg.startswith("-") or arg in ("-", "--") or arg.startswith("--"):
            break  # the script, stdin, or a long option: the interpreter's flags end here
        for i, letter in enumerate(arg[1:]):
            if letter in "IES" and letter not in found:
                found.append(letter)
            if letter in "WX":  # the rest is its argument, or the next one is
                if i == len(arg) - 2:
                    next(args, None)
                break
            if letter in "cm":  # -c CMD / -m MOD: the program follows
                return found
    return found
