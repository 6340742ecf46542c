"""The search objective: one number per policy and instance set, from the scorecard. Lower is better.

For each episode (one instance, one scorecard)::

    cost = w.skip * skip_rate + w.precision * precision_loss + w.divergence * diverged

and the objective is the mean cost over the instances. ``w`` are the env spec's reward weights
(``reward:`` in ``envs/*.yaml``), so the search ranks policies the way the environment rewards
them: the episode mean of the env's per-step reward, without its progress term (on replay the
loss is the recorded one whatever the policy does, so that term would only add noise). An episode
whose every step was skipped has no precision loss (NaN in the scorecard); it is charged 1, the
worst possible. Trials are tuned on the *train* instances' replay and the winner is chosen on the
*test* instances' real steps, never on data it was tuned on.

This is the one definition; the search, validation, export and notes all call it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from autoscale.envs.spec import RewardWeights
from autoscale.training.scorecard import Scorecard

__all__ = ["episode_cost", "objective", "objective_terms", "OBJECTIVE_DOC"]

OBJECTIVE_DOC = (
    "mean over instances of skip*skip_rate + precision*precision_loss + divergence*diverged "
    "(reward weights of the env spec; lower is better)"
)


def _precision(card: Scorecard) -> float:
    return card.precision_loss if math.isfinite(card.precision_loss) else 1.0


def episode_cost(card: Scorecard, weights: RewardWeights) -> float:
    """The cost of one episode (see the module docstring)."""
    return (
        weights.skip * card.skip_rate
        + weights.precision * _precision(card)
        + weights.divergence * float(card.diverged)
    )


def objective(cards: Iterable[Scorecard], weights: RewardWeights) -> float:
    """Mean :func:`episode_cost` over ``cards`` (one per instance)."""
    costs = [episode_cost(c, weights) for c in cards]
    if not costs:
        raise ValueError("the objective needs at least one scorecard")
    return math.fsum(costs) / len(costs)


def objective_terms(cards: Iterable[Scorecard], weights: RewardWeights) -> dict[str, float]:
    """The objective and its weighted terms, each a mean over ``cards``; for notes and tables."""
    cards = list(cards)
    n = len(cards)
    skip = math.fsum(c.skip_rate for c in cards) / n
    precision = math.fsum(_precision(c) for c in cards) / n
    diverged = math.fsum(float(c.diverged) for c in cards) / n
    return {
        "objective": objective(cards, weights),
        "skip_rate": skip,
        "precision_loss": precision,
        "diverged": diverged,
        "skip_term": weights.skip * skip,
        "precision_term": weights.precision * precision,
        "divergence_term": weights.divergence * diverged,
    }
