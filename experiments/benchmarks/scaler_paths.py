"""GradScaler's own ``scale``/``unscale_`` against LossScaler's shorter forms, in one process.

:class:`~autoscale.scalers.scaler.LossScaler` computes GradScaler's product (``scale``) and
1/scale (``unscale_``) itself where GradScaler's methods come next in its class order
(``_plain_gradscaler``); set False on an instance, it calls GradScaler's as before. This trains
the small model of ``scaler_overhead.py`` under GradScaler and under each rule both ways, in
60-step blocks taken in turn (the order reversed every round), and prints each one's median
block step and its median overhead over GradScaler's block of the same round: the change
measured side by side, where separate runs of ``scaler_overhead.py`` differ by more than it on a
shared machine.

Usage::

    OMP_NUM_THREADS=1 python experiments/benchmarks/scaler_paths.py --rules torch,auto --rounds 201
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

import autoscale

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scaler_overhead  # noqa: E402  (the small model, shared)


def _job(kind: str, model: torch.nn.Module, batch) -> scaler_overhead.Job:
    """``scaler_overhead``'s small-model job under GradScaler, or rule ``R`` by path ``R:PATH``."""
    if kind == "GradScaler":
        scaler = torch.amp.GradScaler("cpu")
    else:
        rule, path = kind.split(":")
        scaler = autoscale.get_scaler(rule, device="cpu")
        scaler._plain_gradscaler = path == "short"
    loss = torch.nn.functional.cross_entropy
    cpu = torch.device("cpu")
    return scaler_overhead.Job(
        kind, scaler, copy.deepcopy(model), False, cpu, torch.float16, batch, loss
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rules", default="torch,auto")
    ap.add_argument("--rounds", type=int, default=201)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kinds = ["GradScaler"] + [
        f"{r}:{p}" for r in args.rules.split(",") for p in ("gradscaler", "short")
    ]
    g = torch.Generator(device="cpu").manual_seed(0)
    batch = (torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g))
    model = scaler_overhead.small_model()
    jobs = [_job(k, model, batch) for k in kinds]
    for j in jobs:  # warm-up
        j.block(args.steps)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for j in jobs if r % 2 == 0 else jobs[::-1]:
            times[j.label].append(j.block(args.steps) * 1e6)
    print(f"torch {torch.__version__}, {args.rounds} rounds of {args.steps}-step blocks")
    print("| scaler | path | median step us | over GradScaler us (median of rounds) |")
    print("|---|---|---:|---:|")
    for k in kinds:
        over = [a - b for a, b in zip(times[k], times["GradScaler"])]
        rule, _, path = k.partition(":")
        step = statistics.median(times[k])
        print(f"| {rule} | {path or '-'} | {step:.1f} | {statistics.median(over):.1f} |")


if __name__ == "__main__":
    main()
