"""Step time of fp16 on a CPU, emulated and native, against fp32 (target: emulated <= 1.5x fp32).

Each model trains the project's instrumented step (``TrainingRun``: AdamW, gradient clipping, the
``torch`` rule for fp16; random init, 4 x 64 tokens) on three copies side by side: fp32, fp16
emulated (``fp16="emulated"``: fp32 products rounded to fp16) and fp16 native (torch's fp16 CPU
kernels). After a warm-up step each, steps alternate between the copies (the order flips every
round) so that the load of other processes hits them alike; the ratios are of median step times,
and the median of the per-round ratios is printed beside them.

    python experiments/benchmarks/fp16_speed.py --models gpt2,gpt2-tiny,mlp --rounds 5 \\
        --out experiments/results/fp16_speed.md

Native fp16 GPT-2 steps take minutes here: where the native warm-up step took over
``--native-slow-s``, only ``--native-rounds`` (default 1) native steps are timed.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

TARGET = 1.5  # emulated fp16 step / fp32 step, for GPT-2 124M


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,gpt2-tiny,mlp", help="comma-separated presets")
    p.add_argument(
        "--rounds", type=int, default=5, help="timed steps per copy (at least; see --min-seconds)"
    )
    p.add_argument(
        "--min-seconds", type=float, default=3.0, help="time at least this much fp32 per model"
    )
    p.add_argument(
        "--native-rounds",
        type=int,
        default=1,
        help="timed native fp16 steps where its warm-up step took over --native-slow-s",
    )
    p.add_argument("--native-slow-s", type=float, default=30.0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave as is)")
    p.add_argument("--out", type=Path, help="also write the table to this markdown file")
    return p.parse_args(argv)


def build(model: str, path: str, args) -> object:
    from autoscale.training import TrainingRun, WorkloadSpec

    spec = WorkloadSpec(
        model=model, init="random", batch_size=args.batch_size, seq_len=args.seq_len
    )
    if path == "fp32":
        return TrainingRun(spec.replace(dtype="fp32"), "static", init_scale=1.0)
    return TrainingRun(spec.replace(fp16=path), "torch")


def timed(run) -> float:
    start = time.perf_counter()
    run.step()
    return time.perf_counter() - start


def bench(model: str, args) -> dict:
    paths = ["fp32", "emulated", "native"]
    runs = {p: build(model, p, args) for p in paths}
    warm = {p: timed(run) for p, run in runs.items()}  # first-call costs, allocations
    rounds = min(200, max(args.rounds, math.ceil(args.min_seconds / warm["fp32"])))
    native_rounds = args.native_rounds if warm["native"] > args.native_slow_s else rounds
    times: dict[str, list[float]] = {p: [] for p in paths}
    for r in range(rounds):
        for p in paths if r % 2 == 0 else paths[::-1]:
            if p != "native" or len(times["native"]) < native_rounds:
                times[p].append(timed(runs[p]))
    med = {p: statistics.median(t) for p, t in times.items() if t}
    paired = [e / f for e, f in zip(times["emulated"], times["fp32"], strict=True)]
    return {
        "model": model,
        "steps": {p: len(t) for p, t in times.items()},
        "median_s": med,
        "emulated_over_fp32": med["emulated"] / med["fp32"],
        "emulated_over_fp32_paired": statistics.median(paired),
        "native_over_fp32": med["native"] / med["fp32"] if "native" in med else None,
        "native_over_emulated": med["native"] / med["emulated"] if "native" in med else None,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for model in [m for m in args.models.split(",") if m]:
        print(f"{model}...", file=sys.stderr, flush=True)
        rows.append(bench(model, args))
    load = ""
    try:
        import os

        load = f", load average {os.getloadavg()[0]:.1f} at the end"
    except OSError:
        pass
    lines = [
        "| model | timed steps | fp32 s/step | fp16 emulated s/step | fp16 native s/step "
        "| emulated / fp32 (paired) | native / fp32 | native / emulated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["median_s"]
        has_native = r["native_over_fp32"] is not None
        n = r["steps"]["native"]
        native = f"{m['native']:.4f} ({n} step{'s' if n != 1 else ''})" if has_native else "-"
        ratios = (
            f"{r['native_over_fp32']:.1f} | {r['native_over_emulated']:.1f}"
            if has_native
            else "- | -"
        )
        lines.append(
            f"| {r['model']} | {r['steps']['fp32']} | {m['fp32']:.4f} | {m['emulated']:.4f} | {native} "
            f"| {r['emulated_over_fp32']:.2f} ({r['emulated_over_fp32_paired']:.2f}) | {ratios} |"
        )
    gpt2 = next((r for r in rows if r["model"] == "gpt2"), None)
    if gpt2 is not None:
        ok = gpt2["emulated_over_fp32"] <= TARGET
        lines += [
            "",
            f"GPT-2 124M: the emulated fp16 step takes {gpt2['emulated_over_fp32']:.2f}x the fp32 "
            f"step (target <= {TARGET}x: {'met' if ok else 'NOT met'}).",
        ]
    header = (
        f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; {platform.machine()}, "
        f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}{load}; "
        f"batch {args.batch_size} x {args.seq_len} tokens (mlp: {args.batch_size} examples)."
    )
    text = "\n".join([header, "", *lines])
    print(text)
    if args.out:
        args.out.write_text(
            "# fp16 step time on the CPU: emulated and native against fp32\n\n`python "
            + " ".join(["experiments/benchmarks/fp16_speed.py", *(argv or sys.argv[1:])])
            + "`\n\n"
            + text
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
