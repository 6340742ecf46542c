"""Overhead of the instrumented ``TrainingRun.step`` over a bare AMP loop with ``torch.amp.GradScaler``.

Both loops train the same model (same init) on the same batches with the same recipe: autocast
forward, ``scaler.scale(loss).backward()``, ``unscale_``, gradient clipping, ``step``, ``update``.
The instrumented step adds the scaler's gradient statistics, the precision-loss counts and one
extra host sync. Short blocks of steps alternate between the two loops in one process, so drift in
the machine's load hits both alike; the ratio is of the median step times, and, less sensitive to
other processes on a shared machine, of the lower quartiles.

    python experiments/benchmarks/step_overhead.py                 # gpt2-tiny, bf16 (CPU default)
    python experiments/benchmarks/step_overhead.py --dtype fp16 --model gpt2 --device cuda

Target: ratio <= 1.05. fp16 on a CPU is emulated and slow, which hides overhead: bf16 is the
default there.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from autoscale.training import TrainingRun, WorkloadSpec
from autoscale.training.run import AMP_DTYPES


def bare_loop(run: TrainingRun):
    """A plain AMP step on a copy of ``run``'s model and data (GradScaler, no autoscale)."""
    spec = run.spec
    model = copy.deepcopy(run.model)
    data = copy.deepcopy(run.data)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, fused=run.device.type == "cuda")
    scaler = torch.amp.GradScaler(run.device.type)
    dtype = AMP_DTYPES[spec.dtype]

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        batch = data.next_batch()
        with torch.autocast(run.device.type, dtype=dtype, enabled=dtype is not None):
            loss = data.loss(model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, spec.clip)
        scaler.step(optimizer)
        scaler.update()
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--dtype", default="bf16", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=60, help="blocks per loop (alternating)")
    parser.add_argument("--block-steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    spec = WorkloadSpec(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
    )
    run = TrainingRun(spec, "torch")
    bare = bare_loop(run)

    def instrumented() -> float:
        start = time.perf_counter()
        run.step()
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for fn in (instrumented, bare):  # warm-up block each
        for _ in range(args.block_steps):
            fn()
    times: dict[str, list[float]] = {"instrumented": [], "bare": []}
    for _ in range(args.blocks):
        for name, fn in (("instrumented", instrumented), ("bare", bare)):
            times[name].extend(fn() for _ in range(args.block_steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: statistics.quantiles(v, n=4)[0] for k, v in times.items()}
    print(
        f"{args.model} {args.dtype} on {run.device} ({torch.get_num_threads()} threads), batch "
        f"{args.batch_size}x{args.seq_len}, {args.blocks} alternating blocks of {args.block_steps} steps"
    )
    print("                                     median  lower quartile  (ms/step)")
    print(
        f"  bare AMP loop (GradScaler):      {1000 * med['bare']:8.2f} {1000 * low['bare']:12.2f}"
    )
    print(
        f"  TrainingRun.step (instrumented): {1000 * med['instrumented']:8.2f} {1000 * low['instrumented']:12.2f}"
    )
    ratio, ratio_low = med["instrumented"] / med["bare"], low["instrumented"] / low["bare"]
    print(f"  ratio instrumented / bare:       {ratio:8.3f} {ratio_low:12.3f}   (target <= 1.05)")


if __name__ == "__main__":
    main()
