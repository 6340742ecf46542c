"""What one more Python call costs on a scaler's hot path, inside the training loop.

The small model's loop of ``scaler_overhead.py`` (``measure_small``: GradScaler and the rule in
turn, 21 rounds of 60-step blocks) runs with ``--rule``'s scaler as it is and with ``--calls``
calls of an empty function added at the start of its ``update``, alternating, ``--runs`` times
each. Prints, for each run, the per-step overhead against GradScaler and the time inside the
scaler's calls over GradScaler's (microseconds): the difference between the two variants is what
that many calls cost where the code runs with the caches a backward pass left.

Usage::

    OMP_NUM_THREADS=1 python experiments/benchmarks/call_cost.py --rule auto --calls 20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scaler_overhead  # noqa: E402  (the small model and its loop, shared)

from autoscale.scalers.scaler import LossScaler  # noqa: E402


def _empty() -> None:
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rule", default="auto")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    bench = scaler_overhead.parse_args(
        ["--rules", args.rule, "--optimizers", "adamw", "--skip-large", "--device", "cpu"]
    )
    update = LossScaler.update

    def padded(self, new_scale=None):
        for _ in range(args.calls):
            _empty()
        return update(self, new_scale)

    print(f"{args.rule}: per-step overhead us / scaler us over GradScaler's, per run")
    try:
        for run in range(args.runs):
            for label, method in (("as it is", update), (f"+{args.calls} calls", padded)):
                LossScaler.update = method
                (row,) = scaler_overhead.measure_small(bench, [args.rule])
                extra = row["rule_us"] - row["base_us"]
                print(f"run {run + 1} {label:>12}: {row['per_step_us']:6.1f} / {extra:6.1f}")
    finally:
        LossScaler.update = update
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
