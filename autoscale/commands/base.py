"""Base class of the CLI subcommands."""

from __future__ import annotations

import argparse

#: ``--policy-dir``'s help in every command that exports: where an export given no folder goes
#: (:func:`autoscale.scalers.policy_home.default_policy_dir`), in words, since importing that
#: module imports torch and ``--help`` should not
POLICY_DIR_HELP = (
    "export folder (default: the first folder of $AUTOSCALE_POLICY_PATH, else "
    "$AUTOSCALE_HOME/policies, else $XDG_DATA_HOME/autoscale/policies, else "
    "~/.local/share/autoscale/policies)"
)


class Command:
    """A subcommand: its docstring's first line is the description shown by ``--help``."""

    epilog: str | None = None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Declare the subcommand's arguments."""

    def run(self, args: argparse.Namespace) -> int:
        """Do the work; return the exit status. Raise AutoscaleError for user errors."""
        raise NotImplementedError
