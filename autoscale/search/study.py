"""The Optuna study of a search: sampler and pruner, what a new study records, and what a worker
that joins or resumes one checks and cleans up."""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

from autoscale.envs.suite import SuiteSpec
from autoscale.errors import BudgetError, ConfigError
from autoscale.processes import owner_gone, raise_if_interrupted
from autoscale.search.budget import Ledger
from autoscale.search.export import study_suites
from autoscale.search.objective import OBJECTIVE_DOC
from autoscale.search.plan import Plan, StoredPlan
from autoscale.search.space import default_trial_params, parametric_families

__all__ = [
    "study_kwargs",
    "describe_spec",
    "describe_new_study",
    "store_plan",
    "study_note",
    "wait_for_plan",
    "PLANNING",
    "check_workload",
    "check_source",
    "records_id",
    "fail_stale_trials",
    "fail_worker_trials",
    "enqueue_defaults",
]


# The worker that created a study, until it stores the study's plan for good (after its recording
# and re-plan): ``{"worker": host:pid, "until": the epoch second its budget ends}``; None after.
PLANNING = "planning"


def study_kwargs(seed: int, trials_before: int, ledger: Ledger | None = None) -> dict[str, Any]:
    """A seeded TPE sampler and a median pruner, timed into ``ledger``. The seed is offset by
    the trials already in the study, so a resume or a second worker samples differently, and
    ``constant_liar`` spreads workers out."""
    import optuna

    sampler = optuna.samplers.TPESampler(seed=seed + trials_before, constant_liar=True)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=len(parametric_families()) + 4)
    if ledger is not None:
        sampler = _timed(sampler, SAMPLER_CALLS, "alg:sampler", ledger)
        pruner = _timed(pruner, ("prune",), "alg:pruner", ledger)
    return {"sampler": sampler, "pruner": pruner}


SAMPLER_CALLS = (
    "infer_relative_search_space",
    "sample_relative",
    "sample_independent",
    "before_trial",
    "after_trial",
)


def _timed(obj: Any, calls: tuple[str, ...], category: str, ledger: Ledger) -> Any:
    """``obj`` with its methods ``calls`` timed into ``ledger`` under ``category``."""

    def timing(call: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with ledger.track(category):
                return call(*args, **kwargs)

        return timed

    for name in calls:
        setattr(obj, name, timing(getattr(obj, name)))
    return obj


def describe_spec(suite: SuiteSpec) -> str:
    """``gpt2-tiny/bad-batches (fp16)`` (a spec named otherwise: ``name (model, scenario,
    dtype)``), or ``suite 'suite' (8 members: ...)``."""
    if suite.is_single:
        spec = suite.members[0]
        wl = spec.workload
        if spec.name in (wl.scenario, f"{wl.model}/{wl.scenario}", f"{wl.model}-{wl.scenario}"):
            return f"{wl.model}/{wl.scenario} ({wl.dtype})"
        return f"{spec.name} ({wl.model}, {wl.scenario}, {wl.dtype})"
    models = sorted({m.workload.model for m in suite.members})
    scenarios = sorted({m.workload.scenario for m in suite.members})
    left = f", {len(suite.left_out)} left out" if suite.left_out else ""
    return (
        f"suite '{suite.name}' ({len(suite.members)} members: {', '.join(models)} x "
        f"{', '.join(scenarios)}{left})"
    )


def _versions() -> dict[str, str]:
    import optuna
    import optuna_dashboard
    import torch

    import autoscale

    return {
        "autoscale": autoscale.__version__,
        "torch": torch.__version__,
        "optuna": optuna.__version__,
        "optuna_dashboard": optuna_dashboard.__version__,
        "python": platform.python_version(),
    }


def study_note(name: str, plan: Plan, table: str = "") -> str:
    """The study's markdown note: workload, objective, plan, and the final table once there."""
    text = [
        f"## {name}",
        f"{describe_spec(plan.suite)}; objective: {OBJECTIVE_DOC}.",
        "",
        f"Plan: {plan.describe()}".replace("\n", "  \n"),
    ]
    if table:
        text += ["", "### Result on real steps of the test instances", "```", table, "```"]
    return "\n".join(text) + "\n"


def describe_new_study(
    study: Any, plan: Plan, *, command: str, budget: dict[str, Any], planner: str, until: float
) -> None:
    """Record what a new study is and enqueue every rule's defaults; ``planner`` (this worker)
    plans it until ``until`` (epoch seconds) at the latest."""
    from autoscale.search.trials import write_note

    attrs = {
        "command": command,
        "versions": _versions(),
        "budget": budget,
        "plan": plan.to_dict(),
        "objective": OBJECTIVE_DOC,
        "validation": plan.validation.to_dict(),
        "trace_steps": plan.trace_steps,
        PLANNING: {"worker": planner, "until": until},  # before the suite: joiners then wait
        "suite": plan.suite.to_dict(),  # last: joining workers wait for it
    }
    for key, value in attrs.items():
        study.set_user_attr(key, value)
    if plan.space in ("parametric", "both"):
        families = parametric_families()  # torch and the families searched (--family)
        enqueue_defaults(study, {rule: families[rule] for rule in plan.rules}, plan.suite.episode)
    write_note(study, study_note(study.study_name, plan))


def enqueue_defaults(study: Any, families: dict[str, Any], episode: Any) -> None:
    """Queue each rule's defaults as a trial, marked a baseline (the search scores them first)."""
    for rule, defaults in families.items():
        study.enqueue_trial(
            default_trial_params(rule, defaults, episode), user_attrs={"baseline": True}
        )


def store_plan(study: Any, plan: Plan | None = None, traded: Sequence[str] = ()) -> None:
    """Store a new study's plan for good (``plan`` where its creator re-planned after recording,
    ``traded`` what that re-plan traded; else the one stored at creation stays); other workers
    and resumes adopt it and never re-plan it."""
    from autoscale.search.trials import write_note

    if plan is not None:
        study.set_user_attr("replanned", list(traded))
        study.set_user_attr("plan", plan.to_dict())
        study.set_user_attr("validation", plan.validation.to_dict())
        study.set_user_attr("trace_steps", plan.trace_steps)
        study.set_user_attr("suite", plan.suite.to_dict())
        write_note(study, study_note(study.study_name, plan))
    study.set_user_attr(PLANNING, None)


def wait_for_plan(
    study: Any,
    on_wait: Callable[[str], None] | None = None,
    *,
    give_up_at: float = math.inf,
    timeout: float = 60.0,
    poll_s: float = 0.5,
) -> StoredPlan:
    """The study's plan for good: waits for a worker that is creating the study to
    store them (``timeout`` seconds at most), then, while that worker plans (it records and may
    re-plan), until it stores its plan, its budget ends, or it is a process of this host that no
    longer runs (then the plan stored at creation is the study's, and this says so in the study).
    ``on_wait`` hears the planner's ``host:pid`` once, when there is something to wait for.

    Raises:
        BudgetError: the planner still plans at ``give_up_at`` (``time.monotonic()``: this
            worker's budget end).
    """
    deadline = time.monotonic() + timeout
    while "suite" not in study.user_attrs and time.monotonic() < deadline:
        raise_if_interrupted()  # one held through the storage read (processes.sticky_interrupt)
        time.sleep(poll_s)
    told = False
    while planning := study.user_attrs.get(PLANNING):
        worker = str(planning.get("worker"))
        if owner_gone(worker) or time.time() > planning.get("until", 0.0):
            study.set_user_attr(PLANNING, None)  # stopped before storing its plan
            break
        if time.monotonic() >= give_up_at:
            raise BudgetError(
                f"study '{study.study_name}' is still planned by the worker that created it "
                f"({worker}): the budget ran out waiting for the plan it stores after recording; "
                "run this worker again once that one searches"
            )
        if on_wait is not None and not told:
            on_wait(worker)
            told = True
        raise_if_interrupted()
        time.sleep(poll_s)
    attrs = study.user_attrs  # (one read of the storage: an RDB query)
    plan = attrs.get("plan") or {}
    return StoredPlan(*study_suites(study, attrs), bool(plan.get("all_rules_real", True)))


def records_id(records: list[Any]) -> list[list[Any]]:
    """What a study of records is made from: each record's folder and its number of steps."""
    from pathlib import Path

    return [[str(Path(r.path).resolve()), len(r.steps)] for r in records]


def check_source(
    attrs: dict[str, Any], study: str, records: list[Any] | None = None, suite: Any = None
) -> None:
    """Refuse to resume a study from another source than it was made from: a workload's real
    steps (``records`` None) or these recorded runs (``records`` and their ``suite``)."""
    made = attrs.get("traces")
    if "suite" not in attrs and made is None:
        return  # new, or being created by another worker: nothing to compare yet
    if records is None:
        if made is not None:
            raise ConfigError(
                f"study '{study}' was made from records ({', '.join(made)}): pass --traces with "
                "them to resume it, or --study NEW_NAME to search a workload"
            )
        return
    if made is None:
        members = [m.get("name") for m in attrs["suite"].get("members", [])]
        raise ConfigError(
            f"study '{study}' was made from a workload's real steps ({', '.join(members)}), not "
            "records: pass --study NEW_NAME to search these records"
        )
    now = records_id(records)
    stored = attrs.get("records")
    same = attrs.get("suite") == suite.to_dict() and (
        stored == now if stored is not None else made == [p for p, _ in now]
    )
    if not same:
        raise ConfigError(
            f"study '{study}' was made from other records ({', '.join(made) or 'other records'}, "
            "or the same folders holding other steps): pass --study NEW_NAME to search these, or "
            "the same records to resume it"
        )


def check_workload(stored: SuiteSpec, asked: SuiteSpec, study: str) -> None:
    """Refuse to add trials of other workloads to a study."""
    theirs = {m.name: m.workload.to_dict() for m in stored.members}
    mine = {m.name: m.workload.to_dict() for m in asked.members}
    if set(mine) != set(theirs):
        raise ConfigError(
            f"study '{study}' searches members {sorted(theirs)}, not {sorted(mine)}; use another "
            "--study, or drop --env/--model/--scenario to join it"
        )
    for name, t in theirs.items():
        m = mine[name]
        if m != t:
            diff = ", ".join(f"{k}={t[k]!r} (asked {m[k]!r})" for k in t if m.get(k) != t[k])
            raise ConfigError(
                f"study '{study}' searches another workload: {diff}; use another --study, or drop "
                "--env/--model/--scenario to join it"
            )


# a trial still untagged (``worker`` = host:pid) this long after its start had its worker killed
# inside Optuna's ``ask``, and nobody else would ever fail it
UNTAGGED_GRACE_S = 300.0


def fail_stale_trials(study: Any, storage: Any, untagged_grace_s: float = UNTAGGED_GRACE_S) -> int:
    """Fail the running trials left by workers of this host that no longer run (killed hard),
    and those that no worker ever tagged (killed between Optuna's ask and the objective)."""
    import datetime

    from optuna.trial import TrialState

    n = 0
    now = datetime.datetime.now()  # Optuna stamps datetime_start with the local naive time
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        tag = t.user_attrs.get("worker")
        dead = owner_gone(tag)
        untagged = (
            tag is None
            and t.datetime_start is not None
            and (now - t.datetime_start).total_seconds() > untagged_grace_s
        )
        if dead or untagged:
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            n += 1
    return n


def fail_worker_trials(study: Any, worker: str) -> int:
    """Fail the running trials of ``worker``, which an interrupted worker could not tell."""
    import contextlib

    from optuna.trial import TrialState

    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get("worker") == worker:
            with contextlib.suppress(Exception):  # finished meanwhile
                study.tell(t.number, state=TrialState.FAIL)
                n += 1
    return n
