"""``autoscale wrap``."""

from __future__ import annotations

import argparse
import sys

from autoscale.commands.base import Command


class WrapCommand(Command):
    """Run a training command with autoscale's scaler in place of torch's GradScaler."""

    epilog = """examples:
  autoscale wrap -- python train.py --epochs 3            observe: torch's rule, bit-identical, a summary at exit
  autoscale wrap --scaler auto -- python train.py         auto in place of GradScaler, no code changed
  autoscale wrap --scaler auto --scaler-param spike_bits=8 -- python train.py
                                                          auto skipping finite loss spikes
  autoscale wrap --record runs/x -- python train.py       record each step; then: autoscale report runs/x
  autoscale wrap --log tensorboard:runs/tb -- torchrun --nproc-per-node 2 train.py
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--scaler",
            help="scaler in place of every GradScaler (auto, a rule, an exported policy); "
            "default: torch's own rule, bit-identical (observe only)",
        )
        parser.add_argument(
            "--scaler-param",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a setting of --scaler's rule, over the program's GradScaler arguments "
            "(repeatable; e.g. spike_bits=8)",
        )
        parser.add_argument("--record", metavar="DIR", help="record every step to this folder")
        parser.add_argument(
            "--log",
            action="append",
            default=[],
            metavar="SPEC",
            help="live log: csv:FILE, tensorboard:DIR or wandb:PROJECT (repeatable)",
        )
        parser.add_argument(
            "--all-ranks",
            action="store_true",
            help="under torchrun, record every rank (default: rank 0)",
        )
        parser.add_argument(
            "--hist-every",
            type=int,
            default=8,
            metavar="N",
            help="gradient histogram every N steps (default 8; 1: every step, costlier; 0: none)",
        )
        parser.add_argument(
            "--measure-threshold",
            action="store_true",
            help="measure each step's overflow threshold from every fp16 tensor of the backward "
            "(slow: a Python call per op); default: estimated from the gradients",
        )
        parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")

    def run(self, args: argparse.Namespace) -> int:
        from autoscale.commands.run import parse_pairs
        from autoscale.observe.launch import WrapPlan, run_wrapped, summary_lines

        command = list(args.command)
        if command and command[0] == "--":
            command = command[1:]
        plan = WrapPlan(
            tuple(command),
            scaler=args.scaler,
            scaler_params=tuple(parse_pairs(args.scaler_param, "--scaler-param").items()),
            record=args.record,
            log=tuple(args.log),
            all_ranks=args.all_ranks,
            hist_every=args.hist_every,
            measure_threshold=args.measure_threshold,
        )
        result = run_wrapped(plan)
        for line in summary_lines(result, plan):
            print(f"autoscale wrap: {line}", file=sys.stderr)
        return result.returncode
