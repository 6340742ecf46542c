"""GradScaler's own ``scale``/``unscale_`` against LossScaler's shorter forms, in one process.

:class:`~autoscale.scalers.scaler.LossScaler` computes GradScaler's product (``scale``) and
1/scale (``unscale_``) itself where GradScaler's methods come next in its class order
(``_plain_gradscaler``); set False on an instance, it calls GradScaler's as before. This trains
the small model of ``scaler_overhead.py`` under GradScaler and under each rule both ways, in
60-step blocks taken in turn (in ``scaler_overhead.rotation``'s order), and prints each one's median
block step and its median overhead over GradScaler's block of the same round: the change
measured side by side, where separate runs of ``scaler_overhead.py`` differ by more than it on a
shared machine.

Path ``no_grad`` is the short path with the one-pass unscale of the rules that read the gradient
amax (``GradReader.unscale``) run inside ``torch.no_grad()``'s context, as it was before it turned
autograd off itself: ``--rules auto --paths short,no_grad`` measures that change.

Usage::

    OMP_NUM_THREADS=1 python experiments/benchmarks/scaler_paths.py --rules torch,auto --rounds 201
    OMP_NUM_THREADS=1 python experiments/benchmarks/scaler_paths.py --rules auto --paths short,no_grad
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
        scaler._plain_gradscaler = path != "gradscaler"
        if path == "no_grad":
            scaler.grads.unscale = _under_no_grad(scaler.grads.unscale)
    loss = torch.nn.functional.cross_entropy
    cpu = torch.device("cpu")
    return scaler_overhead.Job(
        kind, scaler, copy.deepcopy(model), False, cpu, torch.float16, batch, loss
    )


def _under_no_grad(unscale):
    """``unscale`` called inside ``torch.no_grad()``'s context (autograd is off within it, so
    the function's own switch does nothing there)."""

    def wrapped(*args, **kwargs):
        with torch.no_grad():
            return unscale(*args, **kwargs)

    return wrapped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rules", default="torch,auto")
    ap.add_argument("--rounds", type=int, default=201)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument(
        "--paths", default="gradscaler,short", help="comma-separated: gradscaler, short, no_grad"
    )
    args = ap.parse_args()
    paths = args.paths.split(",")
    unknown = sorted(set(paths) - {"gradscaler", "short", "no_grad"})
    if unknown:
        ap.error(f"unknown path {unknown[0]!r}; choose from gradscaler, short, no_grad")
    torch.set_num_threads(1)
    kinds = ["GradScaler"] + [f"{r}:{p}" for r in args.rules.split(",") for p in paths]
    g = torch.Generator(device="cpu").manual_seed(0)
    batch = (torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g))
    model = scaler_overhead.small_model()
    jobs = [_job(k, model, batch) for k in kinds]
    for j in jobs:  # warm-up
        j.block(args.steps)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for j in scaler_overhead.rotation(jobs, r):
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
