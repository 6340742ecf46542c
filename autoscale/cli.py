"""The ``autoscale`` command line: a thin dispatcher over one class per subcommand.

Each subcommand lives in ``autoscale/commands/`` as a :class:`~autoscale.commands.base.Command`
subclass and is imported only when it runs, so ``autoscale --help`` stays fast. Errors autoscale
raises on purpose (:class:`~autoscale.errors.AutoscaleError`) print as one line and exit 2, and so
does a command whose optional extra (``autoscale[search]``, ``autoscale[hf]``) is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import autoscale
from autoscale.errors import EXTRA_OF_MODULE, AutoscaleError, MissingExtraError, missing_extra

# name -> (module in autoscale.commands, class, one-line help). Order is the order of --help.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "list": ("listing", "ListCommand", "list every registered scaler with its defaults"),
    "run": ("run", "RunCommand", "train one workload under one scaler and print its scorecard"),
    "compare": (
        "compare",
        "CompareCommand",
        "compare scalers side by side on one workload over seeds",
    ),
    "doctor": (
        "doctor",
        "DoctorCommand",
        "check fp16/bf16 support and speed here, and recommend one",
    ),
    "wrap": (
        "wrap",
        "WrapCommand",
        "run a training command with autoscale's scaler in place of GradScaler",
    ),
    "report": (
        "report",
        "ReportCommand",
        "one HTML page on a recorded run: the scale, its cost, what every rule would have done",
    ),
    "record": (
        "record",
        "RecordCommand",
        "record traces of real training for the replay environment",
    ),
    "train-agent": (
        "train_agent",
        "TrainAgentCommand",
        "train an RL agent (SB3) to set the scale; export it",
    ),
    "eval": (
        "eval",
        "EvalCommand",
        "evaluate a policy against every built-in rule on test instances",
    ),
    "search": (
        "search",
        "SearchCommand",
        "budgeted Optuna search of policies; validate, export the best",
    ),
    "dashboard": (
        "dashboard",
        "DashboardCommand",
        "optuna-dashboard on a search storage (127.0.0.1)",
    ),
    "export": ("export", "ExportCommand", "export a search trial's policy to your policies folder"),
}

# Commands that need an optional extra whatever their arguments: checked before the command is
# imported, so they say which extra in one line. Others find out when they import a missing module
# (``autoscale run --model gpt2`` without the 'hf' extra), and say it the same way.
NEEDS_EXTRA: dict[str, str] = {
    "record": "search",
    "train-agent": "search",
    "eval": "search",
    "search": "search",
    "dashboard": "search",
    "export": "search",
}

EPILOG = """examples:
  autoscale list                                   every scaler get_scaler() can build
  autoscale run --scaler torch --scenario bad-batches --steps 200
                                                   one training run, its scorecard (--json, --plot)
  autoscale compare --scalers torch,deepspeed,amax-history --seeds 3
                                                   the rules side by side, mean and spread over seeds
  autoscale doctor                                 device, fp16/bf16 support, step speeds, advice
  autoscale wrap --scaler auto -- python train.py  your own script under auto, not a line changed
  autoscale wrap --record runs/x -- python train.py; autoscale report runs/x
                                                   record your run; one page on what the scale did
  autoscale search --budget 30m                    search, validate on real steps, export the best
  autoscale dashboard                              review the search: trials, notes, plots
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, like autoscale's own (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help shows the usage)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="autoscale",
        description="Learned loss-scale policies for fp16 mixed-precision training.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"autoscale {autoscale.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _command(name: str):
    extra = NEEDS_EXTRA.get(name)
    for module, its_extra in EXTRA_OF_MODULE.items():
        if its_extra == extra and importlib.util.find_spec(module) is None:
            raise missing_extra(f"autoscale {name}", module)
    module, cls, _ = COMMANDS[name]
    return getattr(importlib.import_module(f"autoscale.commands.{module}"), cls)()


def _no_extra(name: str, exc: ModuleNotFoundError) -> int:
    """Print the one line that names the extra installing ``exc``'s module (exit 2), or re-raise
    ``exc`` when no extra of autoscale installs it."""
    error = missing_extra(f"autoscale {name}", exc.name or "")
    if error is None:
        raise exc
    print(error, file=sys.stderr)
    return 2


def _negative_budget(args: list[str]) -> list[str]:
    """``--budget -1m`` as ``--budget=-1m`` (before any ``--``): argparse reads a value that
    starts with '-' as an option and says only "expected one argument"; joined, the budget's own
    check names the value and the form."""
    import re

    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        if out and out[-1] == "--budget" and re.fullmatch(r"-\d[\w.]*", arg):
            out[-1] = f"--budget={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        args = parser.parse_args(argv)  # handles --help, --version and unknown commands
        parser.print_help()
        return 0 if args.command is None and not argv else 2
    try:
        command = _command(argv[0])
    except MissingExtraError as exc:
        print(exc, file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        return _no_extra(argv[0], exc)
    sub = _Parser(
        prog=f"autoscale {argv[0]}",
        description=command.__doc__.strip().splitlines()[0] if command.__doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=getattr(command, "epilog", None),
    )
    command.add_arguments(sub)
    args = sub.parse_args(_negative_budget(argv[1:]))
    try:
        return int(command.run(args) or 0)
    except MissingExtraError as exc:
        print(exc, file=sys.stderr)
        return 2
    except AutoscaleError as exc:
        print(f"autoscale {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        return _no_extra(argv[0], exc)
    except KeyboardInterrupt:
        print(f"autoscale {argv[0]}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (``autoscale list | head``): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit must not fail again
        return 141


if __name__ == "__main__":
    sys.exit(main())
