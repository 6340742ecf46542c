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
import statistics
import sys
import time
from pathlib import Path

import torch

import autoscale

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scaler_overhead  # noqa: E402  (the small model, shared)


def _setup(kind: str):
    torch.manual_seed(0)
    model = scaler_overhead.small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if kind == "GradScaler":
        return model, opt, torch.amp.GradScaler("cpu")
    rule, path = kind.split(":")
    scaler = autoscale.get_scaler(rule, device="cpu")
    scaler._plain_gradscaler = path == "short"
    return model, opt, scaler


def _block(model, opt, scaler, x, y, steps: int) -> float:
    """Microseconds per step over ``steps`` steps."""
    t = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    return (time.perf_counter() - t) / steps * 1e6


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
    runs = {k: _setup(k) for k in kinds}
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    for k in kinds:  # warm up
        _block(*runs[k], x, y, 200)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k in kinds if r % 2 == 0 else kinds[::-1]:
            times[k].append(_block(*runs[k], x, y, args.steps))
    print(f"torch {torch.__version__}, {args.rounds} rounds of {args.steps}-step blocks")
    print("| scaler | path | median step us | over GradScaler us (median of rounds) |")
    print("|---|---|---:|---:|")
    for k in kinds:
        over = [a - b for a, b in zip(times[k], times["GradScaler"])]
        rule, _, path = k.partition(":")
        print(
            f"| {rule} | {path or '-'} | {statistics.median(times[k]):.1f} | {statistics.median(over):.1f} |"
        )


if __name__ == "__main__":
    main()
