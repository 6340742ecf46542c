import pytest

from autoscale.errors import BudgetError
from autoscale.search.plan import (
    REAL_SHARE,
    RECORD_SHARE,
    Timing,
    make_plan,
    measure,
    record_cost,
    validate_cost,
)
from autoscale.search.runner import _rules_torch_first
from autoscale.search.workload import base_spec

RULES = _rules_torch_first()


def test_fast_model_gets_the_full_spec_with_extra_seeds():
    spec = base_spec(model="mlp")
    plan = make_plan(spec, Timing(0.002, 0.01, 0.001, 4), 600, space="both", rules=RULES)
    assert plan.steps == 64 and plan.space == "both" and plan.all_rules_real
    assert len(plan.spec.instances["train"]) == 12 and len(plan.spec.instances["test"]) == 12
    assert plan.cuts == ()
    assert {i.seed for i in plan.spec.instances["train"]}.isdisjoint(
        i.seed for i in plan.spec.instances["test"]
    )


def test_plan_keeps_recording_and_real_steps_within_their_shares():
    spec = base_spec()
    t = Timing(0.05, 0.3, 0.05, 4)
    plan = make_plan(spec, t, 50, rules=RULES)
    assert record_cost(plan.spec, t) <= RECORD_SHARE * 50
    assert (
        record_cost(plan.spec, t) + validate_cost(plan.spec, t, len(RULES) + 1) <= REAL_SHARE * 50
    )
    # 50 s cannot hold 64-step episodes on 3 + 3 instances and 9 scalers: the richest shape
    # that fits is taken (episode steps x instances per set), and the cut is said
    assert plan.steps * len(plan.spec.instances["test"]) == 64
    assert "could not afford: " in plan.describe() and plan.cuts


def test_slow_model_gets_short_episodes_no_rl_and_says_so():
    spec = base_spec(model="gpt2")  # ~110 s a step in emulated fp16 on 2 CPU cores
    plan = make_plan(spec, Timing(110.0, 2.4, 130.0, 1), 0.95 * 7200, space="both", rules=RULES)
    assert plan.steps == 8 and len(plan.spec.instances["test"]) == 1
    assert plan.space == "parametric" and not plan.all_rules_real
    text = plan.describe()
    assert "RL (needs 2 train instances" in text and "real-step validation of every rule" in text
    assert plan.record_s <= RECORD_SHARE * 0.95 * 7200


def test_budget_too_small_says_what_budget_would_do():
    spec = base_spec(model="gpt2")
    with pytest.raises(BudgetError, match=r"1m50s per real step.*needs about 1h\d\dm"):
        make_plan(spec, Timing(110.0, 2.4, 130.0, 1), 300, rules=RULES)
    with pytest.raises(BudgetError, match="more than 3m20s here.*needs more than"):
        make_plan(spec, Timing(200.0, 2.4, 0.0, 0, complete=False), 60, rules=RULES)


def test_a_stored_plan_is_kept_as_it_is():
    spec = base_spec(model="mlp")
    fast = Timing(0.002, 0.01, 0.001, 4)
    first = make_plan(spec, Timing(0.05, 0.3, 0.05, 4), 50, rules=RULES)
    again = make_plan(first.spec, fast, 600, rules=RULES, reshape=False)
    assert again.spec == first.spec and again.cuts == ()
    cached = make_plan(first.spec, fast, 600, rules=RULES, reshape=False, cached=lambda s: 1.0)
    assert cached.record_s == 0.0


def test_measure_times_real_steps_of_a_tiny_model():
    from autoscale.training import WorkloadSpec

    t = measure(WorkloadSpec(model="mlp", scenario="bad-batches"), limit_s=30, step_share_s=0.5)
    assert t.complete and t.steps >= 2
    assert 0 < t.step_s < 1 and 0 < t.build_s < 10 and 0 < t.eval_s < 1
