"""Base class of the CLI subcommands."""

from __future__ import annotations

import argparse


class Command:
    """A subcommand: its docstring's first line is the description shown by ``--help``."""

    epilog: str | None = None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Declare the subcommand's arguments."""

    def run(self, args: argparse.Namespace) -> int:
        """Do the work; return the exit status. Raise AutoscaleError for user errors."""
        raise NotImplementedError
