"""The search objective, defined once: how much worse than the ``torch`` rule a policy is, on the
members of a suite, with a robustness term. Lower is better; below 0 beats ``torch``.

1. Each episode (one instance of one member, one scorecard) has a **cost**::

       cost = w.skip * skip_rate + w.precision * precision_loss + w.divergence * diverged

   with ``w`` the reward weights of the env spec (``reward:`` in ``envs/*.yaml``), so the search
   ranks policies the way the environment rewards them: the episode mean of the env's per-step
   reward without its progress term (on replay the loss is the recorded one whatever the policy
   does, so that term would only add noise). An episode whose every step was skipped has no
   precision loss (NaN in the scorecard); it is charged 1, the worst possible.

2. Each member's **regret** is the policy's mean cost over the member's episodes minus the
   ``torch`` rule's on the *same* episodes. Relative to ``torch``, because members differ in how
   hard they are: a preference loss costs more than a clean run whatever the policy does, and an
   absolute mean would let the hard members drown out the easy ones. As a difference, not a
   ratio, because ``torch`` costs almost nothing on some members (clean runs), where a ratio
   would explode.

3. The **objective** is the mean regret plus :data:`ROBUSTNESS` times the worst member's::

       objective = mean_m(regret_m) + ROBUSTNESS * max_m(regret_m)

   The mean rewards being better on average; the worst term makes a policy that is much worse
   than ``torch`` on any one member lose, however well it does elsewhere (the failure of
   per-scenario winners: a static scale that wins ``bad-batches`` skips most ``preference``
   steps). With one member the objective is ``(1 + ROBUSTNESS) * regret``, so a single-spec search
   ranks policies exactly as their cost minus ``torch``'s does.

Trials are tuned on the *train* instances' replay and the winner is chosen on the *test* instances'
real steps, never on data it was tuned on. This is the one definition: the search, validation,
export, notes and experiments all call it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from autoscale.envs.spec import RewardWeights
from autoscale.training.scorecard import Scorecard

__all__ = [
    "ROBUSTNESS",
    "episode_cost",
    "mean_cost",
    "regrets",
    "objective",
    "objective_terms",
    "lead",
    "Lead",
    "LEAD_FLOOR",
    "LEAD_Z",
    "OBJECTIVE_DOC",
]

ROBUSTNESS = 1.0  # weight of the worst member's regret
LEAD_Z = 2.0  # a lead beyond 2 standard errors of the objective's difference is not noise
LEAD_FLOOR = 1e-3  # and never below this (a tenth of a point of skipped steps at weight 1)

OBJECTIVE_DOC = (
    "mean over members of (cost - torch's cost on the same episodes) + worst member's, with "
    "cost = skip*skip_rate + precision*precision_loss + divergence*diverged (reward weights of "
    "the env spec); lower is better, below 0 beats torch"
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


def mean_cost(cards: Iterable[Scorecard], weights: RewardWeights) -> float:
    """Mean :func:`episode_cost` over ``cards``."""
    costs = [episode_cost(c, weights) for c in cards]
    if not costs:
        raise ValueError("a cost needs at least one scorecard")
    return math.fsum(costs) / len(costs)


def regrets(
    cards: Mapping[str, list[Scorecard]],
    reference: Mapping[str, list[Scorecard]],
    weights: RewardWeights,
) -> dict[str, float]:
    """Member -> mean cost minus the reference's on the same episodes (members of ``cards``).

    Raises:
        ValueError: a member without reference episodes, or with another number of them.
    """
    out = {}
    for member, mine in cards.items():
        ref = reference.get(member)
        if not ref or len(ref) != len(mine):
            raise ValueError(
                f"member '{member}' has {len(mine)} episodes but the reference "
                f"{len(ref) if ref else 0}: the regret compares the same episodes"
            )
        out[member] = mean_cost(mine, weights) - mean_cost(ref, weights)
    return out


def objective(
    cards: Mapping[str, list[Scorecard]],
    reference: Mapping[str, list[Scorecard]],
    weights: RewardWeights,
) -> float:
    """Mean regret plus :data:`ROBUSTNESS` times the worst (see the module docstring)."""
    return _robust(regrets(cards, reference, weights))


def _robust(regret: Mapping[str, float]) -> float:
    """The objective of members' regrets: their mean plus :data:`ROBUSTNESS` times the worst."""
    r = list(regret.values())
    if not r:
        raise ValueError("the objective needs at least one member")
    return math.fsum(r) / len(r) + ROBUSTNESS * max(r)


def objective_terms(
    cards: Mapping[str, list[Scorecard]],
    reference: Mapping[str, list[Scorecard]],
    weights: RewardWeights,
) -> dict[str, float | dict[str, float] | str]:
    """The objective and what it is made of, for notes and tables: the mean and worst regret,
    the worst member, per-member regrets, and the mean skip rate and precision loss over every
    episode (the reference's too)."""
    r = regrets(cards, reference, weights)
    episodes = [c for cs in cards.values() for c in cs]
    ref_episodes = [c for m in cards for c in reference[m]]
    worst = max(r, key=r.get)

    def mean(values: list[float]) -> float:
        return math.fsum(values) / len(values)

    return {
        "objective": objective(cards, reference, weights),
        "mean_regret": mean(list(r.values())),
        "worst_regret": r[worst],
        "worst_member": worst,
        "regrets": r,
        "skip_rate": mean([c.skip_rate for c in episodes]),
        "precision_loss": mean([_precision(c) for c in episodes]),
        "diverged": mean([float(c.diverged) for c in episodes]),
        "cost": mean_cost(episodes, weights),
        "reference_skip_rate": mean([c.skip_rate for c in ref_episodes]),
        "reference_precision_loss": mean([_precision(c) for c in ref_episodes]),
        "reference_cost": mean_cost(ref_episodes, weights),
    }


@dataclass(frozen=True)
class Lead:
    """How far one scaler's objective is below another's (the bar's) on the same episodes.

    Attributes:
        lead: The bar's objective minus this one's (positive: this one is better).
        noise: What the lead must exceed to be more than seed noise (see :func:`lead`): at least
            :data:`LEAD_FLOOR`, infinite where no member has two episodes.
        episodes: Paired episodes.
    """

    lead: float
    noise: float
    episodes: int

    @property
    def clear(self) -> bool:
        """Better than the bar by more than the noise."""
        return self.lead > self.noise


def lead(
    cards: Mapping[str, list[Scorecard]],
    bar: Mapping[str, list[Scorecard]],
    reference: Mapping[str, list[Scorecard]],
    weights: RewardWeights,
) -> Lead:
    """The :class:`Lead` of ``cards`` over ``bar`` (both against ``reference``, ``torch``), paired
    episode by episode: the same instance, seed and steps ran under both.

    The lead is taken on the objective, so its noise is the objective's: each member's regret
    difference is the mean of its paired cost differences, and the objective weighs it by
    ``1/M``, plus :data:`ROBUSTNESS` for the worst member's (the bar's and, where it differs, the
    candidate's: with one member, ``1 + ROBUSTNESS``). Its standard error is
    ``sqrt(sum_m weight_m^2 * var_m / episodes_m)``, ``var_m`` the variance of member ``m``'s
    paired differences (a member of one episode: the pooled variance of the others'). Infinite
    where no member has two episodes: one episode a member cannot tell a lead from noise."""
    diffs: dict[str, list[float]] = {}
    for member, mine in cards.items():
        theirs = bar.get(member) or []
        if len(theirs) != len(mine):
            raise ValueError(
                f"member '{member}' has {len(mine)} episodes but the bar {len(theirs)}: a lead "
                "compares the same episodes"
            )
        diffs[member] = [
            episode_cost(a, weights) - episode_cost(b, weights) for a, b in zip(mine, theirs)
        ]
    diffs = {m: ds for m, ds in diffs.items() if ds}
    sides = [regrets(side, reference, weights) for side in (bar, cards)]
    gap = _robust(sides[0]) - _robust(sides[1])
    n = sum(len(ds) for ds in diffs.values())
    var = {m: statistics.variance(ds) for m, ds in diffs.items() if len(ds) > 1}
    if not var:
        return Lead(gap, math.inf, n)
    dof = sum(len(diffs[m]) - 1 for m in var)
    pooled = math.fsum((len(diffs[m]) - 1) * v for m, v in var.items()) / dof
    worst = {max(r, key=r.__getitem__) for r in sides}
    share = math.fsum(
        (1 / len(diffs) + (ROBUSTNESS if m in worst else 0.0)) ** 2 * var.get(m, pooled) / len(ds)
        for m, ds in diffs.items()
    )
    return Lead(gap, max(LEAD_Z * math.sqrt(share), LEAD_FLOOR), n)
