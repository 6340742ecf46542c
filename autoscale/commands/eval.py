"""``autoscale eval``."""

from __future__ import annotations

import argparse

from autoscale.commands.base import Command
from autoscale.errors import ConfigError


class EvalCommand(Command):
    """Evaluate a policy against every built-in rule on an env spec's test instances."""

    epilog = """examples:
  autoscale eval --policy ppo-bad-batches --env envs/bad-batches.yaml --seeds 3 --plot eval.png
  autoscale eval --policy amax-history --env envs/small-grads.yaml --replay traces/small-grads.npz
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--policy", required=True, help="exported policy name or folder (or any scaler name)"
        )
        from autoscale.commands.run import add_env_or_workload

        add_env_or_workload(parser)
        parser.add_argument(
            "--seeds", type=int, default=1, help="seeds per test instance (default 1)"
        )
        parser.add_argument(
            "--against", default=None, help="comma-separated rules (default: every built-in rule)"
        )
        parser.add_argument(
            "--replay",
            metavar="TRACE",
            help="evaluate on this trace's replay instead of real steps",
        )
        parser.add_argument(
            "--json", metavar="PATH", help="write every scorecard and the summaries as JSON"
        )
        parser.add_argument(
            "--plot", metavar="PATH", help="write a PNG of scale and loss trajectories"
        )
        parser.add_argument("--quiet", action="store_true", help="no progress bar")

    def run(self, args: argparse.Namespace) -> int:
        from autoscale.agents.evaluate import evaluate_scalers
        from autoscale.commands.run import check_output, write_json
        from autoscale.envs import load_env_spec
        from autoscale.scalers import list_scalers
        from autoscale.search.budget import plural
        from autoscale.training import summarize
        from autoscale.training.report import format_comparison, plot_comparison

        if args.seeds <= 0:
            raise ConfigError(f"--seeds must be a positive number, got {args.seeds}")
        check_output(args.json, "--json")  # before the episodes, not after them
        check_output(args.plot, "--plot")
        from autoscale.commands.run import env_spec_from_args

        spec = env_spec_from_args(args, load_env_spec)
        rules = (
            [i.name for i in list_scalers() if i.kind == "rule"]
            if args.against is None
            else [n.strip() for n in args.against.split(",") if n.strip()]
        )
        names = [args.policy] + [r for r in rules if r != args.policy]
        cards, records = evaluate_scalers(
            spec,
            names,
            seeds=args.seeds,
            trace=args.replay,
            progress=not args.quiet,
            keep_records=True,
        )
        summaries = {name: summarize(c) for name, c in cards.items()}
        n = len(next(iter(cards.values())))
        where = "replay of " + args.replay if args.replay else "real steps"
        print(
            f"{spec.name}: {plural(n, 'test episode')} of {spec.episode.steps} steps ({where}); mean ± std"
        )
        print(format_comparison(summaries, n))
        limit = None
        if args.replay:  # the best any policy could have done on these steps
            from autoscale.envs.episodes import expand_seeds
            from autoscale.envs.limit import episodes_limit, limit_lines
            from autoscale.envs.traces import Trace

            names_ = [i.name for i in expand_seeds(spec, args.seeds).instances["test"]]
            limit = episodes_limit(
                Trace.load(args.replay), names_, spec.episode.steps, spec.episode
            )
            precision = {k: v["precision_loss"]["mean"] for k, v in summaries.items()}
            print("\n".join(limit_lines(precision, *limit)))
        else:
            print("share of the hindsight limit: needs the steps' gradients, give --replay TRACE")
        if args.json:
            write_json(
                args.json,
                {
                    "spec": spec.to_dict(),
                    "evaluated_on": where,
                    **(
                        {"limit": {"precision_loss": limit[0], "unsavable_steps": limit[1]}}
                        if limit
                        else {}
                    ),
                    "scalers": {
                        k: {"scorecards": [c.to_dict() for c in v], "summary": summaries[k]}
                        for k, v in cards.items()
                    },
                },
            )
        if args.plot:
            plot_comparison(records, args.plot, title=f"{spec.name}: test instances ({where})")
        return 0
