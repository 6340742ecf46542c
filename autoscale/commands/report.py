"""``autoscale report``."""

from __future__ import annotations

import argparse

from autoscale.commands.base import Command


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
        names = [s.strip() for s in args.scalers.split(",") if s.strip()] if args.scalers else None
        if names:
            from autoscale.scalers import make_scaler

            for name in names:
                make_scaler(name, device="cpu")  # an unknown name: one line before any work
        path = write_report(record, args.out, names)
        for note in record.notes:
            print(f"autoscale report: note: {note}")
        print(f"wrote {path} ({len(record.steps)} steps)")
        return 0
