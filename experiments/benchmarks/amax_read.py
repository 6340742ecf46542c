"""What reading the gradients' amax costs next to GradScaler's unscale, op by op.

``auto`` (``amax-loss``) needs max |g| of the scaled gradients every step. Its one-pass unscale
(``autoscale/scalers/unscale.py``) reads it with ``torch.aminmax`` per tensor and, on a CPU,
multiplies each tensor by 1/scale right after its read, while it is still in cache (elsewhere
``torch._foreach_mul_`` after all the reads); where the rule reads the RMS too (a neural policy),
each tensor's 2-norm follows its multiply. GradScaler's unscale is one fused op that multiplies
while it checks for inf/NaN (``torch._amp_foreach_non_finite_check_and_unscale_``). This times
every exact way torch's ops offer to get max |g|, beside the multiply and the fused unscale, on the
gradients of the scaler-overhead benchmark's MLP (``--depth`` x ``--width`` fp32 parameters),
interleaved in one process; medians of ``--repeats`` calls, microseconds, and each op's time over
the fused unscale's.

    python experiments/benchmarks/amax_read.py [--threads 1] [--out experiments/results/amax_read.md]

``--small`` times them on the gradients of the scaler-overhead benchmark's small conv net instead
(six tensors of 4 to 2,560 elements), where each op's fixed cost, not memory, is the time: the
floor under ``auto``'s per-step overhead on a CPU.

    python experiments/benchmarks/amax_read.py --small --threads 1 --out experiments/results/amax_read_small.md
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch


def grads_of(depth: int, width: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(width, width), (width,)] * (depth + 1)
    return [torch.randn(s, generator=g) for s in shapes]


SMALL_SHAPES = [(4, 3, 3, 3), (4,), (4, 4, 3, 3), (4,), (10, 256), (10,)]  # the small conv net


def small_grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SMALL_SHAPES]


def ops(grads: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    inv = torch.tensor(1.0)
    flag = torch.zeros(1)
    buf = torch.empty(2 * len(grads))
    pairs = list(zip(buf[0::2].unbind(), buf[1::2].unbind()))
    outs = torch.empty(len(grads)).unbind()

    def aminmax():  # autoscale's read (scalers/grad_stats.py AbsMax)
        for g, out in zip(grads, pairs):
            torch.aminmax(g, out=out)
        return torch.linalg.vector_norm(buf, math.inf)

    def read_then_multiply():  # every read, then every multiply: the one-pass unscale before
        aminmax()
        torch._foreach_mul_(grads, inv)

    def read_and_multiply():  # autoscale's one-pass unscale on a CPU (AbsMax with then_mul)
        for g, out in zip(grads, pairs):
            torch.aminmax(g, out=out)
            g.mul_(inv)
        return torch.linalg.vector_norm(buf, math.inf)

    norms = torch.empty(len(grads))
    norm_outs = norms.unbind()

    def stats_then_unscale():  # a neural policy's read before: amax, 2-norms, GradScaler's unscale
        aminmax()
        sumsq = torch._foreach_norm(grads, 2, dtype=torch.float32)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
        return sumsq

    def stats_and_multiply():  # its one pass now: amax, multiply, 2-norm, per tensor in cache
        for g, out, norm in zip(grads, pairs, norm_outs):
            torch.aminmax(g, out=out)
            g.mul_(inv)
            torch.linalg.vector_norm(g, 2, dtype=torch.float32, out=norm)
        return torch.linalg.vector_norm(buf, math.inf), norms.square().sum()

    flat = torch.empty(sum(g.numel() for g in grads))
    pair = torch.empty(2)
    pair_outs = pair.unbind()

    def cat_then_aminmax():  # one copy of all of them, one read of it
        torch.cat([g.view(-1) for g in grads], out=flat)
        torch.aminmax(flat, out=pair_outs)
        return torch.linalg.vector_norm(pair, math.inf)

    def cat_then_norm():
        torch.cat([g.view(-1) for g in grads], out=flat)
        return torch.linalg.vector_norm(flat, math.inf)

    def amax_and_amin():
        return max(max(float(g.amax()), -float(g.amin())) for g in grads)

    def amax_only():  # not max |g|: the lower bound of a read
        for g, out in zip(grads, outs):
            torch.amax(g, dim=tuple(range(g.dim())), out=out)

    return {
        "aminmax per tensor (autoscale's amax read)": aminmax,
        "amax + amin per tensor": amax_and_amin,
        "linalg.vector_norm(inf) per tensor": lambda: [
            torch.linalg.vector_norm(g, math.inf) for g in grads
        ],
        "_foreach_norm(inf)": lambda: torch._foreach_norm(grads, math.inf),
        "cat of all, then aminmax": cat_then_aminmax,
        "cat of all, then linalg.vector_norm(inf)": cat_then_norm,
        "_foreach_max(_foreach_abs)": lambda: torch._foreach_max(torch._foreach_abs(grads)),
        "abs().max() per tensor": lambda: [g.abs().max() for g in grads],
        "amax per tensor (max g only: not max |g|)": amax_only,
        "_foreach_mul_ (autoscale's unscale multiply)": lambda: torch._foreach_mul_(grads, inv),
        "aminmax of all, then _foreach_mul_ (the one-pass unscale before)": read_then_multiply,
        "aminmax and mul_ per tensor (autoscale's one-pass unscale)": read_and_multiply,
        "aminmax, _foreach_norm(2), fused unscale (amax and RMS, before)": stats_then_unscale,
        "aminmax, mul_ and 2-norm per tensor (amax and RMS, one pass)": stats_and_multiply,
        "GradScaler's fused unscale": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            grads, flag, inv
        ),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--out", default=None, help="write the table here as markdown too")
    p.add_argument("--small", action="store_true", help="the small conv net's gradients")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    grads = small_grads() if args.small else grads_of(args.depth, args.width)
    table = ops(grads)
    times: dict[str, list[float]] = {k: [] for k in table}
    for f in table.values():  # warm up
        for _ in range(20):
            f()
    for _ in range(args.repeats):  # interleaved: drift in the machine's load hits every op alike
        for name, f in table.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    med = {k: 1e6 * statistics.median(v) for k, v in times.items()}
    base = med["GradScaler's fused unscale"]
    n = sum(g.numel() for g in grads)
    lines = [
        "# Reading the amax, op by op",
        "",
        f"`python experiments/benchmarks/amax_read.py{' --small' if args.small else ''}"
        f"{f' --threads {args.threads}' if args.threads else ''}`"
        f" ({datetime.now(UTC):%Y-%m-%d}, {platform.processor() or platform.machine()}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads)",
        "",
        f"{len(grads)} fp32 gradients, {n:,} elements ({4 * n / 2**20:.1f} MiB); medians of "
        f"{args.repeats} interleaved calls.",
        "",
        "| op | us | / fused unscale |",
        "|---|---|---|",
        *(f"| {k} | {v:.1f} | {v / base:.2f} |" for k, v in med.items()),
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
