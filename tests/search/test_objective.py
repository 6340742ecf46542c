import math

import pytest

from autoscale.envs.spec import RewardWeights
from autoscale.search.objective import episode_cost, objective, objective_terms
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


def test_objective_is_the_mean_over_instances_and_terms_add_up():
    cards = [card(0.125, 0.01), card(0.0, 0.03), card(0.25, 0.0, diverged=True)]
    expected = (0.165 + 0.12 + 10.25) / 3
    assert objective(cards, W) == pytest.approx(expected)
    t = objective_terms(cards, W)
    assert t["objective"] == pytest.approx(expected)
    assert t["skip_term"] + t["precision_term"] + t["divergence_term"] == pytest.approx(expected)
    assert t["skip_rate"] == pytest.approx(0.125) and t["diverged"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="at least one"):
        objective([], W)
