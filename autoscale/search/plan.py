"""What a budget affords: measure the real step time, then size the search to it.

A search spends its budget in phases: measure a few real steps; record traces (real steps) of the
train and test instances; search on their replay (fast); validate the best candidates and every
built-in rule on real steps of the test instances; export. Replay trials cost milliseconds, so
the budget is decided by the real-step phases. :func:`make_plan` walks a ladder of workload
shapes, richest first (more seeds per instance; then episode length x instances per set), and
takes the first whose recording fits in :data:`RECORD_SHARE` of the budget and whose recording
plus validation (every built-in rule and one candidate) fits in :data:`REAL_SHARE`; what is left
is for the search, and unused search time flows back to validating more candidates. When no shape
with episodes of at least :data:`MIN_STEPS_ALL_RULES` steps affords real-step validation of every
rule, the richest shape that affords the candidate and ``torch`` is taken, and the other rules are
validated as time allows (the rest on replay of the real test steps). RL needs at least
:data:`RL_MIN_SEARCH_S` seconds of search and two train instances; without them it is dropped.
The plan says in words what it could not afford.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from autoscale.envs.spec import EnvSpec, InstanceSpec
from autoscale.errors import BudgetError
from autoscale.search.budget import format_duration

__all__ = [
    "Timing",
    "Plan",
    "measure",
    "make_plan",
    "record_cost",
    "validate_cost",
    "RECORD_SHARE",
    "REAL_SHARE",
]

RECORD_SHARE = 0.30  # at most this share of the working budget records traces
REAL_SHARE = 0.75  # recording + validation of every rule fit in this share
RL_MIN_SEARCH_S = 30.0  # RL is tried only with this much search time (3 trials of 10 s)
EPISODE_LADDER = (64, 48, 32, 24, 16, 12, 8, 4)
MAX_SEEDS = 4
MIN_STEPS_ALL_RULES = 16  # shorter episodes validate the candidate and torch first


@dataclass(frozen=True)
class Timing:
    """Measured costs of real training on this machine.

    Attributes:
        step_s: Seconds per real optimizer step.
        build_s: Seconds to build one run (model, data, optimizer).
        eval_s: Seconds of one held-out evaluation (``TrainingRun.eval_loss``).
        steps: Steps timed.
        complete: False when the first step did not finish in the time allowed (``step_s`` is
            then a lower bound).
    """

    step_s: float
    build_s: float
    eval_s: float
    steps: int
    complete: bool = True

    def describe(self) -> str:
        if not self.complete:
            return (
                f"one real step takes more than {format_duration(self.step_s)} here (not finished)"
            )
        return (
            f"{_fmt_s(self.step_s)} per real step, {_fmt_s(self.build_s)} to build a run, "
            f"{_fmt_s(self.eval_s)} per evaluation ({self.steps} step{'s' if self.steps != 1 else ''} timed)"
        )


def _fmt_s(s: float) -> str:
    return f"{1000 * s:.0f} ms" if s < 1 else format_duration(s)


class _TimeUp(Exception):
    """Raised by the alarm of :func:`_time_limit`."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[list[bool]]:
    """Interrupt the block after ``seconds`` with :class:`_TimeUp` (POSIX main thread; elsewhere
    no limit). Yields a one-item list that says whether the alarm fired."""
    fired = [False]
    if (
        not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield fired
        return

    def on_alarm(signum: int, frame: Any) -> None:
        fired[0] = True
        raise _TimeUp()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def measure(workload: Any, *, limit_s: float, steps: int = 4, step_share_s: float = 1.0) -> Timing:
    """Time building a run of ``workload`` and a few real steps, within ``limit_s`` seconds.

    A step that would run past the limit is interrupted (an alarm between torch operations) and
    reported as a lower bound, so a model too slow for the budget costs ``limit_s`` at most, not
    a step. The first step is a warm-up; later ones are timed while their total stays under
    ``step_share_s``.
    """
    from autoscale.training import TrainingRun

    times: list[float] = []
    build = eval_s = math.nan
    t_begin = time.perf_counter()
    t_step = t_begin
    with _time_limit(limit_s) as fired:
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
            if times[-1] < 1.0:  # cheap: measure it; else estimate it from the step
                t0 = time.perf_counter()
                run.eval_loss()
                eval_s = time.perf_counter() - t0
        except Exception:
            if not fired[0]:
                raise
    if not times:
        lower = time.perf_counter() - (t_step if t_step > t_begin else t_begin)
        build = build if math.isfinite(build) else time.perf_counter() - t_begin
        return Timing(lower, build, _eval_estimate(workload, lower), 0, complete=False)
    step = statistics.median(times[1:]) if len(times) > 1 else times[0]
    if not math.isfinite(eval_s):
        eval_s = _eval_estimate(workload, step)
    return Timing(step, build, eval_s, len(times))


def _eval_estimate(workload: Any, step_s: float) -> float:
    # a forward pass is about a third of a training step
    return 0.35 * step_s * workload.eval_batches / max(1, workload.grad_accum)


def record_cost(spec: EnvSpec, t: Timing) -> float:
    """Seconds to record every train and test instance of ``spec`` (one build, warm-up, the
    episode's steps and one evaluation per instance)."""
    n = spec.episode.steps
    insts = spec.instances["train"] + spec.instances["test"]
    return sum(t.build_s + (i.start + n) * t.step_s + t.eval_s for i in insts)


def validate_cost(spec: EnvSpec, t: Timing, scalers: int) -> float:
    """Seconds to run ``scalers`` scalers on every test instance of ``spec`` on real steps."""
    n = spec.episode.steps
    return sum(
        t.build_s + i.start * t.step_s + scalers * (n * t.step_s + t.eval_s)
        for i in spec.instances["test"]
    )


def _cheapest(group: tuple[InstanceSpec, ...], n: int) -> tuple[InstanceSpec, ...]:
    order = sorted(range(len(group)), key=lambda j: (group[j].start, j))
    return tuple(group[j] for j in sorted(order[:n]))


def shape_spec(base: EnvSpec, steps: int, n: int, seeds: int) -> EnvSpec:
    """``base`` with ``steps``-step episodes, its ``n`` cheapest instances per set (those with
    the fewest warm-up steps), each with ``seeds`` seeds."""
    from autoscale.agents.evaluate import expand_seeds

    spec = dataclasses.replace(
        base,
        episode=dataclasses.replace(base.episode, steps=steps),
        instances={k: _cheapest(v, n) for k, v in base.instances.items()},
    )
    spec = expand_seeds(spec, seeds, "train")
    return expand_seeds(spec, seeds, "test")


def _ladder(base: EnvSpec) -> list[tuple[int, int, int]]:
    full = base.episode.steps
    n_max = min(len(base.instances["train"]), len(base.instances["test"]))
    steps = sorted({full, *(s for s in EPISODE_LADDER if s < full)}, reverse=True)
    shapes = sorted(
        ((s, n, 1) for s in steps for n in range(1, n_max + 1)),
        key=lambda x: (x[0] * x[1], x[1]),
        reverse=True,
    )
    return [(full, n_max, k) for k in range(MAX_SEEDS, 1, -1)] + shapes


@dataclass(frozen=True)
class Plan:
    """A sized search: the env spec searched, the space, the phase estimates, and what was cut.

    Attributes:
        spec: The base spec reshaped (episode steps, instances, seeds); every trial of the study
            is scored on its train instances and validated on its test instances.
        space: ``parametric``, ``rl`` or ``both`` (what this budget affords of the asked space).
        rules: The built-in rules validated against.
        timing: The measurements the plan was made from.
        record_s, validate_s, search_s: Estimated seconds of each phase.
        all_rules_real: Whether every rule's real-step validation fits.
        cuts: What the budget could not afford, in words.
    """

    spec: EnvSpec
    space: str
    rules: tuple[str, ...]
    timing: Timing
    record_s: float
    validate_s: float
    search_s: float
    all_rules_real: bool = True
    cuts: tuple[str, ...] = field(default_factory=tuple)

    @property
    def steps(self) -> int:
        return self.spec.episode.steps

    def describe(self) -> str:
        tr, te = len(self.spec.instances["train"]), len(self.spec.instances["test"])
        what = (
            f"{self.steps}-step episodes, {tr} train + {te} test instances; {self.space} space; "
            f"estimates: record {format_duration(self.record_s)}, search {format_duration(self.search_s)}, "
            f"validate {format_duration(self.validate_s)}"
        )
        if self.cuts:
            what += "\n  could not afford: " + "; ".join(self.cuts)
        return what

    def to_dict(self) -> dict[str, Any]:
        return {
            "episode_steps": self.steps,
            "train": [i.name for i in self.spec.instances["train"]],
            "test": [i.name for i in self.spec.instances["test"]],
            "space": self.space,
            "rules": list(self.rules),
            "timing": dataclasses.asdict(self.timing),
            "estimates_s": {
                "record": self.record_s,
                "search": self.search_s,
                "validate": self.validate_s,
            },
            "all_rules_real": self.all_rules_real,
            "cuts": list(self.cuts),
        }


def make_plan(
    base: EnvSpec,
    timing: Timing,
    work_s: float,
    *,
    space: str = "parametric",
    rules: tuple[str, ...],
    cached: Callable[[EnvSpec], float] | None = None,
    reshape: bool = True,
) -> Plan:
    """Size the search of ``base`` to ``work_s`` seconds (see the module docstring).

    Args:
        cached: Share (0..1) of a shaped spec's recording already in the trace cache (a resume
            or a second worker records less).
        reshape: Walk the ladder of shapes; False keeps ``base`` as it is (a study's stored
            spec, which every worker of the study must share).

    Raises:
        BudgetError: not even the smallest shape fits; says what budget would.
    """
    shapes = [shape_spec(base, *shape) for shape in _ladder(base)] if reshape else [base]
    min_steps = min(MIN_STEPS_ALL_RULES, base.episode.steps)
    for all_rules in (True, False):
        scalers = len(rules) + 1 if all_rules else 2
        for spec in shapes:
            if all_rules and reshape and spec.episode.steps < min_steps:
                continue  # longer episodes beat validating every rule on very short ones
            rec = record_cost(spec, timing) * (1.0 - (cached(spec) if cached else 0.0))
            val = validate_cost(spec, timing, scalers)
            if (
                timing.complete
                and rec <= RECORD_SHARE * work_s
                and rec + val <= REAL_SHARE * work_s
            ):
                return _finish(base, spec, space, rules, timing, work_s, rec, val, all_rules)
    smallest = shapes[-1]
    rec = record_cost(smallest, timing) * (1.0 - (cached(smallest) if cached else 0.0))
    need = max(rec / RECORD_SHARE, (rec + validate_cost(smallest, timing, 2)) / REAL_SHARE)
    what = (
        f"the smallest plan ({smallest.episode.steps}-step episodes, "
        f"{len(smallest.instances['train'])} train + {len(smallest.instances['test'])} test instances, "
        "validated against torch)"
        if reshape
        else f"this study's plan ({smallest.episode.steps}-step episodes)"
    )
    about = "about" if timing.complete else "more than"
    raise BudgetError(
        f"the budget cannot hold a search of {base.workload.model} here: {timing.describe()}; {what} "
        f"needs {about} {format_duration(1.1 * need + 10)} of budget; give a larger --budget, a GPU, "
        "or a smaller --model"
    )


def _finish(
    base: EnvSpec,
    spec: EnvSpec,
    space: str,
    rules: tuple[str, ...],
    timing: Timing,
    work_s: float,
    rec: float,
    val: float,
    all_rules: bool,
) -> Plan:
    cuts = []
    full, n_full = (
        base.episode.steps,
        min(len(base.instances["train"]), len(base.instances["test"])),
    )
    if spec.episode.steps < full:
        cuts.append(f"{full}-step episodes (took {spec.episode.steps})")
    n = len(spec.instances["test"])
    if n < n_full:
        cuts.append(f"{n_full} instances per set (took {n})")
    if not all_rules:
        cuts.append("real-step validation of every rule (the rest are validated as time allows)")
    search_s = max(0.0, work_s - rec - val)
    if space in ("rl", "both"):
        reason = None
        if len(spec.instances["train"]) < 2:
            reason = "needs 2 train instances (one to select the agent on)"
        elif search_s < RL_MIN_SEARCH_S:
            reason = f"needs {format_duration(RL_MIN_SEARCH_S)} of search, the budget leaves {format_duration(search_s)}"
        if reason:
            cuts.append(f"RL ({reason}): searching the parametric space")
            space = "parametric"
    return Plan(spec, space, rules, timing, rec, val, search_s, all_rules, tuple(cuts))
