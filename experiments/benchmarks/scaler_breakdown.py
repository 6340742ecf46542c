"""Where a scaler's fixed cost per step goes: the median time of each of its calls in a loop.

The small conv net of ``scaler_overhead.py`` (about 0.85 ms a fp16 step on one CPU thread) trains
with ``torch.amp.GradScaler`` and with each ``--rules`` scaler in turn; every call of the
scaler's methods named below (and of the parts of a guarded step) is timed inside the training
loop, where the code runs with cold caches after each forward and backward pass (a call timed in
a tight loop of its own runs 3-4 times faster and misleads). Prints the median microseconds per
step of each, after ``--warmup`` steps.

Usage::

    OMP_NUM_THREADS=1 python experiments/benchmarks/scaler_breakdown.py --rules torch,auto
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scaler_overhead  # noqa: E402  (the small model, shared)

import autoscale  # noqa: E402
from autoscale.scalers import scaler as scaler_mod  # noqa: E402

# the scaler's own calls; nested ones are timed inside their callers' times
METHODS = (
    "scale",
    "_guard",
    "unscale_",
    "_one_pass_grads",
    "_unscale_with_amax",
    "_inv_scale",
    "_maybe_opt_step",
    "_agree",
    "_read_on_host",
    "update",
    "_set_scale",
    "_end_step",
)
GRADSCALER = ("scale", "unscale_", "_maybe_opt_step", "update")


def timed(acc: dict[str, list[int]], key: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            acc.setdefault(key, []).append(time.perf_counter_ns() - t0)

    return wrapper


def breakdown(name: str, steps: int, warmup: int) -> dict[str, float]:
    """Median microseconds per call of each timed call, for scaler ``name`` (or GradScaler)."""
    torch.manual_seed(0)
    model = scaler_overhead.small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc: dict[str, list[int]] = {}
    if name == "GradScaler":
        scaler = torch.amp.GradScaler("cpu")
        for m in GRADSCALER:
            setattr(scaler, m, timed(acc, m, getattr(scaler, m)))
    else:
        scaler = autoscale.get_scaler(name, device="cpu")
        for m in METHODS:
            setattr(scaler, m, timed(acc, m, getattr(scaler, m)))
        scaler.controller.step = timed(acc, "controller.step", scaler.controller.step)
        guard = getattr(scaler.rule, "guard_limit", None)
        if scaler.rule.has_guard and guard is not None:
            scaler.rule.guard_limit = timed(acc, "rule.guard_limit", guard)
    real_stats = scaler_mod.sv.step_stats
    scaler_mod.sv.step_stats = timed(acc, "step_stats", real_stats)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    try:
        for i in range(warmup + steps):
            if i == warmup:
                acc.clear()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
    finally:
        scaler_mod.sv.step_stats = real_stats
    return {k: statistics.median(v) / 1000 for k, v in acc.items() if len(v) >= steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rules", default="torch,auto", help="comma-separated scalers")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--warmup", type=int, default=100)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = ["GradScaler", *[r for r in args.rules.split(",") if r]]
    results = {n: breakdown(n, args.steps, args.warmup) for n in names}
    keys = list(dict.fromkeys(k for r in results.values() for k in r))
    print(f"median us per call, {args.steps} steps after {args.warmup}; torch {torch.__version__}")
    print(f"{'call':<20}" + "".join(f"{n:>12}" for n in names))
    for k in keys:
        cells = "".join(
            f"{results[n][k]:>12.1f}" if k in results[n] else f"{'':>12}" for n in names
        )
        print(f"{k:<20}{cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
