"""Why a search measured fast steps and then recorded slow ones: torch's threads against a busy core.

One process steps a workload (gpt2-tiny by default, autoscale's fp16 path) with 1 torch thread and
with one per usable core, in alternating blocks, twice: with the machine as it is, and with
``--others N`` CPU-bound processes (plain Python loops) started beside it. For each it prints
the median, 90th percentile and worst step time, and the ratio of the many-thread median to the
one-thread median; then the threads ``autoscale.training.threads.fit_threads`` picks under each
load. All numbers of one run come from the same process, side by side.

    python experiments/benchmarks/threads_under_load.py                 # gpt2-tiny, 1 other process
    python experiments/benchmarks/threads_under_load.py --model mlp --steps 200

Run it on an otherwise idle machine: the "as it is" rows are only idle if nothing else runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from autoscale.training import TrainingRun, WorkloadSpec
from autoscale.training.threads import fit_threads, usable_cores


def _spin(stop) -> None:  # a CPU-bound process of someone else's
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def _blocks(run: TrainingRun, counts: list[int], steps: int, block: int) -> dict[int, list[float]]:
    times: dict[int, list[float]] = {n: [] for n in counts}
    for b in range(0, steps, block):
        order = counts if (b // block) % 2 == 0 else counts[::-1]
        for n in order:
            torch.set_num_threads(n)
            run.step()  # the first step after a change of threads is not timed
            for _ in range(block):
                t0 = time.perf_counter()
                run.step()
                times[n].append(time.perf_counter() - t0)
    return times


def _row(label: str, n: int, t: list[float]) -> str:
    q = statistics.quantiles(t, n=10)
    return (
        f"{label:<22} {n:>7}  {1000 * statistics.median(t):>9.1f}  {1000 * q[-1]:>9.1f}"
        f"  {1000 * max(t):>9.1f}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--steps", type=int, default=120, help="timed steps per thread count and load")
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--others", type=int, default=1, help="CPU-bound processes beside it")
    args = p.parse_args(argv)
    cores = usable_cores()
    counts = sorted({1, cores})
    spec = WorkloadSpec(model=args.model, scenario="clean", dtype="fp16")
    run = TrainingRun(spec, "torch")
    for _ in range(3):
        run.step()
    print(f"{args.model}, fp16, {cores} usable cores; step times in ms over {args.steps} steps")
    print(f"{'load':<22} {'threads':>7}  {'median':>9}  {'p90':>9}  {'worst':>9}")
    ratios, picks = {}, {}
    for others in (0, args.others):
        stop = mp.Event()
        procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(others)]
        for proc in procs:
            proc.start()
        try:
            time.sleep(1.0 if others else 0.0)  # let the others run before sampling
            label = "as it is" if not others else f"+{others} busy process(es)"
            saved = torch.get_num_threads()
            picks[label] = fit_threads(0.5).describe()
            torch.set_num_threads(saved)
            times = _blocks(run, counts, args.steps, args.block)
            for n in counts:
                print(_row(label, n, times[n]))
            ratios[label] = statistics.median(times[counts[-1]]) / statistics.median(times[1])
        finally:
            stop.set()
            for proc in procs:
                proc.join()
    for label, r in ratios.items():
        print(
            f"{label}: median step with {counts[-1]} threads / with 1 = {r:.2f}; "
            f"fit_threads picks {picks[label]}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
