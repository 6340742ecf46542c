import dataclasses

import pytest

from autoscale.envs.suite import as_suite, load_spec
from autoscale.errors import BudgetError
from autoscale.search.no_harm import no_harm_workloads
from autoscale.search.plan import (
    HORIZON_LADDER,
    REAL_SHARE,
    RECORD_SHARE,
    StoredPlan,
    make_plan,
    record_cost,
    validate_cost,
)
from autoscale.search.runner import rules_torch_first
from autoscale.search.timing import MARGIN, NoHarmPlan, Timing, Timings, measure, workload_key
from autoscale.search.workload import base_spec

RULES = rules_torch_first()


def timings_for(
    suite, step_s: float, build_s: float = 0.01, eval_s: float = 0.001, small_s: float = 0.003
) -> Timings:
    """``step_s`` for the suite's workloads, ``small_s`` for the small presets of the no-harm
    check (mlp) and 0.02 s for the gpt2-tiny proxy of a larger language model."""
    from autoscale.search.no_harm import no_harm_proxy

    ideal = list(no_harm_workloads(list(suite.members)))
    workloads = (
        [m.workload for m in suite.members]
        + ideal
        + [p for p in map(no_harm_proxy, ideal) if p is not None]
    )
    own = {m.workload.model for m in suite.members}

    def step(w):
        if w.model in own:
            return step_s
        return small_s if w.model in ("mlp", "autoencoder") else 0.02

    return Timings({workload_key(w): Timing(step(w), build_s, eval_s, 4) for w in workloads})


def plan_for(spec, step_s, work_s, **kw):
    suite = as_suite(spec)
    no_harm = NoHarmPlan(no_harm_workloads(list(suite.members)), 1000)
    return make_plan(
        suite, timings_for(suite, step_s), work_s, no_harm=no_harm, rules=RULES, **kw
    ), no_harm


def test_the_ladder_reaches_long_horizons():
    assert max(HORIZON_LADDER) >= 2048
    spec = base_spec(model="mlp")
    assert spec.episode.horizon == 2048


def test_fast_model_gets_long_horizon_two_windows_and_extra_seeds():
    plan, _ = plan_for(base_spec(model="mlp"), 0.0002, 3600, space="both")
    member = plan.suite.members[0]
    assert plan.horizon == 2048 and plan.trace_steps == 4096  # early and late in the run
    assert len(member.instances["train"]) == 9 and len(member.instances["test"]) == 9
    assert {i.seed for i in member.instances["train"]}.isdisjoint(
        i.seed for i in member.instances["test"]
    )
    assert plan.steps == 2048 and plan.all_rules_real  # validation as long as the horizon
    assert plan.space == "both" and plan.cuts == ()
    assert "early and late in 4096-step runs" in plan.describe()


def test_a_shipped_residual_agent_keeps_rl_in_a_budget_that_leaves_no_search_time():
    """The warm RL trial is the shipped agent scored on the replay where no time is left (seconds):
    RL is not dropped for time while it ships and the warm start is on; a cold start is."""
    from autoscale.agents import warm
    from autoscale.search.plan import RL_MIN_SEARCH_S

    assert warm.shipped_agent(which=warm.RESIDUAL) is not None
    plan, _ = plan_for(base_spec(), 0.05, 330, space="both")
    assert plan.search_s < RL_MIN_SEARCH_S and plan.space == "both"
    cold, _ = plan_for(base_spec(), 0.05, 330, space="both", warm_start=False)
    assert cold.space == "parametric"
    assert f"RL dropped (needs {RL_MIN_SEARCH_S:.1f}s of search" in cold.describe()


def test_plan_keeps_recording_and_real_steps_within_their_shares_and_says_what_it_traded():
    spec = base_spec()
    plan, no_harm = plan_for(spec, 0.05, 360)
    t = timings_for(as_suite(spec), 0.05)
    rec = record_cost(plan.suite, plan.trace_steps, t)
    assert rec <= RECORD_SHARE * 360
    val = validate_cost(plan.validation, t, 2)
    assert rec + val + no_harm.cost(t, 1, lambda w, s: False) <= REAL_SHARE * 360
    assert plan.horizon < 2048
    text = plan.describe()
    assert "traded: " in text and f"replay horizon {plan.horizon} of 2048 steps" in text


def test_slow_model_gets_short_episodes_and_a_proxy_no_harm_check_and_says_so():
    spec = base_spec(model="gpt2")
    plan, _ = plan_for(spec, 1.5, 0.95 * 7200, space="both")
    assert plan.horizon <= 512 and len(plan.suite.members[0].instances["test"]) >= 1
    assert [w.model for w in plan.no_harm.workloads] == [
        "mlp",
        "gpt2-tiny",
        "mlp",
    ]  # mlp drifts too
    text = plan.describe()
    assert "no-harm runs of gpt2" in text and "checked on gpt2-tiny instead" in text
    assert plan.record_s <= RECORD_SHARE * 0.95 * 7200


def test_gpt2_in_two_hours_gets_64_step_episodes_of_three_train_and_three_test_instances():
    """GPT-2 124M as measured on a 2-core CPU with emulated fp16 products: 4.6 s a step, a
    recorded step about the same, 15 s to build a run, 5 s to evaluate."""
    suite = as_suite(base_spec(model="gpt2"))
    no_harm = NoHarmPlan(no_harm_workloads(list(suite.members)), 1000)
    t = timings_for(suite, 4.6, build_s=15.0, eval_s=5.0)
    t = Timings(
        {
            k: dataclasses.replace(v, record_step_s=4.8 if v.step_s == 4.6 else None)
            for k, v in t.by_key.items()
        }
    )
    plan = make_plan(suite, t, 0.95 * 7200, no_harm=no_harm, rules=RULES)
    first = plan.suite.members[0]
    assert plan.horizon >= 64
    assert len(first.instances["train"]) >= 3 and len(first.instances["test"]) >= 3
    assert plan.record_s + plan.validate_s + plan.no_harm_s <= REAL_SHARE * 0.95 * 7200


def test_budget_too_small_says_what_budget_would_do():
    spec = base_spec(model="gpt2")
    suite = as_suite(spec)
    no_harm = NoHarmPlan(no_harm_workloads(list(suite.members)), 1000)
    with pytest.raises(BudgetError, match=r"1m50s per real step.*needs about \d+h"):
        make_plan(suite, timings_for(suite, 110.0, 2.4, 130.0), 600, no_harm=no_harm, rules=RULES)
    # one step, longer than measuring was allowed, finished and measured: an estimate, not a bound
    slow = Timings({k: Timing(200.0, 2.4, 0.0, 1) for k in timings_for(suite, 1).by_key})
    with pytest.raises(BudgetError, match=r"3m20s per real step.*needs about \d+h"):
        make_plan(suite, slow, 60, no_harm=no_harm, rules=RULES)
    # a build that took all the time allowed, no step timed: the step's 0 s is a lower bound
    unbuilt = Timings(
        {k: Timing(0.0, 200.0, 0.0, 0, complete=False) for k in timings_for(suite, 1).by_key}
    )
    with pytest.raises(BudgetError, match="takes 3m20s here, longer than.*needs more than"):
        make_plan(suite, unbuilt, 60, no_harm=no_harm, rules=RULES)


def test_a_stored_plan_is_kept_as_it_is():
    first, no_harm = plan_for(base_spec(model="mlp"), 0.005, 120)
    suite = as_suite(base_spec(model="mlp"))
    fast = timings_for(suite, 0.0002)
    stored = (first.suite, first.validation, first.trace_steps)
    again = make_plan(suite, fast, 3600, no_harm=no_harm, rules=RULES, stored=stored)
    assert again.suite == first.suite and again.validation == first.validation
    assert again.trace_steps == first.trace_steps and again.cuts == ()
    cached = make_plan(
        suite,
        fast,
        3600,
        no_harm=no_harm,
        rules=RULES,
        stored=stored,
        cached_traces=lambda s, n: 1.0,
    )
    assert cached.record_s == 0.0


def test_a_joining_worker_prices_the_stored_plan_as_its_creator_did():
    """A worker adopting a study's plan keeps its shape and prices its validation for what the
    creator planned: every rule, auto and the candidates, or (where the creator could not afford
    every rule) torch, auto and a candidate; it priced one candidate where the creator priced
    three, and every rule where the creator had cut them."""
    suite = as_suite(base_spec(model="mlp"))
    timings = timings_for(suite, 0.005)
    no_harm = NoHarmPlan(no_harm_workloads(list(suite.members)), 1000)
    for work_s in (600, 60):  # every rule's validation fits, then only the least
        first = make_plan(suite, timings, work_s, no_harm=no_harm, rules=RULES)
        stored = StoredPlan(first.suite, first.validation, first.trace_steps, first.all_rules_real)
        joined = make_plan(suite, timings, work_s, no_harm=no_harm, rules=RULES, stored=stored)
        assert joined.all_rules_real == first.all_rules_real
        assert joined.validate_s == pytest.approx(first.validate_s)
    assert not first.all_rules_real  # (the second budget did cut the rules)


def test_the_plans_search_time_is_what_the_rounds_leave_it():
    """The rounds reserve validation and the no-harm check with a margin
    (:data:`~autoscale.search.timing.MARGIN`); the plan's search estimate leaves the same."""
    plan, _ = plan_for(base_spec(model="mlp"), 0.005, 600)
    reserved = plan.record_s + MARGIN * (plan.validate_s + plan.no_harm_s)
    assert plan.search_s == pytest.approx(600 - reserved)
    # where that leaves nothing, the rounds still search their least (and RL keeps it)
    tight, _ = plan_for(base_spec(), 0.05, 360, space="both", warm_start=False)
    assert tight.search_s == 0.0 and tight.space == "parametric"
    floor, _ = plan_for(base_spec(), 0.05, 360, space="both", warm_start=False, min_search_s=25.0)
    assert floor.search_s == 25.0 and floor.space == "both"


def test_a_suite_is_planned_with_each_members_own_step_time():
    suite = load_spec("suite")
    no_harm = NoHarmPlan(no_harm_workloads(list(suite.members)), 1000)
    t = timings_for(suite, 0.002)
    slow = {
        k: (Timing(0.05, 0.5, 0.05, 4) if k.startswith("gpt2-tiny") else v)
        for k, v in t.by_key.items()
    }
    plan = make_plan(suite, Timings(slow), 3600, no_harm=no_harm, rules=RULES)
    assert len(plan.suite.members) == len(suite.members) == 8
    assert {m.name for m in plan.validation.members} == {m.name for m in suite.members}
    # the gpt2-tiny members cost 25 times the others: they dominate the recording estimate
    gpt2 = sum(Timings(slow).of(m.workload).step_s for m in plan.suite.members if "gpt2" in m.name)
    assert gpt2 > 0.9 * sum(Timings(slow).of(m.workload).step_s for m in plan.suite.members)
    assert plan.record_s <= RECORD_SHARE * 3600
    assert {w.model for w in plan.no_harm.workloads} == {"mlp", "gpt2-tiny"}


def test_measure_times_real_and_recorded_steps_of_a_tiny_model():
    from autoscale.training import WorkloadSpec

    t = measure(WorkloadSpec(model="mlp", scenario="bad-batches"), limit_s=30, step_share_s=0.5)
    assert t.steps >= 2
    assert 0 < t.step_s < 1 and 0 < t.build_s < 10 and 0 < t.eval_s < 1
    assert t.record_step_s is not None and t.record_step_s > 0


SLOW_STEP = """
import signal
import time

import torch

SEEN = []  # the SIGALRM handler each loss saw


def make(seed, device):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 2)

    def loss(m, b):
        SEEN.append(signal.getsignal(signal.SIGALRM))
        time.sleep(0.6)  # every step outlasts the limit below
        return m(b).float().square().mean()

    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
        "batches": [torch.ones(4, 8)] * 8,
        "loss": loss,
    }


def slow_build(seed, device):
    time.sleep(0.6)  # the build alone outlasts the limit below
    return make(seed, device)
"""


@pytest.fixture()
def slow_step_module(tmp_path, monkeypatch):
    """``slow_step_wl``: a user workload whose every step (``make``) or whose build
    (``slow_build``) sleeps 0.6 s; yields its loss's record of the SIGALRM handler it saw. Built
    once first: the one-off imports of a first build (a second in a fresh process) are not the
    build time measured (the search warms up alike)."""
    import sys

    from autoscale.training import TrainingRun, WorkloadSpec

    (tmp_path / "slow_step_wl.py").write_text(SLOW_STEP)
    monkeypatch.syspath_prepend(str(tmp_path))
    TrainingRun(WorkloadSpec(model="slow_step_wl:make"), "static")
    yield sys.modules["slow_step_wl"].SEEN
    sys.modules.pop("slow_step_wl", None)


def test_a_step_longer_than_the_limit_is_finished_measured_and_nothing_sets_an_alarm(
    slow_step_module,
):
    """Measuring checks the time between steps: the first step runs to its end past the limit
    and is the step time (not a lower bound), nothing follows it, and no SIGALRM handler is
    installed meanwhile (an alarm raised inside torch ops, imports and ``__del__`` is gone)."""
    import signal

    from autoscale.training import WorkloadSpec

    before = signal.getsignal(signal.SIGALRM)
    t = measure(WorkloadSpec(model="slow_step_wl:make"), limit_s=0.3, step_share_s=10)
    assert t.complete and t.steps == 1
    assert t.step_s >= 0.6  # the sleep alone: a bound from below, not a speed
    assert t.record_step_s is None  # no time left for recorded steps: estimated from the step
    assert "per real step" in t.describe()  # a measured time, not "more than"
    assert slow_step_module == [before]  # one loss, that step's; the handler as it was before
    assert signal.getsignal(signal.SIGALRM) is before


def test_a_build_longer_than_the_limit_takes_no_step_and_says_so(slow_step_module):
    from autoscale.training import WorkloadSpec

    t = measure(WorkloadSpec(model="slow_step_wl:slow_build"), limit_s=0.3, step_share_s=10)
    assert not t.complete and t.steps == 0 and t.step_s == 0.0 and t.build_s >= 0.6
    assert slow_step_module == []  # no step began
    assert t.describe().startswith("building one run takes ")
