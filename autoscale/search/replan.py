"""A plan that bends: what the search does when its real steps run slower than it measured.

The plan (:mod:`~autoscale.search.plan`) is sized from a few steps timed at the start. A machine
that is busier later (a browser, a data loader, a second job) runs every real-step phase slower,
and a plan that only knew its first measurement ran out of budget in the middle of recording.
Here the search bends instead, and says what it traded:

* **recording** records each member's first train and first test instance before the others
  (the least a search needs), leaves out the instances that no longer fit, and records a first
  instance shorter (down to :data:`MIN_HORIZON` steps) when even it does not fit; the deadline it
  records to moves with the pace it sees, so that the phases after it keep their time;
* after recording, the measured step times are **scaled by the pace** (recorded seconds over
  planned ones) and what is left is planned again (:func:`replan`): the replay suite is the
  recorded one, the real-step validation episodes are as long as the time left allows, and the
  no-harm check runs a model too slow for what is left on its tiny proxy;
* the search itself takes what remains, and the rounds (:mod:`~autoscale.search.runner`) fit
  validation and checks to the time left with the scaled step times.

Only the worker that creates a study bends its shape, once, before anything is scored on it; it
stores the plan for good. A worker that joins or resumes the study records the plan's traces
whole and bends only its own time (:func:`retime`): every worker scores and validates alike.

Only the start refuses: when even the smallest plan does not fit the budget
(:func:`~autoscale.search.plan.make_plan`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from autoscale.envs.suite import SuiteSpec
from autoscale.search.plan import (
    CHECKED_CANDIDATES,
    VALIDATE_SHARE,
    VALIDATION_LADDER,
    Plan,
    fit_no_harm,
    fit_validation,
    search_estimate,
    validate_cost,
    validated_scalers,
)
from autoscale.search.timing import NoHarmPlan, Timings

__all__ = [
    "MIN_HORIZON",
    "SLOW",
    "least_after_record",
    "pace_of",
    "recorded_suite",
    "replan",
    "retime",
]

SLOW = 1.15  # a pace above this re-plans the rest with step times scaled by it
MIN_HORIZON = 32  # the shortest trace a first instance is recorded at, rather than none


def pace_of(stats: dict[str, Any]) -> float:
    """Recorded seconds over the seconds planned for them (1.0 when nothing was recorded)."""
    return stats["wall_s"] / stats["planned_s"] if stats.get("planned_s", 0) > 0 else 1.0


def _firsts(suite: SuiteSpec) -> SuiteSpec:
    def first(m):
        inst = {k: v[:1] for k, v in m.instances.items()}
        return dataclasses.replace(m, instances=inst)

    return suite.replace_members(first)


def least_after_record(plan: Plan, cached_no_harm: Callable[[Any, int], bool]) -> float:
    """Seconds the least useful end of a search needs after recording, at the measured step
    times: ``torch``, ``auto`` (the bar, validated in any time left) and one candidate validated
    on the shortest episodes of each member's first test instance, and one candidate's no-harm
    check."""
    shortest = _firsts(plan.validation).with_episode_steps(VALIDATION_LADDER[-1])
    return validate_cost(shortest, plan.timings, 3) + plan.no_harm.cost(
        plan.timings, 1, cached_no_harm
    )


def recorded_suite(suite: SuiteSpec, traces: dict[str, Any], shortest: int) -> SuiteSpec:
    """``suite`` with the instances that were recorded, and replay episodes no longer than the
    ``shortest`` trace."""

    def shape(m):
        if m.name not in traces:
            return m
        names = set(traces[m.name].instances)
        inst = {k: tuple(i for i in v if i.name in names) for k, v in m.instances.items()}
        ep = m.episode
        if shortest < ep.steps:
            ep = dataclasses.replace(ep, steps=shortest)
        return dataclasses.replace(m, instances=inst, episode=ep)

    return suite.replace_members(shape)


def _instances(suite: SuiteSpec) -> int:
    return sum(len(m.instances["train"]) + len(m.instances["test"]) for m in suite.members)


def _at_pace(
    plan: Plan, pace: float, left_s: float, cached_no_harm: Callable[[Any, int], bool], why: str
) -> tuple[Timings, NoHarmPlan, list[str]]:
    """The step times scaled by ``pace`` (when slow), the no-harm check fitted to ``left_s`` at
    them, and what the fit traded."""
    timings = plan.timings.scaled(pace) if pace > SLOW else plan.timings
    no_harm, cuts = fit_no_harm(plan.no_harm, timings, max(left_s, 1.0), cached_no_harm)
    return timings, no_harm, [f"{c} ({why})" for c in cuts if c not in plan.cuts]


def _paced(why: str) -> str:
    return f"the phases after recording planned at the pace seen ({why})"


def _estimated(
    plan: Plan,
    left_s: float,
    cached_no_harm: Callable[[Any, int], bool],
    min_search_s: float,
    **changes: Any,
) -> Plan:
    """``plan`` with ``changes``, its validation and no-harm estimates at its (new) step times,
    and the search given what is left of ``left_s`` (at least ``min_search_s``)."""
    new = dataclasses.replace(plan, **changes)
    scalers = validated_scalers(len(new.rules), new.all_rules_real)
    val_s = validate_cost(new.validation, new.timings, scalers)
    no_harm_s = new.no_harm.cost(new.timings, CHECKED_CANDIDATES, cached_no_harm)
    return dataclasses.replace(
        new,
        validate_s=val_s,
        no_harm_s=no_harm_s,
        search_s=search_estimate(left_s, val_s, no_harm_s, min_search_s),
    )


def retime(
    plan: Plan,
    stats: dict[str, Any],
    *,
    left_s: float,
    cached_no_harm: Callable[[Any, int], bool],
    min_search_s: float = 0.0,
) -> Plan:
    """``plan``'s shape as it is (suite, validation, trace length: a study's, which every worker
    scores and validates alike), its phases after recording timed at the pace the recording kept
    and its no-harm check fitted to them; ``plan`` itself when the recording kept to the measured
    step times. What a worker that adopted a study's plan bends: its own time.

    Args:
        stats: What :func:`~autoscale.search.traces.load_traces` returned.
        left_s: Working seconds left in the budget.
        min_search_s: Seconds the rounds search at least.
    """
    pace = pace_of(stats)
    if pace <= SLOW:
        return plan
    why = f"steps ran {pace:.1f}x slower than measured"
    timings, no_harm, no_harm_cuts = _at_pace(plan, pace, left_s, cached_no_harm, why)
    cuts = (_paced(why), *no_harm_cuts)
    return _estimated(
        plan, left_s, cached_no_harm, min_search_s, timings=timings, no_harm=no_harm,
        cuts=plan.cuts + cuts,
    )  # fmt: skip


def replan(
    plan: Plan,
    traces: dict[str, Any],
    stats: dict[str, Any],
    *,
    left_s: float,
    budget_s: float,
    min_search_s: float,
    cached_no_harm: Callable[[Any, int], bool],
) -> Plan:
    """The plan for what is left after recording (see the module docstring); ``plan`` itself
    when the recording kept to it. Only the worker that creates a study re-plans it, before any
    trial or validation is scored on it.

    Args:
        traces, stats: What :func:`~autoscale.search.traces.load_traces` returned.
        left_s: Working seconds left in the budget.
        budget_s: The whole budget (validation's share is a share of it).
        min_search_s: Seconds the search keeps at least.
    """
    pace = pace_of(stats)
    slow = pace > SLOW
    suite = recorded_suite(plan.suite, traces, stats["shortest"])
    if not slow and suite == plan.suite:
        return plan
    why = f"steps ran {pace:.1f}x slower than measured" if slow else "the recording ran long"
    timings, no_harm, no_harm_cuts = _at_pace(plan, pace, left_s, cached_no_harm, why)
    cuts = [_paced(why)] if slow else []
    if stats["dropped"]:
        cuts.append(
            f"{len(stats['dropped'])} of {_instances(plan.suite)} instances unrecorded ({why})"
        )
    if suite.episode.steps < plan.horizon:
        cuts.append(f"replay horizon {suite.episode.steps} of the planned {plan.horizon} ({why})")
    cuts += no_harm_cuts
    no_harm_min = no_harm.cost(timings, 1, cached_no_harm)
    room = min(VALIDATE_SHARE * budget_s, left_s - no_harm_min - min_search_s)
    choice = fit_validation(suite, timings, room, len(plan.rules) + 1)  # + auto
    if choice is None:  # the least: torch and the candidate on the shortest episodes
        validation = suite.with_episode_steps(min(VALIDATION_LADDER[-1], suite.episode.steps))
        all_rules = False
    else:
        validation, all_rules, _ = choice
    if validation.episode.steps < plan.steps:
        cuts.append(
            f"real-step validation episodes of {validation.episode.steps} of the planned "
            f"{plan.steps} steps ({why})"
        )
    if plan.all_rules_real and not all_rules:
        cuts.append(f"real-step validation of every rule ({why})")
    return _estimated(
        plan,
        left_s,
        cached_no_harm,
        min_search_s,
        suite=suite,
        validation=validation,
        trace_steps=min(plan.trace_steps, stats["shortest"]),
        timings=timings,
        no_harm=no_harm,
        all_rules_real=all_rules,
        cuts=plan.cuts + tuple(cuts),
    )
