"""Each scenario reproduces its failure under the torch rule, in real fp16 steps."""

import math

import pytest

from autoscale.errors import ConfigError, UnknownNameError
from autoscale.training import (
    Scenario,
    TrainingRun,
    WorkloadSpec,
    list_scenarios,
    register_scenario,
)
from autoscale.training.scenarios import make_scenario, scenario_class, unregister_scenario


def torch_run(model, scenario, steps, params=None, scaler="torch", **overrides):
    run = TrainingRun(
        WorkloadSpec(model=model, scenario=scenario, scenario_params=params or {}),
        scaler,
        **overrides,
    )
    return run, run.run(steps)


def log2s(run):
    return [math.log2(r.scale) for r in run.records]


def test_bad_batches_ratchet_the_scale_down():
    run, card = torch_run("mlp", "bad-batches", 40, {"every": 5})
    bad = [r.step for r in run.records if r.loss_nonfinite]
    assert bad == [4, 9, 14, 19, 24, 29, 34, 39]
    assert [r.step for r in run.records if r.found_inf] == bad
    assert all(r.loss == math.inf for r in run.records if r.step in bad)
    scales = log2s(run)
    assert scales[0] == 16 and scales[-1] == 9  # 7 halvings used, the 8th applies to step 40
    assert math.log2(run.scaler.get_scale()) <= 16 - 8  # at least 8 bits lost in 40 steps
    assert card.skip_rate == 0.2 and card.min_scale == 2.0**9


def test_bad_batches_fail_at_any_scale():
    run, card = torch_run("mlp", "bad-batches", 6, {"every": 3}, scaler="static", init_scale=1.0)
    assert [r.found_inf for r in run.records] == [False, False, True, False, False, True]
    assert card.max_scale == 1.0


def test_small_grads_lose_precision_at_the_default_scale():
    _, low = torch_run("gpt2-tiny", "small-grads", 12)
    _, high = torch_run("gpt2-tiny", "small-grads", 12, scaler="static", init_scale=2.0**24)
    assert low.max_scale == 2.0**16 and low.skipped == 0 and high.skipped == 0
    assert low.precision_loss > 0.15
    assert high.precision_loss < 0.05 and low.precision_loss > 5 * high.precision_loss


def test_moving_spike_leaves_the_scale_low():
    run, card = torch_run("mlp", "moving", 45)
    scales = log2s(run)
    skipped = [r.step for r in run.records if r.found_inf]
    assert scales[:10] == [16.0] * 10
    assert (
        skipped and min(skipped) > 10 and max(skipped) <= 20
    )  # overflows only while the weight rises
    assert (
        max(scales[25:]) <= 16 - 6
    )  # the spike is over (step 30) and the scale is still 6+ bits down
    assert scales[-1] == scales[25]  # no regrowth within 2000 steps
    assert run.scenario.loss_weight(20) == 4096.0 and run.scenario.loss_weight(30) == 1.0


def test_moving_lr_warmup():
    scenario = make_scenario("moving", {"warmup": 4, "lr_peak": 10.0})
    assert [scenario.lr_factor(s) for s in range(6)] == [2.5, 5.0, 7.5, 10.0, 10.0, 10.0]


def test_preference_gradients_are_spiky():
    run, card = torch_run("mlp", "preference", 40)
    clean_run, clean = torch_run("mlp", "clean", 40)
    assert card.skipped >= 1 and clean.skipped == 0  # overflows at the default scale
    amax = [r.grad_amax for r in run.records if not r.found_inf and r.grad_amax > 0]
    assert max(amax) / min(amax) > 1e3  # swings over three orders of magnitude
    clean_amax = [r.grad_amax for r in clean_run.records]
    assert max(clean_amax) / min(clean_amax) < 10


def test_registry_and_custom_scenario():
    with pytest.raises(
        UnknownNameError, match="unknown scenario 'prefrence'; did you mean 'preference'"
    ):
        scenario_class("prefrence")

    @register_scenario("double-loss")
    class DoubleLoss(Scenario):
        """Doubles the loss."""

        defaults = {"factor": 2.0}

        def loss_weight(self, step):
            return self.params["factor"]

    try:
        assert "double-loss" in list_scenarios()
        run = TrainingRun(WorkloadSpec(model="mlp", scenario="double-loss"), "torch")
        rec = run.step()
        assert rec.stats.loss == pytest.approx(2 * rec.loss)
        assert repr(run.scenario) == "DoubleLoss(factor=2.0)"
    finally:
        unregister_scenario("double-loss")
    assert "double-loss" not in list_scenarios()


def test_token_sum_draws_a_new_count_each_step_from_the_seed_and_step_alone():
    scenario = make_scenario("token-sum", seed=3)
    weights = [scenario.loss_weight(s) for s in range(200)]
    assert all(16.0 <= w <= 16384.0 for w in weights)
    assert math.log2(max(weights)) - math.log2(min(weights)) > 9  # sizes swing by ~10 bits
    assert make_scenario("token-sum", seed=3).loss_weight(7) == weights[7]  # no hidden state
    assert make_scenario("token-sum", seed=4).loss_weight(7) != weights[7]
    assert make_scenario("token-sum", {"low": 4, "high": 4}).loss_weight(11) == 4.0
    with pytest.raises(
        ConfigError, match="token-sum' needs 0 < low <= high, got low 8.0, high 2.0"
    ):
        make_scenario("token-sum", {"low": 8, "high": 2})


def test_token_sum_ratchets_torch_down_while_a_lower_scale_passes():
    run, card = torch_run("mlp", "token-sum", 60)
    assert card.skipped >= 8 and card.min_scale <= 2.0**8  # every overflow halves it
    low_run, low = torch_run("mlp", "token-sum", 60, scaler="static", init_scale=2.0**4)
    overflowed = [r.step for r in low_run.records if r.found_inf]
    assert low.skipped <= 2  # the overflows were the scale's doing: a low scale passes them
    assert all(low_run.scenario.loss_weight(s) > 2.0**13 for s in overflowed)
