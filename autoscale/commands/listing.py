"""``autoscale list``."""

from __future__ import annotations

import argparse
import json

from autoscale.commands.base import Command
from autoscale.scalers import list_scalers
from autoscale.scalers.policies import default_policy_dir, policy_places


def _fmt(value) -> str:
    if (
        isinstance(value, float)
        and value > 0
        and value == 2.0 ** round(__import__("math").log2(value))
        and value >= 64
    ):
        return f"2^{round(__import__('math').log2(value))}"
    return f"{value:g}" if isinstance(value, float) else str(value)


class ListCommand(Command):
    """List every scaler get_scaler() can build: built-in rules, plugins and exported policies."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print machine-readable JSON")

    def run(self, args: argparse.Namespace) -> int:
        infos = list_scalers()
        if args.json:
            print(json.dumps([i.__dict__ for i in infos], indent=2, default=str))
            return 0
        width = max(len(i.name) for i in infos)
        for kind, title in (
            ("rule", "Built-in rules"),
            ("plugin", "Plugins"),
            ("policy", "Policies (shipped with autoscale, or exported)"),
        ):
            rows = [i for i in infos if i.kind == kind]
            if not rows:
                continue
            print(f"{title}:")
            for i in rows:
                print(f"  {i.name:<{width}}  {i.description}")
                if i.defaults:
                    print(
                        f"  {'':<{width}}  defaults: "
                        + ", ".join(f"{k}={_fmt(v)}" for k, v in i.defaults.items())
                    )
            print()
        print(
            f"Exported policies are looked for in {policy_places()}; an export goes to "
            f"{default_policy_dir()} unless given a folder."
        )
        print(
            "Use one with: scaler = autoscale.get_scaler(NAME, device=...)  (keyword arguments override defaults)"
        )
        return 0
