import math
import statistics

import pytest

from autoscale.envs.spec import RewardWeights
from autoscale.search.objective import (
    ROBUSTNESS,
    episode_cost,
    mean_cost,
    objective,
    objective_terms,
    regrets,
)
from autoscale.training.scorecard import Scorecard


def card(skip_rate=0.0, precision=0.0, diverged=False, steps=32):
    skipped = round(skip_rate * steps)
    return Scorecard(
        steps, skipped, skip_rate, precision, 3.0, 3.1, 1.0, 2.0**16, False, diverged, 1.0, 30.0
    )


W = RewardWeights(skip=1.0, precision=4.0, progress=0.1, divergence=10.0)


def test_episode_cost_weights_each_scorecard_term():
    assert episode_cost(card(0.125, 0.01), W) == pytest.approx(0.125 + 0.04)
    assert episode_cost(card(diverged=True), W) == 10.0
    assert episode_cost(card(0.5, 0.0), RewardWeights(skip=2.0)) == 1.0


def test_all_skipped_episode_is_charged_full_precision_loss():
    assert episode_cost(card(1.0, math.nan), W) == pytest.approx(1.0 + 4.0)


def test_robust_objective_by_hand():
    """Two members. On 'a' the policy costs (0.165 + 0.12)/2 = 0.1425 and torch
    (0.125 + 0.2)/2 = 0.1625: regret -0.02. On 'b' it costs 0.5 + 0.04 = 0.54 and torch 0.125:
    regret +0.415. Objective = mean(-0.02, 0.415) + 1 * max = 0.1975 + 0.415 = 0.6125."""
    assert ROBUSTNESS == 1.0
    policy = {"a": [card(0.125, 0.01), card(0.0, 0.03)], "b": [card(0.5, 0.01)]}
    torch = {"a": [card(0.125, 0.0), card(0.0, 0.05)], "b": [card(0.125, 0.0)]}
    r = regrets(policy, torch, W)
    assert r["a"] == pytest.approx(-0.02) and r["b"] == pytest.approx(0.415)
    assert objective(policy, torch, W) == pytest.approx(0.6125)
    t = objective_terms(policy, torch, W)
    assert t["worst_member"] == "b" and t["worst_regret"] == pytest.approx(0.415)
    assert t["mean_regret"] == pytest.approx(0.1975)
    assert t["skip_rate"] == pytest.approx((0.125 + 0.0 + 0.5) / 3)
    assert t["reference_cost"] == pytest.approx(mean_cost(torch["a"] + torch["b"], W))


def test_a_policy_much_worse_on_one_member_loses_to_torch_despite_winning_elsewhere():
    """The worst-member term: winning three members by a little does not buy losing one badly."""
    torch = {m: [card(0.1, 0.05)] for m in "abcd"}
    specialist = {m: [card(0.1, 0.0)] for m in "abc"} | {"d": [card(0.5, 0.0)]}
    assert objective(torch, torch, W) == 0.0
    mean_only = sum(regrets(specialist, torch, W).values()) / 4
    assert mean_only < 0  # better than torch on average...
    assert objective(specialist, torch, W) > 0  # ...yet ranked below it


def test_one_member_ranks_like_the_cost_difference():
    torch = {"only": [card(0.125, 0.004), card(0.125, 0.006)]}
    for a, b in [(0.0, 0.0), (0.1, 0.02), (0.3, 0.0)]:
        policy = {"only": [card(a, b), card(a, b)]}
        diff = mean_cost(policy["only"], W) - mean_cost(torch["only"], W)
        assert objective(policy, torch, W) == pytest.approx((1 + ROBUSTNESS) * diff)


def test_the_objective_compares_the_same_episodes():
    with pytest.raises(ValueError, match="compares the same episodes"):
        objective({"a": [card(), card()]}, {"a": [card()]}, W)
    with pytest.raises(ValueError, match="reference 0"):
        objective({"a": [card()]}, {}, W)
    with pytest.raises(ValueError, match="at least one"):
        mean_cost([], W)


def test_a_lead_on_the_objective_is_held_to_the_objectives_own_noise():
    """The lead is the objective's difference, which weighs a member's mean cost difference by
    1/M plus ROBUSTNESS on the worst member: with one member, twice the mean. Its noise must be on
    that scale too; held to the standard error of the cost differences themselves, a gain of one
    standard error passed as two."""
    from autoscale.search.objective import LEAD_Z, lead

    ref = {"m": [card(0.25, 0.0)] * 4}
    bar = {"m": [card(0.1, 0.0)] * 4}
    # paired cost differences -0.02 +- 0.02: a mean gain of 0.02, its standard error 0.0115
    gains = (-0.04, 0.0, -0.04, 0.0)
    mine = {"m": [card(0.1 + g, 0.0) for g in gains]}
    ld = lead(mine, bar, ref, W)
    se_cost = (sum((d + 0.02) ** 2 for d in gains) / 3) ** 0.5 / 2
    assert ld.lead == pytest.approx((1 + ROBUSTNESS) * 0.02)
    assert ld.noise == pytest.approx(LEAD_Z * (1 + ROBUSTNESS) * se_cost)
    assert not ld.clear  # 0.02 is 1.7 standard errors of the gain: not beyond the noise
    assert ld.lead > LEAD_Z * se_cost  # what the cost differences' own error let through
    # two members of two episodes each, the bar worst on the second: weights 1/2 and 1/2 + 1,
    # each member's mean difference with its own variance
    ref2 = {"a": [card(0.25, 0.0)] * 2, "b": [card(0.25, 0.0)] * 2}
    bar2 = {"a": [card(0.1, 0.0)] * 2, "b": [card(0.2, 0.0)] * 2}
    mine2 = {"a": [card(0.1, 0.0)] * 2, "b": [card(0.16, 0.0), card(0.2, 0.0)]}
    ld2 = lead(mine2, bar2, ref2, W)
    var_b = statistics.variance([-0.04, 0.0])
    assert ld2.noise == pytest.approx(LEAD_Z * (1.5**2 * var_b / 2) ** 0.5)
    # a steady member (no difference) does not dilute the noisy one's variance, as one spread
    # pooled over every episode did (the lead cleared its noise that way)
    steady = {"clean": [card(0.0, 0.0)] * 4}
    ref3 = {**steady, "pref": [card(0.0, 0.0)] * 4}
    bar3 = {**steady, "pref": [card(0.3, 0.0)] * 4}
    mine3 = {**steady, "pref": [card(0.3 + d, 0.0) for d in (-0.2, -0.2, 0.0, 0.0)]}
    ld3 = lead(mine3, bar3, ref3, W)
    assert ld3.lead == pytest.approx(0.15) and not ld3.clear
    assert ld3.noise == pytest.approx(LEAD_Z * 1.5 * statistics.stdev([-0.2, -0.2, 0, 0]) / 2)
    # one episode per member: no member can tell its seed noise, whatever the number of members
    one = lead(
        {"a": [card(0.018)], "b": [card(0.028)]},
        {"a": [card(0.02)], "b": [card(0.03)]},
        {"a": [card(0.0)], "b": [card(0.0)]},
        W,
    )
    assert one.noise == math.inf and not one.clear
