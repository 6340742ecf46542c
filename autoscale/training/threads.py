"""Torch's CPU threads for autoscale's own training steps, from the cores this process may use and
the load that other processes put on them.

Why it matters: torch starts one OpenMP thread per physical core, and a parallel region (every
matrix product, every elementwise kernel) ends when its slowest thread does. A thread that shares
its core with another busy process waits for the scheduler's time slice, at every region: on a
2-core machine with one other CPU-bound process, a gpt2-tiny step takes several times longer with
torch's 2 threads than with 1, and varies widely from one step to the next
(``experiments/benchmarks/threads_under_load.py``, results in ``experiments/results/threads.md``).
A search that timed its steps in an idle moment would then run out of budget while recording.

So the search runs as many threads as there are cores that other processes leave idle: at least
one, at most torch's own default; and looks again when its steps turn out slower than measured.
``OMP_NUM_THREADS`` set by the user wins (said, not overridden).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

__all__ = ["ThreadChoice", "fit_threads", "other_load", "pick_threads", "usable_cores"]

_DEFAULT: list[int] = []  # torch's own thread count, before autoscale first changed it


@dataclass(frozen=True)
class ThreadChoice:
    """The threads torch runs autoscale's steps with, and why.

    Attributes:
        threads: torch's intra-op threads now.
        cores: Cores this process may run on.
        busy: Cores' worth of CPU time other processes used while sampled (None: unknown here).
        source: ``"OMP_NUM_THREADS"`` (the user's, kept), ``"load"`` (chosen from the load) or
            ``"default"`` (torch's, no load information on this system).
    """

    threads: int
    cores: int
    busy: float | None
    source: str

    def describe(self) -> str:
        n = f"{self.threads} torch thread{'s' if self.threads != 1 else ''}"
        if self.source == "OMP_NUM_THREADS":
            return f"{n} (OMP_NUM_THREADS)"
        if self.busy is None:
            return f"{n} on {self.cores} cores"
        return f"{n} on {self.cores} cores ({self.busy:.1f} busy with other work)"


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:  # cgroup v2: "max 100000" or "200000 100000" (quota, period)
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def _cpu_times() -> tuple[int, int, int] | None:
    """(busy, total jiffies, CPUs) of the whole machine from ``/proc/stat``; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    head = lines[0].split()
    if not head or head[0] != "cpu":
        return None
    values = [int(v) for v in head[1:9]]  # user nice system idle iowait irq softirq steal
    values += [0] * (8 - len(values))
    idle = values[3] + values[4]
    cpus = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
    return sum(values) - idle, sum(values), max(1, cpus)


def other_load(sample_s: float = 0.25) -> float | None:
    """Cores' worth of CPU that other processes used over ``sample_s`` seconds (this process's own
    CPU time taken out; a VM's stolen time counts as busy); None where ``/proc/stat`` is absent."""
    first = _cpu_times()
    if first is None:
        return None
    own0, t0 = time.process_time(), time.monotonic()
    time.sleep(sample_s)
    second = _cpu_times()
    own1, t1 = time.process_time(), time.monotonic()
    if second is None or second[1] <= first[1]:
        return None
    busy_share = (second[0] - first[0]) / (second[1] - first[1])
    own = (own1 - own0) / max(t1 - t0, 1e-6)
    return max(0.0, busy_share * second[2] - own)


def pick_threads(cores: int, busy: float | None, ceiling: int) -> int:
    """Threads for ``cores`` usable cores of which others keep ``busy`` busy: the idle ones (a
    core counts as taken once others use more than a fifth of it), at least 1, at most
    ``ceiling``."""
    if busy is None:
        return max(1, min(cores, ceiling))
    idle = cores - math.ceil(max(0.0, busy - 0.2))
    return max(1, min(idle, ceiling))


def fit_threads(sample_s: float = 0.25) -> ThreadChoice:
    """Set torch's threads for the load now (see the module docstring) and say what was chosen;
    with ``OMP_NUM_THREADS`` set, torch's threads stay as they are."""
    import torch

    if not _DEFAULT:
        _DEFAULT.append(torch.get_num_threads())
    cores = usable_cores()
    if os.environ.get("OMP_NUM_THREADS"):
        return ThreadChoice(torch.get_num_threads(), cores, None, "OMP_NUM_THREADS")
    busy = other_load(sample_s)
    threads = pick_threads(cores, busy, _DEFAULT[0])
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return ThreadChoice(threads, cores, busy, "default" if busy is None else "load")
