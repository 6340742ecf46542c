"""The parent side of ``autoscale wrap``: check what was asked, run the command with the boot
folder on its ``PYTHONPATH``, and gather what each of its scalers did.

Everything that can be refused is refused before the command starts (an unknown scaler, an
unwritable record folder, a log kind whose package is missing, a command that is not found), so
nothing of the program runs or is half-written. The command's exit status is returned as it is.
"""

from __future__ import annotations

import json
import os
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
        if self.scaler is not None:
            from autoscale.scalers import get_scaler

            get_scaler(self.scaler, device="cpu")  # unknown names and broken policies fail here
        if isinstance(self.hist_every, bool) or self.hist_every < 0:
            raise ConfigError(f"--hist-every must be an integer >= 0, got {self.hist_every!r}")
        from autoscale.observe.live import check_log_spec

        for spec in self.log:
            check_log_spec(spec)
        if self.record is not None:
            check_writable(Path(self.record))


@dataclass
class WrapResult:
    """What came back: the command's exit status and one summary per scaler it built."""

    returncode: int
    scalers: list[dict[str, Any]] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    processes: int = 0


def run_wrapped(plan: WrapPlan) -> WrapResult:
    """Run ``plan.command`` wrapped; return its status and the scalers' summaries."""
    plan.check()
    with tempfile.TemporaryDirectory(prefix="autoscale-wrap-") as summary_dir:
        config = {
            "scaler": plan.scaler,
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
        # the boot folder, and for a checkout that is not installed its root (so that the child
        # imports autoscale); never an installed site-packages, which would leak this Python's
        # packages into a command run by another one
        root = BOOT.parents[2]
        checkout = str(root) if root.name not in ("site-packages", "dist-packages") else None
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BOOT), checkout, path) if p)
        env["AUTOSCALE_WRAP"] = json.dumps(config)
        proc = subprocess.Popen(list(plan.command), env=env)
        # Ctrl-C reaches the command's process group; let the command handle it and end
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        forward = signal.signal(signal.SIGTERM, lambda s, f: proc.send_signal(s))
        try:
            code = proc.wait()
        finally:
            signal.signal(signal.SIGINT, previous)
            signal.signal(signal.SIGTERM, forward)
        result = WrapResult(128 - code if code < 0 else code)
        for f in sorted(Path(summary_dir).glob("*.json")):
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            result.processes += 1
            result.scalers.extend(data.get("scalers", []))
            result.kept.extend(data.get("kept", []))
    result.scalers.sort(key=lambda s: (s["rank"], s["index"]))
    return result


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
        who = f"{s['name']} (rank {s['rank']}{', scaler ' + str(s['index']) if s['index'] else ''})"
        if not s["enabled"]:
            lines.append(f"{who}: disabled by the program (enabled=False); nothing scaled")
            continue
        steps, skipped = s["steps"], s["skipped"]
        if steps == 0:
            lines.append(f"{who}: built, but the program took no step with it")
            continue
        share = f" ({100 * skipped / steps:.1f}%)" if steps else ""
        where = f"; record: {s['record']}" if s.get("record") else ""
        lines.append(
            f"{who}: {steps} steps, {skipped} skipped{share}, scale {_scale(s['scale_lo'])} .. "
            f"{_scale(s['scale_hi'])}, {s['at_min']} steps at the minimum ({_scale(s['min_scale'])}){where}"
        )
    for name in result.kept:
        lines.append(
            f"{name}: the program's own GradScaler subclass, kept as it is (not autoscale's)"
        )
    if not result.scalers and not result.kept:
        why = (
            "the command ran no Python that imported torch"
            if result.processes == 0
            else "no torch.amp.GradScaler was built; Accelerate and the Hugging Face Trainer build one for fp16 only on a GPU"
        )
        lines.append(f"the command built no GradScaler ({why}); nothing was scaled or recorded")
    return lines
