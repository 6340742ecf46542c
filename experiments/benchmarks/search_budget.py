"""How well ``autoscale search`` keeps its budget, and how much of it goes to bookkeeping.

Runs one search in this process (fresh SQLite storage in a temporary folder) and prints the wall
time against the budget, then where the time went: training and evaluation (measuring, recording,
replay trials, RL, real-step validation, export), the search algorithm (TPE sampler, pruner), and
bookkeeping (Optuna storage: ask, tell, reports; user attributes, notes, artifacts, plots), the
rest being start-up and glue. The target is bookkeeping under 5% of the wall time.

    python experiments/benchmarks/search_budget.py --budget 60s
    python experiments/benchmarks/search_budget.py --model mlp --budget 2m --space both
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

T0 = time.monotonic()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--scenario", default="bad-batches")
    parser.add_argument("--budget", default="60s")
    parser.add_argument("--space", default="parametric", choices=("parametric", "rl", "both"))
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args()

    from autoscale.search import Budget, SearchConfig, SearchRunner, base_spec, parse_budget

    seconds = parse_budget(args.budget)
    with tempfile.TemporaryDirectory(prefix="search-budget-") as tmp:
        os.chdir(tmp)
        spec = base_spec(model=args.model, scenario=args.scenario)
        cfg = SearchConfig(
            spec,
            study="bench",
            export="bench-policy",
            space=args.space,
            storage=f"sqlite:///{Path(tmp) / 'bench.db'}",
            progress=not args.quiet,
            budget_text=args.budget,
        )
        budget = Budget.from_process_start(seconds)
        result = SearchRunner(cfg, budget).run()
        wall = budget.elapsed()
    ledger = result.ledger.seconds
    work = {k[5:]: v for k, v in ledger.items() if k.startswith("work:")}
    bk = {k[3:]: v for k, v in ledger.items() if k.startswith("bk:")}
    alg = {k[4:]: v for k, v in ledger.items() if k.startswith("alg:")}
    other = wall - sum(work.values()) - sum(bk.values()) - sum(alg.values())

    def rows(title: str, parts: dict[str, float]) -> None:
        total = sum(parts.values())
        print(f"{title:<28} {total:8.2f} s  {100 * total / wall:5.1f}%")
        for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {k:<26} {v:8.2f} s  {100 * v / wall:5.1f}%")

    trials = result.trials
    print()
    print(
        f"model {args.model}, scenario {args.scenario}, space {result.plan.space if result.plan else args.space}"
    )
    print(
        f"trials: {trials['complete']} complete, {trials['pruned']} pruned, {trials['failed']} failed; "
        f"exported: {'yes' if result.exported else 'no'}"
    )
    print(
        f"wall time {wall:.1f} s of a {seconds:.0f} s budget: {100 * wall / seconds:.1f}% (over by {max(0.0, wall - seconds):.1f} s)"
    )
    rows("training and evaluation", work)
    rows("search algorithm", alg)
    rows("bookkeeping", bk)
    print(f"{'start-up and glue':<28} {other:8.2f} s  {100 * other / wall:5.1f}%")
    share = sum(bk.values()) / wall
    print(
        f"bookkeeping share {100 * share:.1f}% (target < 5%): {'met' if share < 0.05 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
