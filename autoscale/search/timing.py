"""What real training costs here: step times measured under a time limit, and the no-harm
check's shape (whose cost the plan and the check both read).

:func:`measure` times building a run, a few real steps, an evaluation and recorded steps of a
workload within a limit (a step that would run past it is interrupted by an alarm, and reported as
a lower bound); :class:`Timings` holds them per :func:`workload_key` (what the step time depends
on), and every cost estimate of the search (:mod:`~autoscale.search.plan`,
:mod:`~autoscale.search.replan`, the validator, the no-harm check) is computed from them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from autoscale.search.budget import format_duration

__all__ = [
    "NoHarmPlan",
    "RECORD_SLOWDOWN",
    "Timing",
    "Timings",
    "measure",
    "measure_all",
    "time_limit",
    "workload_key",
]

RECORD_SLOWDOWN = 1.6  # a recorded step (histograms, backward amax) over a plain one, if unmeasured


@dataclass(frozen=True)
class Timing:
    """Measured costs of real training of one workload on this machine.

    Attributes:
        step_s: Seconds per real optimizer step.
        build_s: Seconds to build one run (model, data, optimizer).
        eval_s: Seconds of one held-out evaluation (``TrainingRun.eval_loss``).
        steps: Steps timed.
        complete: False when the first step did not finish in the time allowed (``step_s`` is
            then a lower bound).
        record_step_s: Seconds per recorded step (with the trace's histograms and backward amax).
    """

    step_s: float
    build_s: float
    eval_s: float
    steps: int
    complete: bool = True
    record_step_s: float | None = None

    @property
    def record_s(self) -> float:
        return self.record_step_s if self.record_step_s else RECORD_SLOWDOWN * self.step_s

    def run_s(self, steps: int, *, record: bool = False) -> float:
        """Seconds to build a run, take ``steps`` steps and evaluate it."""
        return self.build_s + steps * (self.record_s if record else self.step_s) + self.eval_s

    def describe(self) -> str:
        if not self.complete:
            return (
                f"one real step takes more than {format_duration(self.step_s)} here (not finished)"
            )
        return (
            f"{_fmt_s(self.step_s)} per real step, {_fmt_s(self.build_s)} to build a run, "
            f"{_fmt_s(self.eval_s)} per evaluation"
        )


def _model_label(key: str) -> str:
    """The model of a :func:`workload_key` (a path may hold slashes: cut at the dtype), short."""
    import re

    from autoscale.training.presets import is_user_workload, workload_label

    model = re.split(r"/(?:fp16|bf16|fp32)(?:/|$)", key)[0]
    return workload_label(model) if is_user_workload(model) else model


def workload_key(workload: Any) -> str:
    """What the step time depends on: the workload without its scenario's knobs and seed (a
    preference loss runs two forward passes, RL fine-tuning samples and scores completions first,
    so those scenarios count)."""
    d = workload.to_dict()
    keep = ("model", "dtype", "device", "batch_size", "seq_len", "grad_accum", "data", "init")
    extra = {"preference": "+pref", "rl-finetune": "+rlft"}.get(d["scenario"], "")
    return "/".join(str(d[k]) for k in keep if d.get(k) is not None) + extra


@dataclass(frozen=True)
class Timings:
    """Timing per workload (:func:`workload_key`)."""

    by_key: dict[str, Timing]

    def of(self, workload: Any) -> Timing:
        return self.by_key[workload_key(workload)]

    @property
    def complete(self) -> bool:
        return all(t.complete for t in self.by_key.values())

    def slowest(self) -> tuple[str, Timing]:
        key = max(self.by_key, key=lambda k: self.by_key[k].step_s)
        return key, self.by_key[key]

    def describe(self) -> str:
        if len(self.by_key) == 1:
            return next(iter(self.by_key.values())).describe()
        return "; ".join(
            f"{_model_label(k)}{'+pref' if k.endswith('+pref') else ''}: "
            f"{_fmt_s(t.step_s)} per step"
            for k, t in self.by_key.items()
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: dataclasses.asdict(t) for k, t in self.by_key.items()}

    def scaled(self, factor: float) -> Timings:
        """Every cost ``factor`` times as long (steps that run slower than they were measured)."""

        def scale(t: Timing) -> Timing:
            rec = t.record_step_s * factor if t.record_step_s else None
            return dataclasses.replace(
                t,
                step_s=t.step_s * factor,
                build_s=t.build_s * factor,
                eval_s=t.eval_s * factor,
                record_step_s=rec,
            )

        return Timings({k: scale(t) for k, t in self.by_key.items()})


def _fmt_s(s: float) -> str:
    return f"{1000 * s:.0f} ms" if s < 1 else format_duration(s)


class _TimeUp(BaseException):
    """Raised by the alarm of :func:`time_limit`.

    A ``BaseException``, as ``KeyboardInterrupt`` is: code that catches ``Exception`` to carry on
    (a logging handler's ``emit``, which prints the traceback and returns; a library's fallback)
    would otherwise swallow the alarm where it lands."""


def _importing(frame: Any) -> bool:
    """Whether ``frame`` runs inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[list[bool]]:
    """Interrupt the block after ``seconds`` with :class:`_TimeUp` (POSIX main thread; elsewhere
    no limit). Yields a one-item list that says whether the alarm fired."""
    fired = [False]
    if (
        not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield fired
        return

    active = [True]

    def on_alarm(signum: int, frame: Any) -> None:
        if not active[0]:
            return
        # Fire again shortly: in an import (interrupting one leaves a module half set up, and
        # a library's registrations with it), the alarm waits for the import to end; and the
        # exception can land where Python swallows it (a weakref callback or a __del__ run by
        # the garbage collector), which the next alarm follows up.
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        if _importing(frame):
            return
        fired[0] = True
        raise _TimeUp()

    def quiet_unraisable(unraisable: Any) -> None:  # a swallowed alarm is not an error to print
        if not isinstance(unraisable.exc_value, _TimeUp):
            previous_hook(unraisable)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    previous_hook, sys.unraisablehook = sys.unraisablehook, quiet_unraisable
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield fired
    except _TimeUp:  # a repeat of the alarm after the block handled the first
        pass
    finally:
        active[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        sys.unraisablehook = previous_hook


def measure(workload: Any, *, limit_s: float, steps: int = 4, step_share_s: float = 1.0) -> Timing:
    """Time building a run of ``workload``, a few real steps and two recorded ones, within
    ``limit_s`` seconds.

    A step that would run past the limit is interrupted (an alarm between torch operations) and
    reported as a lower bound, so a model too slow for the budget costs ``limit_s`` at most, not
    a step. The first step is a warm-up; later ones are timed while their total stays under
    ``step_share_s``.
    """
    from autoscale.training import TrainingRun

    times: list[float] = []
    recorded: list[float] = []
    build = eval_s = math.nan
    t_begin = time.perf_counter()
    t_step = t_begin
    with time_limit(limit_s) as fired:
        try:
            t0 = time.perf_counter()
            run = TrainingRun(workload, "static", init_scale=2.0**16)
            build = time.perf_counter() - t0
            if build < 0.2 * limit_s:  # the first build pays one-off imports: build again
                t0 = time.perf_counter()
                run = TrainingRun(workload, "static", init_scale=2.0**16)
                build = time.perf_counter() - t0
            for i in range(steps):
                t_step = time.perf_counter()
                run.step()
                times.append(time.perf_counter() - t_step)
                if i and sum(times[1:]) > step_share_s:
                    break
            # evaluation and one or two recorded steps, where the limit leaves room for them
            # (a recorded step of a large model can cost far more or about the same as a plain
            # one: the estimate of the recording phase, the largest, is measured, not guessed)
            left = limit_s - (time.perf_counter() - t_begin)
            if times[-1] < 1.0 or left > 4.0 * times[-1]:
                t0 = time.perf_counter()
                run.eval_loss()
                eval_s = time.perf_counter() - t0
                run.record = True
                for _ in range(2 if times[-1] < 1.0 else 1):
                    t0 = time.perf_counter()
                    run.step()
                    recorded.append(time.perf_counter() - t0)
        except (Exception, _TimeUp):
            if not fired[0]:
                raise
    if not times:
        lower = time.perf_counter() - (t_step if t_step > t_begin else t_begin)
        build = build if math.isfinite(build) else time.perf_counter() - t_begin
        return Timing(lower, build, _eval_estimate(workload, lower), 0, complete=False)
    step = statistics.median(times[1:]) if len(times) > 1 else times[0]
    if not math.isfinite(eval_s):
        eval_s = _eval_estimate(workload, step)
    record_step = min(recorded) if recorded else None
    return Timing(step, build, eval_s, len(times), record_step_s=record_step)


def _warm_up(workload: Any) -> None:
    """Build and step a run of the smallest preset once, untimed: the one-off imports of a cold
    process (the optimizer's first step imports ``torch._dynamo``, seconds on a fresh install)
    would otherwise be charged to the first workload's build, as if every run paid them."""
    from autoscale.training import TrainingRun, WorkloadSpec

    small = WorkloadSpec(
        model="mlp", scenario="clean", dtype=workload.dtype, device=workload.device, batch_size=4
    )
    with contextlib.suppress(Exception):  # a problem of the real workload shows when measured
        TrainingRun(small, "static", init_scale=2.0**16).step()


def measure_all(workloads: list[Any], *, limit_s: float, step_share_s: float) -> Timings:
    """:func:`measure` each distinct workload (by :func:`workload_key`) within ``limit_s`` in all;
    a workload measured last gets what the others left."""
    distinct: dict[str, Any] = {}
    for w in workloads:
        distinct.setdefault(workload_key(w), w)
    out: dict[str, Timing] = {}
    t_end = time.monotonic() + limit_s
    _warm_up(next(iter(distinct.values())))
    for i, (key, w) in enumerate(distinct.items()):
        share = max(1.0, (t_end - time.monotonic()) / (len(distinct) - i))
        out[key] = measure(w, limit_s=share, step_share_s=step_share_s)
    return Timings(out)


def _eval_estimate(workload: Any, step_s: float) -> float:
    # a forward pass is about a third of a training step
    return 0.35 * step_s * workload.eval_batches / max(1, workload.grad_accum)


# ---------------------------------------------------------------------- the no-harm check's share
@dataclass(frozen=True)
class NoHarmPlan:
    """The no-harm check: long runs of ``workloads`` (clean, and one drifting) next to ``torch``.

    Attributes:
        workloads: Clean workloads (``mlp`` and each model the search runs).
        steps: Real steps of each run (>= 1000).
        seeds: Seeds of ``torch`` (at least two: their spread is the seed noise).
        candidate_seeds: Seeds each candidate runs (the first of ``seeds``).
    """

    workloads: tuple[Any, ...]
    steps: int
    seeds: tuple[int, ...] = (0, 1)
    candidate_seeds: tuple[int, ...] = (0,)

    def cost(self, timings: Timings, candidates: int, cached: Callable[[Any, int], bool]) -> float:
        """Seconds for ``candidates`` candidates and the ``torch`` runs not cached yet."""
        total = 0.0
        for w in self.workloads:
            run = timings.of(w).run_s(self.steps)
            total += run * sum(1 for s in self.seeds if not cached(w, s))
            total += run * candidates * len(self.candidate_seeds)
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "workloads": [w.to_dict() for w in self.workloads],
            "steps": self.steps,
            "seeds": list(self.seeds),
            "candidate_seeds": list(self.candidate_seeds),
        }
