"""What the long runs' fp32 reference backward costs: a no-harm run with the reference against the
same run without it, side by side in one process.

The long runs of the no-harm check (``autoscale/training/long_run.py``) take an fp32 backward of
one applied step in every ``REFERENCE_EVERY``, so the precision they judge counts gradients a low
scale flushes. The search's plan sizes the check by the steps it takes
(``autoscale/search/timing.py``, ``NoHarmPlan.cost``); this measures the share the reference adds
on the search's default workloads (``torch`` runs, the check's own measure; the order alternates
so that drift in the machine's load hits both alike; minimum over the repeats).

    python experiments/benchmarks/reference_cost.py [--steps 300] [--repeats 3] \\
        [--out experiments/results/reference_cost.md]
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import torch


def timed_run(workload, steps: int, reference: bool) -> float:
    from autoscale.training import TrainingRun
    from autoscale.training.long_run import measured_run

    run = TrainingRun(workload, "torch", init_scale=2.0**16)
    t0 = time.perf_counter()
    measured_run(run, steps, reference=reference)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    from autoscale.search.workload import base_spec
    from autoscale.training.long_run import REFERENCE_EVERY

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,gpt2-tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the table here as markdown too")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for model in args.models.split(","):
        workload = base_spec(model=model).workload
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.repeats):
            for reference in (False, True) if r % 2 == 0 else (True, False):
                times[reference].append(timed_run(workload, args.steps, reference))
        plain, ref = min(times[False]), min(times[True])
        rows.append(f"| {model} | {1e3 * plain / args.steps:.1f} | {1e3 * ref / args.steps:.1f} "
                    f"| {ref / plain:.3f} |")  # fmt: skip
    lines = [
        "# The long runs' fp32 reference backward, its cost",
        "",
        f"`python experiments/benchmarks/reference_cost.py --steps {args.steps} --repeats "
        f"{args.repeats}` ({datetime.now(UTC):%Y-%m-%d}, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, 1 thread); one reference backward every {REFERENCE_EVERY} "
        "steps; minimum over the repeats, the order alternating.",
        "",
        "| model | ms per step, no reference | with it | ratio |",
        "|---|---:|---:|---:|",
        *rows,
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
