"""What the held-out episodes of a replay bench leave a rule to win over ``auto``
(:func:`headroom`): a bound on any rule's lead, from the hindsight limit
(:mod:`autoscale.envs.limit`). Where no lead could clear the seed noise, the search on records
(:mod:`autoscale.search.on_traces`) stops instead of spending its budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autoscale.search.budget import percent
from autoscale.search.candidates import AUTO
from autoscale.search.objective import LEAD_FLOOR
from autoscale.training.bar import mean

__all__ = ["Room", "headroom"]


@dataclass(frozen=True)
class Room:
    """What the held-out windows leave a rule to win over ``auto``, on their replay.

    Attributes:
        windows: Held-out (test) windows.
        steps: Steps of each.
        lead: The most any rule could lead ``auto`` by on the objective.
        best: The floor's objective against ``torch``: no rule's is lower on these windows.
        auto, floor, torch: Mean skip rate and precision loss of each over the windows.
        unsavable: Steps whose loss was not finite: skipped at any scale.
    """

    windows: int
    steps: int
    lead: float
    best: float
    auto: dict[str, float]
    floor: dict[str, float]
    torch: dict[str, float]
    unsavable: int

    def reasons(self) -> list[str]:
        """Why no candidate can be exported over ``auto`` here, in short (empty: one may)."""
        out = []
        if self.windows < 2:
            out.append("one held-out window cannot tell a lead over auto from noise")
        if self.lead <= LEAD_FLOOR:
            out.append("auto already reaches the hindsight limit of the held-out windows")
        return out

    def reason(self) -> str | None:
        """:meth:`reasons` in full, or None."""
        why = []
        if self.windows < 2:
            why.append(
                "one held-out window: a lead over auto counts only beyond the seed noise, paired "
                "window by window, and one window gives no measure of it"
            )
        if self.lead <= LEAD_FLOOR:
            why.append(
                f"auto already reaches what the held-out windows allow: over them it loses "
                f"{percent(self.auto['precision_loss'])} of gradient elements below fp16's range and "
                f"skips {percent(self.auto['skip_rate'])} of the steps, as the hindsight limit does "
                f"(the largest scale that does not overflow each step, after each window's first "
                f"step, which every rule runs at the scale the run had there; {self.unsavable} "
                f"steps have a non-finite loss, skipped at any scale); no rule can lead it by more "
                f"than {max(0.0, self.lead):.4f} (a lead must pass {LEAD_FLOOR})"
            )
        return "; ".join(why) or None

    def describe(self) -> str:
        """The room in one phrase: ``auto``, ``torch`` and the limit, and the bound on a lead."""
        windows = (
            "the held-out window" if self.windows == 1 else f"the {self.windows} held-out windows"
        )
        return (
            f"on {windows} auto loses "
            f"{percent(self.auto['precision_loss'])} below fp16's range and skips "
            f"{percent(self.auto['skip_rate'])}, torch {percent(self.torch['precision_loss'])} and "
            f"{percent(self.torch['skip_rate'])}; the hindsight limit "
            f"{percent(self.floor['precision_loss'])} and {percent(self.floor['skip_rate'])}: a rule "
            f"could lead auto by up to {max(0.0, self.lead):.4f} on the objective"
        )


def headroom(bench: Any) -> Room:
    """What the test windows of ``bench`` (a replay bench of records) leave to win over ``auto``.

    A window's floor is the best any rule could score there: its first step as every rule runs
    it, every later one at the hindsight limit, and the dearest of those skipped on purpose where
    that lowers the cost. No rule's cost is below the floor's and the objective grows with every
    cost, so ``auto``'s objective minus the floor's bounds any rule's lead over ``auto``."""
    from autoscale.search.objective import objective

    weights = bench.suite.reward
    cards, records = bench.run("test", lambda: bench.scaler(AUTO.name))
    floor: dict[str, list] = {}
    unsavable = 0
    for member, mine in cards.items():
        for ep, card in zip(bench.member_episodes("test", member), mine, strict=True):
            lost, fl = _floor_card(bench, ep, records[ep.key], card, weights)
            floor.setdefault(member, []).append(fl)
            unsavable += lost
    reference = bench.reference["test"]
    best = objective(floor, reference, weights)
    return Room(
        windows=len(bench.episodes["test"]),
        steps=bench.suite.episode.steps,
        lead=float(objective(cards, reference, weights) - best),
        best=float(best),
        auto=_means(cards),
        floor=_means(floor),
        torch=_means(reference),
        unsavable=unsavable,
    )


def _floor_card(bench: Any, ep: Any, recs: list, card: Any, weights: Any) -> tuple[int, Any]:
    """(steps lost at any scale, the floor's scorecard) of one window (see :func:`headroom`)."""
    import numpy as np

    from autoscale.envs.limit import hindsight_limit
    from autoscale.envs.suite_env import split_instance
    from autoscale.training.scorecard import Scorecard

    member, inst = split_instance(ep.instance)
    trace, bounds = bench.traces[member], bench.suite.member(member).episode
    lim = hindsight_limit(
        trace.instance(inst), trace.hist_edges, ep.offset + 1, len(recs) - 1,
        min_scale=bounds.min_scale, max_scale=bounds.max_scale,
    )  # fmt: skip
    first = recs[0]
    precision = np.concatenate([[first.precision_loss], lim.precision_loss])
    skipped = np.concatenate([[first.found_inf], np.isnan(lim.log2_scale)])

    def cost(skip: np.ndarray) -> float:
        p = precision[~skip]
        mean = float(p.mean()) if p.size else 1.0
        return weights.skip * float(skip.mean()) + weights.precision * mean

    dearest = [i for i in np.argsort(-np.nan_to_num(precision)) if i > 0 and not skipped[i]]
    best, best_cost = skipped.copy(), cost(skipped)
    trying = skipped.copy()
    for i in dearest:
        trying[i] = True
        if cost(trying) < best_cost:
            best, best_cost = trying.copy(), cost(trying)
    scales = [first.scale] + [2.0**s if math.isfinite(s) else first.scale for s in lim.log2_scale]
    fl = Scorecard.from_steps(
        scales, best.tolist(), np.nan_to_num(precision).tolist(), [r.loss for r in recs],
        eval_loss=card.eval_loss, hit_min=False, wall_s=0.0,
    )  # fmt: skip
    return lim.unsavable, fl


def _means(cards: dict[str, list]) -> dict[str, float]:
    """Mean skip rate and precision loss over every card (no applied step: charged 1)."""
    all_cards = [c for cs in cards.values() for c in cs]
    return {f: mean(all_cards, f) for f in ("skip_rate", "precision_loss")}
