"""The plan after a recording that ran slower than measured: what is left is planned again with
the step times scaled by the pace, on the instances recorded, and every trade is said."""

from __future__ import annotations

import dataclasses

from autoscale.search.replan import least_after_record, pace_of, recorded_suite, replan
from autoscale.search.workload import base_spec
from tests.search.test_plan import plan_for


def _recorded(plan, keep_per_set: int, steps: int | None = None):
    """A stand-in for load_traces' output: each member's first ``keep_per_set`` instances per
    set recorded, of ``steps`` steps (default: the plan's)."""
    steps = steps or plan.trace_steps

    @dataclasses.dataclass
    class Inst:
        steps: int

    @dataclasses.dataclass
    class Tr:
        instances: dict

    traces, dropped = {}, []
    for m in plan.suite.members:
        kept = {}
        for which in ("train", "test"):
            for j, inst in enumerate(m.instances[which]):
                if j < keep_per_set:
                    kept[inst.name] = Inst(steps)
                else:
                    dropped.append(f"{m.name}:{inst.name}")
        traces[m.name] = Tr(kept)
    return traces, dropped


def _stats(pace: float, dropped, shortest: int):
    return {"wall_s": 10.0 * pace, "planned_s": 10.0, "dropped": dropped, "shortest": shortest}


def test_a_recording_on_plan_changes_nothing():
    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 600)
    traces, dropped = _recorded(plan, 99)
    same = replan(
        plan,
        traces,
        _stats(1.05, dropped, plan.trace_steps),
        left_s=300,
        budget_s=600,
        min_search_s=12,
        cached_no_harm=lambda w, s: False,
        keep_validation=False,
    )
    assert same is plan


def test_slow_steps_scale_the_timings_shorten_validation_and_say_what_was_traded():
    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 600)
    n_train = len(plan.suite.members[0].instances["train"])
    assert n_train >= 2
    traces, dropped = _recorded(plan, 1)
    new = replan(
        plan,
        traces,
        _stats(2.0, dropped, plan.trace_steps),
        left_s=0.25 * 600,
        budget_s=600,
        min_search_s=12,
        cached_no_harm=lambda w, s: False,
        keep_validation=False,
    )
    member = new.suite.members[0]
    assert len(member.instances["train"]) == 1 and len(member.instances["test"]) == 1
    assert new.validation.members[0].instances["test"] == member.instances["test"]
    key = next(iter(plan.timings.by_key))
    assert new.timings.by_key[key].step_s == 2 * plan.timings.by_key[key].step_s
    assert new.steps <= plan.steps
    traded = new.cuts[len(plan.cuts) :]
    total = sum(len(m.instances["train"]) + len(m.instances["test"]) for m in plan.suite.members)
    assert (
        traded[0]
        == "the phases after recording planned at the pace seen (steps ran 2.0x slower than measured)"
    )
    assert traded[1] == (
        f"{len(dropped)} of {total} instances unrecorded (steps ran 2.0x slower than measured)"
    )
    assert all("2.0x slower than measured" in c for c in traded)
    # what is left fits: validation and the check at the scaled times, and the search keeps time
    no_harm_min = new.no_harm.cost(new.timings, 1, lambda w, s: False)
    assert new.validate_s + no_harm_min + 12 <= 0.25 * 600
    assert "traded: " in new.describe()


def test_a_shorter_first_trace_shortens_the_replay_horizon():
    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 600)
    short = plan.horizon // 4
    traces, dropped = _recorded(plan, 1, steps=short)
    new = replan(
        plan,
        traces,
        _stats(3.0, dropped, short),
        left_s=200,
        budget_s=600,
        min_search_s=12,
        cached_no_harm=lambda w, s: False,
        keep_validation=False,
    )
    assert new.horizon == short and new.trace_steps == short
    assert new.steps <= short
    assert any(
        c.startswith(f"replay horizon {short} of the planned {plan.horizon}") for c in new.cuts
    )


def test_a_study_with_validation_results_keeps_their_episode_length():
    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 600)
    traces, dropped = _recorded(plan, 99)
    new = replan(
        plan,
        traces,
        _stats(2.5, dropped, plan.trace_steps),
        left_s=60,
        budget_s=600,
        min_search_s=12,
        cached_no_harm=lambda w, s: False,
        keep_validation=True,
    )
    assert new.steps == plan.steps and new.timings != plan.timings


def test_validation_results_keep_their_length_and_instances_when_the_traces_ran_short():
    """A study with validation results keeps its validation whole: a shorter recording shortens
    the replay horizon, never the real-step episodes already scored (results of two lengths
    would mix), nor drops its test instances (validation runs real steps, not the traces)."""
    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 600)
    short = plan.steps // 2
    traces, dropped = _recorded(plan, 1, steps=short)
    new = replan(
        plan,
        traces,
        _stats(3.0, dropped, short),
        left_s=200,
        budget_s=600,
        min_search_s=12,
        cached_no_harm=lambda w, s: False,
        keep_validation=True,
    )
    assert new.horizon == short  # the replay is what was recorded
    assert new.validation == plan.validation and new.steps == plan.steps


def test_helpers():
    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 600)
    assert pace_of({"wall_s": 3.0, "planned_s": 2.0}) == 1.5
    assert pace_of({"wall_s": 0.0, "planned_s": 0.0}) == 1.0
    least = least_after_record(plan, lambda w, s: False)
    assert 0 < least < plan.validate_s + plan.no_harm_s
    traces, _ = _recorded(plan, 1)
    suite = recorded_suite(plan.suite, traces, plan.horizon)
    assert all(len(m.instances["train"]) == 1 for m in suite.members)


def _runner(tmp_path, plan, name: str):
    """A worker of a search, past its recording: what ``_replan`` reads of it."""
    import time

    from autoscale.search.budget import Budget, Ledger
    from autoscale.search.no_harm import NoHarmCheck
    from autoscale.search.runner import SearchRunner, _scale_kw
    from autoscale.search.session import SearchConfig

    cfg = SearchConfig(base=plan.suite, study="shared", export="shared", progress=False)
    runner = SearchRunner(cfg, Budget(600.0, time.monotonic(), 5.0), out=lambda s: None)
    runner.worker = name
    runner.folder = tmp_path
    runner.no_harm = NoHarmCheck(plan.no_harm, tmp_path, Ledger(), _scale_kw(plan.suite))
    runner.result.plan = plan
    return runner


def test_a_worker_that_re_plans_after_another_went_past_keeps_the_stored_shape(tmp_path):
    """Two workers of one study: the first re-plans nothing and searches under the stored shape
    before any of its trials is scored; the second recorded slowly and would shorten validation.
    It keeps the stored validation (and stores nothing), so both validate alike; a worker
    whose own plan differs from the stored one adopts the stored one."""
    import optuna

    from autoscale.search.export import study_suites
    from autoscale.search.runner import SHAPE_FIXED
    from autoscale.search.study import store_plan

    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 600)
    study = optuna.create_study()
    store_plan(study, plan)
    traces, dropped = _recorded(plan, 99)
    first = _runner(tmp_path, plan, "a")
    assert first._replan(study, plan, traces, _stats(1.05, dropped, plan.trace_steps)) is plan
    assert study.user_attrs[SHAPE_FIXED] == "a"
    assert not study.get_trials()  # nothing scored yet: only the mark holds the shape
    second = _runner(tmp_path, plan, "b")
    slow = second._replan(study, plan, traces, _stats(3.0, dropped, plan.trace_steps))
    assert slow.validation == plan.validation  # alone, it would have shortened it:
    alone = replan(
        plan,
        traces,
        _stats(3.0, dropped, plan.trace_steps),
        left_s=second.budget.left(),
        budget_s=600,
        min_search_s=second.min_search_s,
        cached_no_harm=lambda w, s: False,
        keep_validation=False,
    )
    assert alone.validation != plan.validation
    assert study_suites(study)[1] == plan.validation
    # a third worker, whose plan was made before the first stored a shorter validation
    shorter = dataclasses.replace(plan, validation=alone.validation)
    store_plan(study, shorter)
    third = _runner(tmp_path, plan, "c")
    adopted = third._replan(study, plan, traces, _stats(1.05, dropped, plan.trace_steps))
    assert adopted.validation == alone.validation


def test_a_lone_worker_resuming_its_own_stopped_search_may_re_plan(tmp_path):
    """The mark holds a study's shape only while its worker may still search: a stopped search of
    this host (its process gone) resumed by the same user re-plans as if unmarked."""
    import subprocess
    import sys

    import optuna

    from autoscale.processes import host_name, owner_tag
    from autoscale.search.export import study_suites
    from autoscale.search.runner import SHAPE_FIXED
    from autoscale.search.study import store_plan

    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 600)
    study = optuna.create_study()
    store_plan(study, plan)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    study.set_user_attr(SHAPE_FIXED, f"{host_name()}:{gone.pid}")
    traces, dropped = _recorded(plan, 99)
    resumed = _runner(tmp_path, plan, owner_tag())
    slow = resumed._replan(study, plan, traces, _stats(3.0, dropped, plan.trace_steps))
    assert slow.validation != plan.validation  # re-planned, and the study keeps the new shape
    assert study_suites(study)[1] == slow.validation
    assert study.user_attrs[SHAPE_FIXED] == resumed.worker
