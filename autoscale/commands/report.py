"""``autoscale report``."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from autoscale.commands.base import Command
from autoscale.errors import ConfigError


class ReportCommand(Command):
    """Write one HTML page on a recorded run: the scale, its cost, what other rules would have done."""

    epilog = """examples:
  autoscale wrap --record runs/x -- python train.py
  autoscale report runs/x                       writes runs/x/report.html
  autoscale report runs/x --out report.html
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("run", help="a record folder (autoscale wrap --record DIR)")
        parser.add_argument("--out", help="HTML file to write (default: RUN/report.html)")
        parser.add_argument(
            "--scalers",
            help="scalers to replay, comma-separated (default: every built-in rule and auto)",
        )

    def run(self, args: argparse.Namespace) -> int:
        from autoscale.observe import read_record
        from autoscale.report import write_report

        record = read_record(args.run)
        _check_out(Path(args.out) if args.out else Path(args.run) / "report.html")
        names = None
        if args.scalers is not None:
            names = [s.strip() for s in args.scalers.split(",") if s.strip()]
            if not names:
                raise ConfigError(
                    "--scalers needs at least one scaler name (autoscale list shows all); drop "
                    "it for every built-in rule and auto"
                )
            from autoscale.scalers import make_scaler

            for name in names:
                make_scaler(name, device="cpu")  # an unknown name: one line before any work
        path = write_report(record, args.out, names)
        for note in record.notes:
            print(f"autoscale report: note: {note}")
        print(f"wrote {path} ({len(record.steps)} steps)")
        return 0


def _check_out(out: Path) -> None:
    """The report can be written to ``out`` (a probe file beside it), before the replays run."""
    if out.is_dir():
        raise ConfigError(f"--out '{out}' is a folder; give the HTML file to write")
    try:
        tempfile.NamedTemporaryFile(dir=out.parent, prefix=".autoscale-probe-").close()
    except OSError as exc:
        raise ConfigError(
            f"cannot write the report to '{out}' ({exc.strerror or exc}); give --out a file in a "
            "writable folder"
        ) from None
