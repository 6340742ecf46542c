"""The plan after a recording that ran slower than measured: what is left is planned again with
the step times scaled by the pace, on the instances recorded, and every trade is said. Only the
worker that creates a study re-plans it, once, and stores the plan for good; a worker joining or
resuming the study waits for that plan, adopts it and bends only its own time."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import numpy as np
import optuna
import pytest

from autoscale.envs.suite import as_suite
from autoscale.errors import BudgetError
from autoscale.search.export import study_suites
from autoscale.search.plan import (
    SLOW,
    least_after_record,
    recorded_suite,
    replan,
    shape_suite,
)
from autoscale.search.storage import open_storage
from autoscale.search.study import PLANNING, describe_new_study, store_plan, wait_for_plan
from autoscale.search.timing import MARGIN
from autoscale.search.traces import cached_share, load_traces, pace_of
from autoscale.search.workload import base_spec
from tests.search.test_plan import plan_for, timings_for
from tests.training.conftest import torch  # noqa: F401  (one intra-op thread: deterministic steps)


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
        left_s=0.4 * 600,
        budget_s=600,
        min_search_s=12,
        cached_no_harm=lambda w, s: False,
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
    assert new.validate_s + no_harm_min + 12 <= 0.4 * 600
    assert "traded: " in new.describe()


def test_validation_episodes_that_grow_are_said():
    """Instances left out of the recording leave validation fewer episodes to run: the re-plan
    lengthens them where the time allows, and says so with the shortening it would say."""
    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 300)
    traces, dropped = _recorded(plan, 1)
    stats = _stats(1.0, dropped, plan.trace_steps)
    new = replan(plan, traces, stats, left_s=150, budget_s=300, min_search_s=6,
                 cached_no_harm=lambda w, s: False)  # fmt: skip
    assert new.steps > plan.steps
    assert new.cuts[len(plan.cuts) :][-1] == (
        f"real-step validation episodes of {new.steps} steps, not the planned {plan.steps}: the "
        "time left allows them"
    )


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
    )
    assert new.horizon == short and new.trace_steps == short
    assert new.steps <= short
    assert any(
        c.startswith(f"replay horizon {short} of the planned {plan.horizon}") for c in new.cuts
    )


def test_helpers():
    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 600)
    assert pace_of({"wall_s": 3.0, "planned_s": 2.0}) == 1.5
    assert pace_of({"wall_s": 0.0, "planned_s": 0.0}) == 1.0
    least = least_after_record(plan, lambda w, s: False)
    assert 0 < least < plan.validate_s + plan.no_harm_s
    traces, _ = _recorded(plan, 1)
    suite = recorded_suite(plan.suite, traces, plan.horizon)
    assert all(len(m.instances["train"]) == 1 for m in suite.members)


def test_replan_without_traces_keeps_the_shape_and_times_the_rest_at_the_pace_seen():
    """What a worker that adopted a study's plan bends: its own step times, not the study's
    suite, validation or trace length."""
    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 600)
    kept = dict(left_s=200, budget_s=600, cached_no_harm=lambda w, s: False)
    assert replan(plan, None, _stats(SLOW, [], plan.trace_steps), **kept) is plan
    new = replan(plan, None, _stats(2.0, [], plan.trace_steps), **kept)
    shape = (new.suite, new.validation, new.trace_steps, new.all_rules_real)
    assert shape == (plan.suite, plan.validation, plan.trace_steps, plan.all_rules_real)
    key = next(iter(plan.timings.by_key))
    assert new.timings.by_key[key].step_s == 2 * plan.timings.by_key[key].step_s
    # the same episodes and scalers the plan priced (every rule, auto and the candidates) at
    # twice the step time; the search what the rounds leave, their margin over both included
    assert new.validate_s == pytest.approx(2 * plan.validate_s)
    left = 200 - MARGIN * (new.validate_s + new.no_harm_s)
    assert new.search_s == pytest.approx(max(0.0, left))
    assert new.cuts[len(plan.cuts)] == (
        "the phases after recording planned at the pace seen (steps ran 2.0x slower than measured)"
    )


# ---------------------------------------------------------------------- who re-plans
def _tiny_plan():
    """A real plan of mlp cut to 2 train + 2 test instances, 64-step traces replayed in episodes
    of 32 steps, validated on 16: seconds of real steps to record."""
    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 600)
    suite = shape_suite(as_suite(base_spec(model="mlp")), 32, 2, 1)
    return dataclasses.replace(
        plan, suite=suite, validation=suite.with_episode_steps(16), trace_steps=64
    )


def _worker(folder, plan, name: str, said: list[str]):
    """A worker of the search of ``plan`` whose artifacts are in ``folder``."""
    from autoscale.search.budget import Budget
    from autoscale.search.runner import SearchConfig, SearchRunner
    from autoscale.training.threads import fit_threads

    cfg = SearchConfig(base=plan.suite, study="shared", export="shared", progress=False)
    runner = SearchRunner(cfg, Budget(600.0, time.monotonic(), 5.0), out=said.append)
    runner.worker = name
    runner.folder = folder
    runner._use(plan)
    runner.threads = fit_threads()  # as its measure phase leaves them
    return runner


def _recorded_as_on_a_busy_machine(plan, folder):
    """Real traces of ``plan`` recorded as :func:`load_traces` bends: the first train instance
    whole, the first test one down to a quarter (16 steps, below the replay horizon: the
    re-plan shortens the episodes), the others left out; planned at a millisecond each, so the
    pace is far above SLOW."""
    calls: list[int] = []

    def cost(member, n):
        calls.append(n)
        return 1e-3 if len(calls) == 1 or n <= 16 else 1e6

    far = time.monotonic() + 600
    return load_traces(plan.suite, folder, plan.trace_steps, cost=cost, stop_at=far, shrink_to=8)


def _cost(m, n):
    return float(n)


@pytest.mark.slow
def test_the_creator_re_plans_once_and_a_joining_worker_adopts_its_plan(tmp_path):
    """The worker that creates the study records as its machine allows, re-plans and stores the
    plan for good, with every trace of it cached under its keys. A worker joining afterwards
    (another host: its own artifacts) records that plan whole; its steps ran slower than it
    measured, and it bends only its own time: the study's attributes stay as the creator left
    them, it says no 're-planned' line, and it replays the same steps as the creator."""
    plan = _tiny_plan()
    storage = open_storage(str(tmp_path / "runs.log"))
    said_a: list[str] = []
    creator = _worker(tmp_path / "a", plan, "host-a:1", said_a)
    study = creator._open_study(storage, None)
    assert creator.creator and study.user_attrs[PLANNING]["worker"] == "host-a:1"
    traces, stats = _recorded_as_on_a_busy_machine(plan, creator.folder)
    assert stats["dropped"] and stats["shortest"] == 16 and pace_of(stats) > SLOW
    replayed = creator._replan(traces, stats)
    new = creator.plan
    assert any(line.startswith("[2/6 plan] re-planned: ") for line in said_a), said_a
    assert (new.horizon, new.trace_steps) == (16, 16)
    assert study_suites(study) == (new.suite, new.validation, 16)
    assert study.user_attrs[PLANNING] is None  # stored for good
    # the creator replays what the study's plan says, and the cache holds all of it under it
    assert {i.steps for t in replayed.values() for i in t.instances.values()} == {16}
    assert cached_share(new.suite, creator.folder, new.trace_steps, _cost) == 1.0

    said_b: list[str] = []
    joiner = _worker(tmp_path / "b", plan, "host-b:2", said_b)
    kept = joiner._adopt(study)
    measured = timings_for(new.suite, 1e-5)  # faster than its steps will run
    joined = joiner._plan(new.suite, measured, new.no_harm, kept)
    # the plan it adopts is the creator's as re-planned on a busy machine: it says so, once
    traded = new.cuts[len(plan.cuts) :]
    assert traded and study.user_attrs["replanned"] == list(traded)
    (stays,) = [line for line in said_b if "bent to its recording" in line]
    assert stays == (
        "[2/6 plan] the study keeps the plan its first run bent to its recording ("
        + "; ".join(traded)
        + "); a new --study NAME plans afresh for this machine"
    ), said_b
    before = study.user_attrs
    traces_b, stats_b = joiner._record()
    assert stats_b["recorded"] == 2 and pace_of(stats_b) > SLOW
    joiner._replan(traces_b, stats_b)
    bent = joiner.plan
    assert study.user_attrs == before
    assert not [line for line in said_b if "re-planned" in line], said_b
    assert any("x slower than measured: this worker's phases are timed" in x for x in said_b)
    assert (bent.suite, bent.validation, bent.trace_steps) == (new.suite, new.validation, 16)
    assert bent.timings != joined.timings  # its own time, bent to its pace
    for m in new.suite.members:
        for name, mine in traces_b[m.name].instances.items():
            theirs = replayed[m.name].instances[name]
            assert np.array_equal(mine.threshold, theirs.threshold), name


def _new_study(tmp_path, plan, planner: str, until: float):
    study = optuna.create_study(storage=open_storage(str(tmp_path / "runs.log")))
    budget = {"text": "10m", "seconds": 600.0}
    describe_new_study(study, plan, command="", budget=budget, planner=planner, until=until)
    return study


@pytest.mark.slow
def test_a_worker_joining_while_the_creator_records_waits_for_its_stored_plan(tmp_path):
    """The creator (a live process) stores a re-planned shape a moment after the joiner arrives;
    the joiner says once that it waits, and adopts the stored plan, not the one of creation."""
    from autoscale.processes import owner_tag

    plan = _tiny_plan()
    study = _new_study(tmp_path, plan, owner_tag(), time.time() + 600)
    replanned = dataclasses.replace(plan, validation=plan.validation.with_episode_steps(8))

    def creator_stores():
        time.sleep(1.0)
        theirs = optuna.load_study(study_name=study.study_name, storage=study._storage)
        store_plan(theirs, replanned)

    # a worker whose budget ends first stops waiting, in one line
    with pytest.raises(BudgetError, match=r"^study '.+' is still planned by the worker that"):
        wait_for_plan(study, give_up_at=time.monotonic(), poll_s=0.05)
    thread = threading.Thread(target=creator_stores)
    thread.start()
    said: list[str] = []
    got = wait_for_plan(study, said.append, poll_s=0.05)
    thread.join()
    assert got == (plan.suite, replanned.validation, plan.trace_steps, replanned.all_rules_real)
    assert said == [owner_tag()]


def test_a_worker_does_not_wait_for_a_creator_that_stopped_before_storing_its_plan(tmp_path):
    """A creator of this host that no longer runs, or one of another host past its budget's end,
    stored no plan after recording: the plan of creation is the study's, for good."""
    import subprocess

    from autoscale.processes import host_name

    plan = _tiny_plan()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    gone_here = (f"{host_name()}:{gone.pid}", time.time() + 600)
    for k, (planner, until) in enumerate((gone_here, ("elsewhere:1", time.time() - 1))):
        (tmp_path / str(k)).mkdir()
        study = _new_study(tmp_path / str(k), plan, planner, until)
        said: list[str] = []
        got = wait_for_plan(study, said.append, poll_s=0.05)
        assert got == (plan.suite, plan.validation, plan.trace_steps, plan.all_rules_real)
        assert said == []
        assert study.user_attrs[PLANNING] is None


def test_a_ctrl_c_held_through_a_storage_read_stops_the_wait_for_a_plan(tmp_path):
    """Under the CLI a Ctrl-C that lands inside a storage call is held to the next check
    (``processes.sticky_interrupt``): a joiner waiting for the creator's plan reads the study in
    a loop, so it checks before each sleep, and stops at once instead of waiting out the
    creator's budget (or its own)."""
    import signal

    from autoscale.processes import owner_tag, sticky_interrupt

    study = _new_study(tmp_path, _tiny_plan(), owner_tag(), time.time() + 600)
    storage = study._storage  # the journal file's: its reads run in optuna/storages
    backend = storage._backend
    read, pressed = backend.read_logs, []

    def read_logs(*args, **kwargs):  # called by the storage, as a SIGINT during a read would land
        if not pressed:
            pressed.append(time.monotonic())
            signal.raise_signal(signal.SIGINT)
        return read(*args, **kwargs)

    backend.read_logs = read_logs
    # the command's process: SIGINT at Python's own handler, which sticky_interrupt replaces
    # (in the paced tier an earlier test had left another one installed: it then held nothing)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), sticky_interrupt():
            wait_for_plan(study, give_up_at=time.monotonic() + 5, poll_s=0.05)
    finally:
        signal.signal(signal.SIGINT, before)
    assert pressed and time.monotonic() - pressed[0] < 1.0
