"""What a budget affords: :func:`make_plan` sizes a search (:class:`Plan`) to measured step times,
and after recording :func:`replan` bends it to the pace the machine kept (the study's creator its
shape too, other workers their own phases). Replay trials cost milliseconds, so the real-step
phases decide the plan; it says what it traded (:attr:`Plan.cuts`). User-facing detail: docs/search.md, phase 2 and
"A budget that bends".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from autoscale.envs.spec import EnvSpec, InstanceSpec
from autoscale.envs.suite import SuiteSpec
from autoscale.errors import BudgetError
from autoscale.search.budget import format_duration
from autoscale.search.no_harm import no_harm_label
from autoscale.search.timing import MARGIN, NoHarmPlan, Timings
from autoscale.search.traces import pace_of

__all__ = [
    "Plan",
    "StoredPlan",
    "make_plan",
    "shape_suite",
    "record_cost",
    "RECORD_SHARE",
    "REAL_SHARE",
    "HORIZON_LADDER",
    "fit_no_harm",
    "fit_validation",
    "validate_cost",
    "MIN_HORIZON",
    "SLOW",
    "instance_count",
    "least_after_record",
    "recorded_suite",
    "replan",
]

RECORD_SHARE = 0.50  # at most this share records traces: a search learns from what it recorded
NO_HARM_SHARE = 0.30  # a no-harm workload whose runs need more is checked on its tiny proxy
REAL_SHARE = 0.80  # recording + validation + the no-harm check fit in this share
VALIDATE_SHARE = 0.30  # validation takes at most this share
VALIDATED_CANDIDATES = 3  # validation is planned for every rule and this many candidates
# RL is tried where the search leaves room between the parametric trials' share and the last
# RLObjective.MIN_TRIAL_S / 2 to fine-tune the shipped agent, then export and score it
RL_MIN_SEARCH_S = 8.0
HORIZON_LADDER = (4096, 2048, 1024, 512, 256, 128, 64, 32, 16)
VALIDATION_LADDER = (4096, 2048, 1024, 512, 256, 128, 96, 64, 48, 32, 24, 16, 8)
MIN_STEPS_ALL_RULES = 16  # shorter validation episodes validate the candidate and torch first
MAX_SEEDS = 3
CHECKED_CANDIDATES = 2  # the no-harm check is planned for this many candidates
SLOW = 1.15  # a pace above this re-plans the rest with step times scaled by it
MIN_HORIZON = 32  # the shortest trace a first instance is recorded at, rather than none


# ---------------------------------------------------------------------- shapes
def _cheapest(group: tuple[InstanceSpec, ...], n: int) -> tuple[InstanceSpec, ...]:
    order = sorted(range(len(group)), key=lambda j: (group[j].start, j))
    return tuple(group[j] for j in sorted(order[:n]))


def shape_suite(suite: SuiteSpec, steps: int, n: int, seeds: int) -> SuiteSpec:
    """``suite`` with ``steps``-step episodes and each member's ``n`` cheapest instances per set,
    each with ``seeds`` seeds."""
    from autoscale.envs.episodes import expand_seeds

    def shape(member: EnvSpec) -> EnvSpec:
        spec = dataclasses.replace(
            member,
            episode=dataclasses.replace(
                member.episode, steps=steps, horizon=max(steps, member.episode.horizon)
            ),
            instances={k: _cheapest(v, n) for k, v in member.instances.items()},
        )
        return expand_seeds(expand_seeds(spec, seeds, "train"), seeds, "test")

    return suite.replace_members(shape)


def record_cost(suite: SuiteSpec, trace_steps: int, t: Timings) -> float:
    return sum(
        t.of(m.workload).run_s(i.start + trace_steps, record=True)
        for m in suite.members
        for i in m.instances["train"] + m.instances["test"]
    )


def validate_cost(suite: SuiteSpec, t: Timings, scalers: int) -> float:
    """Seconds to run ``scalers`` scalers on every test instance of every member on real steps."""
    n = suite.episode.steps
    total = 0.0
    for m in suite.members:
        tm = t.of(m.workload)
        for i in m.instances["test"]:
            total += tm.build_s + i.start * tm.step_s + scalers * (n * tm.step_s + tm.eval_s)
    return total


class StoredPlan(NamedTuple):
    """What a study keeps of its plan for every worker."""

    suite: SuiteSpec
    validation: SuiteSpec
    trace_steps: int
    all_rules_real: bool = True


@dataclass(frozen=True)
class Plan:
    """A sized search.

    Attributes:
        suite: The searched suite, with episodes of the replay horizon.
        validation: The same members and instances with real-step episodes.
        trace_steps: Steps recorded per instance (one or two horizons).
        space: ``parametric``, ``rl`` or ``both`` (what the budget affords of the asked space).
        rules: The built-in rules validated against.
        record_s, validate_s, no_harm_s, search_s: Estimated seconds of each phase.
        all_rules_real: Whether every rule's real-step validation fits.
        cuts: What the budget could not afford, in words.
    """

    suite: SuiteSpec
    validation: SuiteSpec
    trace_steps: int
    space: str
    rules: tuple[str, ...]
    timings: Timings
    no_harm: NoHarmPlan
    record_s: float
    validate_s: float
    no_harm_s: float
    search_s: float
    all_rules_real: bool = True
    cuts: tuple[str, ...] = field(default_factory=tuple)

    @property
    def horizon(self) -> int:
        return self.suite.episode.steps

    @property
    def steps(self) -> int:
        """Real-step validation episode length."""
        return self.validation.episode.steps

    def describe(self) -> str:
        m = self.suite.members[0]
        tr, te = len(m.instances["train"]), len(m.instances["test"])
        members = f"{len(self.suite.members)} members x " if len(self.suite.members) > 1 else ""
        windows = self.trace_steps // self.horizon
        what = (
            f"{members}{tr} train + {te} test instances; replay episodes of {self.horizon} steps "
            f"({'early and late in ' + str(self.trace_steps) + '-step runs' if windows > 1 else 'from the start of each run'}), "
            f"validation on {self.steps} real steps; {self.space} space; no-harm check: "
            f"{self.no_harm.steps}-step runs of {', '.join(map(no_harm_label, self.no_harm.workloads))}; "
            f"estimates: record {format_duration(self.record_s)}, search {format_duration(self.search_s)}, "
            f"validate {format_duration(self.validate_s)}, no-harm {format_duration(self.no_harm_s)}"
        )
        if self.cuts:
            what += "\n  traded: " + "; ".join(self.cuts)
        return what

    def to_dict(self) -> dict[str, Any]:
        first = self.suite.members[0]
        return {
            "horizon": self.horizon,
            "trace_steps": self.trace_steps,
            "validation_steps": self.steps,
            "members": [m.name for m in self.suite.members],
            "train": [i.name for i in first.instances["train"]],
            "test": [i.name for i in first.instances["test"]],
            "space": self.space,
            "rules": list(self.rules),
            "timing": self.timings.to_dict(),
            "no_harm": self.no_harm.to_dict(),
            "estimates_s": {
                "record": self.record_s,
                "search": self.search_s,
                "validate": self.validate_s,
                "no_harm": self.no_harm_s,
            },
            "all_rules_real": self.all_rules_real,
            "cuts": list(self.cuts),
        }


def _horizons(suite: SuiteSpec) -> list[int]:
    top = suite.episode.horizon
    return sorted({top, *(h for h in HORIZON_LADDER if h < top)}, reverse=True)


def _shapes(suite: SuiteSpec) -> list[tuple[int, int, int, int]]:
    """(horizon, windows, instances per set, seeds), richest first: the longest horizon with at
    least three instances per set (then two, one), two windows, then more instances and seeds."""
    first = suite.members[0]
    n_max = min(len(first.instances["train"]), len(first.instances["test"]))
    out = []
    for floor in sorted({min(3, n_max), min(2, n_max), 1}, reverse=True):
        for h in _horizons(suite):
            for windows in (2, 1):
                for n in range(n_max, floor - 1, -1):
                    seeds = range(MAX_SEEDS, 0, -1) if n == n_max else (1,)
                    out.extend((h, windows, n, k) for k in seeds)
    seen, unique = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            unique.append(s)
    return unique


def make_plan(
    suite: SuiteSpec,
    timings: Timings,
    work_s: float,
    *,
    no_harm: NoHarmPlan,
    space: str = "parametric",
    rules: tuple[str, ...],
    cached_traces: Callable[[SuiteSpec, int], float] | None = None,
    cached_no_harm: Callable[[Any, int], bool] | None = None,
    stored: StoredPlan | tuple[SuiteSpec, SuiteSpec, int] | None = None,
    warm_start: bool = True,
    min_search_s: float = 0.0,
) -> Plan:
    """Size the search of ``suite`` to ``work_s`` seconds.

    Takes the first shape (:func:`_shapes`) whose recording fits :data:`RECORD_SHARE` of
    ``work_s`` and whose real-step phases fit :data:`REAL_SHARE`, with the longest validation
    episodes that fit (:func:`fit_validation`); what is left is for the search.

    Args:
        cached_traces: Share (0..1) of a shaped suite's recording already in the trace cache.
        cached_no_harm: Whether the check's ``torch`` run of a workload and seed is cached.
        warm_start: The first RL trial starts from the shipped agent (RL then needs no search).
        stored: A study's :class:`StoredPlan`, kept as it is: only the costs are estimated.
        min_search_s: The search estimate's floor.

    Raises:
        BudgetError: not even the smallest shape fits; says what budget would.
    """
    cached_traces = cached_traces or (lambda s, n: 0.0)
    cached_no_harm = cached_no_harm or (lambda w, s: False)
    no_harm, no_harm_cuts = fit_no_harm(no_harm, timings, work_s, cached_no_harm)
    no_harm_s = no_harm.cost(timings, CHECKED_CANDIDATES, cached_no_harm)
    no_harm_min = no_harm.cost(timings, 1, cached_no_harm)

    def rec_cost(shaped: SuiteSpec, trace_steps: int) -> float:
        return record_cost(shaped, trace_steps, timings) * (
            1.0 - cached_traces(shaped, trace_steps)
        )

    if stored is not None:
        shaped, validation, trace_steps, all_rules = StoredPlan(*stored)
        rec = rec_cost(shaped, trace_steps)
        val = validate_cost(validation, timings, validated_scalers(len(rules), all_rules))
        plan = Plan(
            shaped, validation, trace_steps, space, rules, timings, no_harm, rec, val, no_harm_s,
            0.0, all_rules, no_harm_cuts,
        )  # fmt: skip
        return _finish(plan, work_s, warm_start, min_search_s)
    if timings.complete:
        for h, windows, n, k in _shapes(suite):
            shaped = shape_suite(suite, h, n, k)
            rec = rec_cost(shaped, windows * h)
            if rec > RECORD_SHARE * work_s:
                continue
            real_left = min(REAL_SHARE * work_s - rec - no_harm_min, VALIDATE_SHARE * work_s)
            choice = fit_validation(shaped, timings, real_left, len(rules) + 1)  # + auto
            if choice is None:
                continue
            validation, all_rules, val = choice
            cuts = _cuts(suite, h, windows, n, k, validation, all_rules) + no_harm_cuts
            plan = Plan(
                shaped, validation, windows * h, space, rules, timings, no_harm, rec, val,
                no_harm_s, 0.0, all_rules, cuts,
            )  # fmt: skip
            return _finish(plan, work_s, warm_start, min_search_s)
    smallest = shape_suite(suite, _horizons(suite)[-1], 1, 1)
    rec = rec_cost(smallest, smallest.episode.steps)
    val = validate_cost(smallest.with_episode_steps(VALIDATION_LADDER[-1]), timings, 3)
    need = max(rec / RECORD_SHARE, (rec + val + no_harm_min) / REAL_SHARE)
    raise _too_small(suite, timings, smallest.episode.steps, no_harm.steps, need)


def _too_small(
    suite: SuiteSpec, timings: Timings, steps: int, check_steps: int, need: float
) -> BudgetError:
    """No plan fits: what the smallest (``steps``-step episodes) ``need``s, and why."""
    key, slowest = timings.slowest()
    about = "about" if timings.complete else "more than"
    # the search's own models name it; the slowest workload (maybe one of the check's) says why
    searched = ", ".join(dict.fromkeys(m.workload.model for m in suite.members))
    model = key.split("/")[0]
    why = slowest.describe() if model in searched.split(", ") else f"{model}: {slowest.describe()}"
    return BudgetError(
        f"the budget cannot hold a search of {searched} here: {why}; the "
        f"smallest plan ({steps}-step episodes, 1 train + 1 test instance per member, "
        f"validated against torch and auto, with the {check_steps}-step no-harm check) needs {about} "
        f"{format_duration(1.1 * need + 10)} of budget; give a larger --budget, a GPU, or a smaller --model"
    )


def fit_no_harm(
    no_harm: NoHarmPlan, timings: Timings, work_s: float, cached: Callable[[Any, int], bool]
) -> tuple[NoHarmPlan, tuple[str, ...]]:
    """``no_harm`` with each workload whose runs cost over :data:`NO_HARM_SHARE` of the budget
    replaced by its tiny proxy, and the cuts saying so."""
    from autoscale.search.no_harm import no_harm_proxy

    kept: list[Any] = []
    cuts = []
    for w in no_harm.workloads:
        single = NoHarmPlan((w,), no_harm.steps, no_harm.seeds, no_harm.candidate_seeds)
        proxy = no_harm_proxy(w)
        cost = single.cost(timings, CHECKED_CANDIDATES, cached)
        if proxy is not None and cost > NO_HARM_SHARE * work_s:
            if all(k.model != proxy.model for k in kept + list(no_harm.workloads)):
                kept.append(proxy)
            cuts.append(
                f"no-harm runs of {w.model} ({format_duration(cost)} for {no_harm.steps} steps): "
                f"checked on {proxy.model} instead"
            )
        else:
            kept.append(w)
    return dataclasses.replace(no_harm, workloads=tuple(kept)), tuple(cuts)


def fit_validation(
    shaped: SuiteSpec, t: Timings, left_s: float, n_rules: int
) -> tuple[SuiteSpec, bool, float] | None:
    """The longest real-step validation (up to the replay horizon) that fits ``left_s``: every
    rule (``n_rules`` counts ``auto``) and a few candidates first, else torch, auto and the
    candidate; None if nothing fits."""
    top = shaped.episode.steps
    ladder = sorted({top, *(s for s in VALIDATION_LADDER if s < top)}, reverse=True)
    for all_rules in (True, False):
        scalers = validated_scalers(n_rules - 1, all_rules)
        for steps in ladder:
            if all_rules and steps < min(MIN_STEPS_ALL_RULES, top):
                break
            validation = shaped.with_episode_steps(steps)
            cost = validate_cost(validation, t, scalers)
            if cost <= left_s:
                return validation, all_rules, cost
    return None


def search_estimate(
    left_s: float, validate_s: float, no_harm_s: float, min_search_s: float
) -> float:
    """The first round's search time: ``left_s`` less validation and the check (with their
    :data:`~autoscale.search.timing.MARGIN`), at least ``min_search_s``."""
    return max(0.0, min(min_search_s, left_s), left_s - MARGIN * (validate_s + no_harm_s))


def validated_scalers(n_rules: int, all_rules: bool) -> int:
    """The scalers a plan's real-step validation is priced for (else torch, auto, a candidate)."""
    return n_rules + 1 + VALIDATED_CANDIDATES if all_rules else 3


def _cuts(
    base: SuiteSpec, h: int, windows: int, n: int, k: int, validation: SuiteSpec, all_rules: bool
) -> tuple[str, ...]:
    cuts = []
    if h < base.episode.horizon:
        cuts.append(f"replay horizon {h} of {base.episode.horizon} steps")
    if windows < 2:
        cuts.append("late-training episodes (traces of one horizon)")
    first = base.members[0]
    n_full = min(len(first.instances["train"]), len(first.instances["test"]))
    if n < n_full:
        cuts.append(f"{n} of {n_full} instances per set")
    if k == 1 and n == n_full:
        cuts.append("extra seeds")
    if validation.episode.steps < h:
        cuts.append(f"real-step validation episodes of {validation.episode.steps} of {h} steps")
    if not all_rules:
        cuts.append("real-step validation of every rule (the rest are validated as time allows)")
    return tuple(cuts)


def _finish(plan: Plan, work_s: float, warm_start: bool, min_search_s: float) -> Plan:
    """``plan`` with the search time it leaves, and RL dropped (said in its cuts) where the
    budget or the suite cannot hold it."""
    search_s = search_estimate(
        work_s - plan.record_s, plan.validate_s, plan.no_harm_s, min_search_s
    )
    space, cuts = plan.space, tuple(plan.cuts)
    if space in ("rl", "both"):
        from autoscale.search.agent_trials import RLObjective

        reason = None
        if not RLObjective.fits(plan.suite):  # the rule the RL trials themselves apply
            n = min(len(m.instances["train"]) for m in plan.suite.members)
            reason = (
                f"an agent needs 2 train instances per member, one to select it on, or the "
                f"shipped residual agent to start from; the plan keeps {n}"
            )
        elif search_s < RL_MIN_SEARCH_S and not (warm_start and RLObjective.warm_ships()):
            # (a shipped residual agent needs no search time: its trial is scored in seconds)
            reason = f"needs {format_duration(RL_MIN_SEARCH_S)} of search, the budget leaves {format_duration(search_s)}"
        if reason:
            cuts += (f"RL dropped ({reason}): searching the parametric space only",)
            space = "parametric"
    return dataclasses.replace(plan, space=space, search_s=search_s, cuts=cuts)


# ---------------------------------------------------------------------- after recording


def _firsts(suite: SuiteSpec) -> SuiteSpec:
    def first(m):
        inst = {k: v[:1] for k, v in m.instances.items()}
        return dataclasses.replace(m, instances=inst)

    return suite.replace_members(first)


def least_after_record(plan: Plan, cached_no_harm: Callable[[Any, int], bool]) -> float:
    """Seconds the least useful end of a search needs after recording: ``torch``, ``auto`` and a
    candidate validated on the shortest episodes of each first test instance, and one check."""
    shortest = _firsts(plan.validation).with_episode_steps(VALIDATION_LADDER[-1])
    return validate_cost(shortest, plan.timings, 3) + plan.no_harm.cost(
        plan.timings, 1, cached_no_harm
    )


def recorded_suite(suite: SuiteSpec, traces: dict[str, Any], shortest: int) -> SuiteSpec:
    """``suite`` with the recorded instances and episodes no longer than the ``shortest`` trace."""

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


def instance_count(suite: SuiteSpec) -> int:
    """Instances of every member of ``suite``, train and test."""
    return sum(len(m.instances["train"]) + len(m.instances["test"]) for m in suite.members)


def _estimated(
    plan: Plan,
    left_s: float,
    cached_no_harm: Callable[[Any, int], bool],
    min_search_s: float,
    **changes: Any,
) -> Plan:
    """``plan`` with ``changes``, and its phases estimated again at its step times."""
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


def replan(
    plan: Plan,
    traces: dict[str, Any] | None,
    stats: dict[str, Any],
    *,
    left_s: float,
    budget_s: float,
    cached_no_harm: Callable[[Any, int], bool],
    min_search_s: float = 0.0,
) -> Plan:
    """The plan for what is left after recording; ``plan`` itself when the recording kept to
    it. The study's creator passes the ``traces`` recorded and re-plans the study's shape, before
    anything is scored on it; any other worker passes None: the shape stays (every worker of a
    study scores alike), its phases timed at the pace recording kept.

    Args:
        traces, stats: What :func:`~autoscale.search.traces.load_traces` returned.
        left_s: Working seconds left in the budget.
        min_search_s: Seconds the search keeps at least.
        budget_s: The whole budget (validation's share is a share of it).
    """
    pace = pace_of(stats)
    slow = pace > SLOW
    suite = plan.suite if traces is None else recorded_suite(plan.suite, traces, stats["shortest"])
    if not slow and suite == plan.suite:
        return plan
    why = (
        f"steps ran {pace:.1f}x slower than measured"
        if slow
        else "the time left kept for validation and the no-harm check"
    )
    timings = plan.timings.scaled(pace) if slow else plan.timings
    no_harm, fitted = fit_no_harm(plan.no_harm, timings, max(left_s, 1.0), cached_no_harm)
    no_harm_cuts = [f"{c} ({why})" for c in fitted if c not in plan.cuts]
    cuts = [f"the phases after recording planned at the pace seen ({why})"] if slow else []
    estimated = {"timings": timings, "no_harm": no_harm}
    if traces is None:
        cuts = plan.cuts + tuple(cuts + no_harm_cuts)
        return _estimated(plan, left_s, cached_no_harm, min_search_s, cuts=cuts, **estimated)
    if stats["dropped"]:
        cuts.append(
            f"{len(stats['dropped'])} of {instance_count(plan.suite)} instances unrecorded ({why})"
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
    elif validation.episode.steps > plan.steps:  # fewer instances, or less time recording
        cuts.append(
            f"real-step validation episodes of {validation.episode.steps} steps, not the planned "
            f"{plan.steps}: the time left allows them"
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
        all_rules_real=all_rules,
        cuts=plan.cuts + tuple(cuts),
        **estimated,
    )
