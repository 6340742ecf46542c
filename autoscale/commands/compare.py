"""``autoscale compare``: several scalers on one workload, over several seeds."""

from __future__ import annotations

import argparse

from autoscale.commands.base import Command
from autoscale.commands.run import (
    add_run_arguments,
    describe,
    read_run_arguments,
    workload_help,
    write_json,
)
from autoscale.errors import ConfigError

BF16_REFERENCE = "bf16 (no scaling)"

EPILOG = """examples:
  autoscale compare --scalers torch,deepspeed,amax-history --scenario bad-batches --steps 300 --seeds 3
  autoscale compare --scalers torch,static --model mlp --scenario small-grads --steps 100 --bf16-reference --plot cmp.png
"""


class CompareCommand(Command):
    """Run several loss scalers side by side on one workload and tabulate their scorecards."""

    @property
    def epilog(self) -> str:
        return EPILOG + "\n" + workload_help()

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--scalers", default="torch,deepspeed,amax-history", help="comma-separated scaler names"
        )
        parser.add_argument(
            "--seeds", type=int, default=3, help="number of seeds, from --seed on (default 3)"
        )
        parser.add_argument(
            "--bf16-reference",
            action="store_true",
            help="add a row: the same workload in bf16, unscaled",
        )
        add_run_arguments(
            parser,
            scaler_param_help="keyword argument given to every scaler (repeatable)",
            json_help="write every scorecard and the summaries as JSON",
            plot_help="write a PNG of scale and loss trajectories per rule",
        )

    def run(self, args: argparse.Namespace) -> int:
        from autoscale.progress import progress_bar
        from autoscale.scalers import make_scaler
        from autoscale.training import TrainingRun, summarize
        from autoscale.training.report import format_comparison, plot_comparison

        spec, steps, overrides = read_run_arguments(args)
        if args.seeds <= 0:
            raise ConfigError(f"--seeds must be a positive number of seeds, got {args.seeds}")
        names = [n.strip() for n in args.scalers.split(",") if n.strip()]
        if not names:
            raise ConfigError("--scalers needs at least one scaler name (autoscale list shows all)")
        for name in names:  # fail on a bad name before any training
            make_scaler(name, device="cpu", **overrides)
        plan = [(name, spec, name, overrides) for name in names]
        if args.bf16_reference:
            plan.append((BF16_REFERENCE, spec.replace(dtype="bf16"), "static", {"init_scale": 1.0}))
        seeds = list(range(args.seed, args.seed + args.seeds))
        cards: dict[str, list] = {}
        runs: dict[str, list] = {}
        fp16_path = None
        with progress_bar(
            len(plan) * len(seeds) * steps,
            not args.quiet,
            unit="step",
            dynamic_ncols=True,
        ) as bar:
            for row, row_spec, scaler, kw in plan:
                for seed in seeds:
                    bar.set_description(f"{row} seed {seed}")
                    run = TrainingRun(row_spec.replace(seed=seed), scaler, **kw)
                    if row_spec is spec:
                        fp16_path = run.fp16_path
                    cards.setdefault(row, []).append(
                        run.run(steps, callback=lambda _r: bar.update(1))
                    )
                    runs.setdefault(row, []).append(run.records)
        summaries = {row: summarize(c) for row, c in cards.items()}
        print(
            f"{steps} steps of {describe(spec, seed=False, fp16_path=fp16_path)}; "
            f"mean ± std over {len(seeds)} seed(s)"
        )
        print(format_comparison(summaries, len(seeds)))
        if args.json:
            write_json(
                args.json,
                {
                    "spec": spec.to_dict(),
                    "fp16_path": fp16_path,
                    "steps": steps,
                    "seeds": seeds,
                    "rules": {
                        row: {
                            "scorecards": [c.to_dict() for c in cards[row]],
                            "summary": summaries[row],
                        }
                        for row in cards
                    },
                },
            )
        if args.plot:
            plot_comparison(
                runs, args.plot, title=f"{describe(spec, seed=False)}, {len(seeds)} seed(s)"
            )
        return 0
