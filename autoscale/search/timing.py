"""What real training costs here: :func:`measure_all` times each workload (:class:`Timings`, by
:func:`workload_key`), and every cost estimate of the search is computed from them, the no-harm
check's (:class:`NoHarmPlan`) included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable
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
    "workload_key",
]

MARGIN = 1.2  # real-step phases (validation, the no-harm check) are reserved this much over their estimate
RECORD_SLOWDOWN = 1.6  # a recorded step (histograms, backward amax) over a plain one, if unmeasured


@dataclass(frozen=True)
class Timing:
    """Measured costs of real training of one workload on this machine.

    Attributes:
        step_s: Seconds per real optimizer step.
        build_s: Seconds to build one run (model, data, optimizer).
        eval_s: Seconds of one held-out evaluation.
        steps: Steps timed.
        complete: False when building the run took all the time allowed: ``step_s`` is then 0,
            a lower bound, as is every estimate made from it.
        record_step_s: Seconds per recorded step.
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

    def run_s(self, steps: int, *, record: bool = False, reference: bool = False) -> float:
        """Seconds to build a run, take ``steps`` steps and evaluate it (``reference``: with the
        long runs' sampled fp32 backward, :data:`REFERENCE_FACTOR`)."""
        step_s = (self.record_s if record else self.step_s) * (
            REFERENCE_FACTOR if reference else 1.0
        )
        return self.build_s + steps * step_s + self.eval_s

    def describe(self) -> str:
        if not self.complete:
            return (
                f"building one run takes {_fmt_s(self.build_s)} here, longer than measuring it "
                "was allowed (no step timed)"
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
    """What the step time depends on: the workload without its scenario's knobs and seed (but
    the preference and RL fine-tuning scenarios, which cost more a step)."""
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
        """The workload of the longest step (one not measured first: it is why a plan fails)."""
        key = max(self.by_key, key=lambda k: (not self.by_key[k].complete, self.by_key[k].step_s))
        return key, self.by_key[key]

    def describe(self) -> str:
        if len(self.by_key) == 1:
            return next(iter(self.by_key.values())).describe()
        return "; ".join(
            f"{_model_label(k)}{'+pref' if k.endswith('+pref') else ''}: "
            + (
                f"{_fmt_s(t.step_s)} per step"
                if t.complete
                else f"a build of {_fmt_s(t.build_s)}, no step timed"
            )
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


def _timed(action: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    action()
    return time.perf_counter() - t0


def measure(workload: Any, *, limit_s: float, steps: int = 4, step_share_s: float = 1.0) -> Timing:
    """Time building a run of ``workload``, a few real steps and two recorded ones, within
    ``limit_s`` seconds.

    Nothing is cut short: the time is checked after the build and between steps, and a step that
    runs past the limit finishes and is measured (its time is the step time, not a bound). So a
    measurement costs at most about the limit plus one step, or the build alone where building
    the run takes longer than the limit: no step is taken then (one might cost as much again), and
    the result is not ``complete``. The first step is a warm-up; later ones are timed while time
    is left and their total stays under ``step_share_s``; the evaluation and the recorded steps
    are measured where what is left holds them, and estimated otherwise.
    """
    from autoscale.training import TrainingRun

    t_begin = time.perf_counter()
    run = TrainingRun(workload, "static", init_scale=2.0**16)
    build = time.perf_counter() - t_begin
    if build < 0.2 * limit_s:  # the first build pays one-off imports: build again
        t0 = time.perf_counter()
        run = TrainingRun(workload, "static", init_scale=2.0**16)
        build = time.perf_counter() - t0

    def left() -> float:
        return limit_s - (time.perf_counter() - t_begin)

    if left() <= 0:
        return Timing(0.0, build, 0.0, 0, complete=False)
    times = [_timed(run.step)]
    while len(times) < steps and left() > 0 and sum(times[1:]) <= step_share_s:
        times.append(_timed(run.step))
    step = statistics.median(times[1:]) if len(times) > 1 else times[0]
    eval_s, record_step = _eval_estimate(workload, step), None
    # a recorded step of a large model can cost far more or about the same as a plain one: the
    # recording phase, the largest, is measured where time allows, not guessed
    if left() > 4.0 * times[-1]:
        eval_s = _timed(run.eval_loss)
        run.record = True
        recorded = [_timed(run.step)]
        if times[-1] < 1.0 and left() > 0:
            recorded.append(_timed(run.step))
        record_step = min(recorded)
    return Timing(step, build, eval_s, len(times), record_step_s=record_step)


def _warm_up(workload: Any) -> None:
    """Step a run of the smallest preset once, untimed, so a cold process's one-off imports
    (``torch._dynamo`` on the first optimizer step) are not charged to the first build."""
    from autoscale.training import TrainingRun, WorkloadSpec

    small = WorkloadSpec(
        model="mlp", scenario="clean", dtype=workload.dtype, device=workload.device, batch_size=4
    )
    with contextlib.suppress(Exception):  # a problem of the real workload shows when measured
        TrainingRun(small, "static", init_scale=2.0**16).step()


def measure_all(workloads: list[Any], *, limit_s: float, step_share_s: float) -> Timings:
    """:func:`measure` each distinct workload within ``limit_s`` in all, shared out in turn."""
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
# a long run's fp32 reference backward, one step in 10, makes it this much longer (measured:
# experiments/results/reference_cost.md)
REFERENCE_FACTOR = 1.1


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
        """Seconds for ``candidates`` candidates and the uncached (recorded) ``torch`` runs."""
        total = 0.0
        for w in self.workloads:
            t = timings.of(w)
            torch_runs = sum(1 for s in self.seeds if not cached(w, s))
            total += t.run_s(self.steps, record=True, reference=True) * torch_runs
            total += t.run_s(self.steps, reference=True) * candidates * len(self.candidate_seeds)
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "workloads": [w.to_dict() for w in self.workloads],
            "steps": self.steps,
            "seeds": list(self.seeds),
            "candidate_seeds": list(self.candidate_seeds),
        }
