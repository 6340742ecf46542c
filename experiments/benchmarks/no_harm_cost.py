"""The no-harm check's estimate against what its runs take here.

A search plans the no-harm check from step times it measured (``NoHarmPlan.cost``) and starts a
check only where that estimate, with a margin, fits before the budget's end: an estimate below
what the runs take cuts the check at the end, unchecked. This measures the main job's workloads
as the search does (``measure_all``), then runs the check of ``--rule`` on a fresh cache: torch's
runs of each workload and seed (recorded: the check screens candidates on their replay), then the
candidate's. Prints, per run, the estimate and the time taken, and their ratio for the whole
check (uncached, as on a new machine, and with torch's runs cached, as on a resumed search).

Usage::

    python experiments/benchmarks/no_harm_cost.py [--rule auto] [--model gpt2-tiny]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from autoscale.envs.suite import as_suite
from autoscale.scalers import make_scaler
from autoscale.search.budget import Ledger
from autoscale.search.no_harm import NO_HARM_STEPS, NoHarmCheck, no_harm_label, no_harm_workloads
from autoscale.search.timing import NoHarmPlan, measure_all
from autoscale.search.workload import base_spec
from autoscale.training.threads import fit_threads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rule", default="auto")
    p.add_argument("--model", default=None, help="the searched model (default: the main job's)")
    p.add_argument("--steps", type=int, default=NO_HARM_STEPS)
    args = p.parse_args(argv)
    print(fit_threads().describe())
    base = as_suite(base_spec(model=args.model))
    plan = NoHarmPlan(no_harm_workloads(list(base.members), args.steps), args.steps)
    timings = measure_all(
        [m.workload for m in base.members] + list(plan.workloads), limit_s=75, step_share_s=3
    )
    ep = base.members[0].episode
    scale_kw = ep.scale_kwargs()
    check = NoHarmCheck(plan, Path(tempfile.mkdtemp()), Ledger(), scale_kw)
    uncached = check.cost(timings, 1)
    print("\n| run | estimate s | taken s | ratio |\n|---|---:|---:|---:|")
    taken_torch = 0.0
    for w in plan.workloads:
        est = timings.of(w).run_s(args.steps, record=True, reference=True)
        for seed in plan.seeds:
            t0 = time.monotonic()
            check.reference(w, seed)
            took = time.monotonic() - t0
            taken_torch += took
            print(
                f"| torch {no_harm_label(w)} seed {seed} | {est:.1f} | {took:.1f} | {took / est:.2f} |"
            )
    cached = check.cost(timings, 1)
    t0 = time.monotonic()
    verdict = check.check(lambda: make_scaler(args.rule, device="cpu"), args.rule)
    took = time.monotonic() - t0
    print(f"| {args.rule}, every workload | {cached:.1f} | {took:.1f} | {took / cached:.2f} |")
    total = taken_torch + took
    print(f"| the check, torch uncached | {uncached:.1f} | {total:.1f} | {total / uncached:.2f} |")
    print(
        f"\n{args.rule}: {'passed' if verdict.passed else 'failed: ' + '; '.join(verdict.reasons)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
