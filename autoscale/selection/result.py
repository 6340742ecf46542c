"""What one ``auto`` build measured and decided (:class:`BuildResult`), for its reports and its
export; the build itself is :mod:`autoscale.selection.auto`."""

from __future__ import annotations

import dataclasses
from typing import Any

from autoscale.selection import suite_eval as ev

__all__ = ["BuildResult", "LongRuns"]


@dataclasses.dataclass
class LongRuns:
    """One candidate's long runs of every member next to torch's, and the harm found per member."""

    runs: dict[str, dict[str, Any]]
    harm: dict[str, list[str]]


@dataclasses.dataclass
class BuildResult:
    """Everything a build measured and decided, for its reports."""

    settings: Any  # the build's BuildSettings (autoscale.selection.auto)
    searched: list[str]  # the train members
    left_out: list[str]  # the validation and test members
    weights: Any
    candidates: list[str]  # in the order they ran, torch last
    agent_runs: dict[str, dict]
    same_as_builtin: str | None  # the built-in rule the suite search exported as itself
    cards: dict[str, dict[str, list]]  # scaler -> member -> scorecards (test members: after choice)
    objective: dict[str, float]  # on the train members
    zero_shot: dict[str, float]  # on the left-out members (test ones included after the choice)
    acceptance: dict[str, dict[str, dict]]
    confirmed: dict[str, dict[str, dict[str, list]]]  # scaler -> member -> more episodes
    ranked: list[str]
    validation: list[str] = dataclasses.field(default_factory=list)
    test: list[str] = dataclasses.field(default_factory=list)
    objective_validation: dict[str, float] = dataclasses.field(default_factory=dict)
    objective_test: dict[str, float] = dataclasses.field(default_factory=dict)
    ranked_on: str = "validation"  # the members whose objective ranked: validation, or train
    verdicts: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    long_runs: dict[str, LongRuns] = dataclasses.field(default_factory=dict)
    evidence: dict[str, dict[str, list]] | None = None  # fresh seeds: choice, REFERENCE, torch
    evidence_acceptance: dict[str, dict] | None = None
    evidence_confirmed: dict[str, dict[str, list]] = dataclasses.field(default_factory=dict)
    chosen: str | None = (
        None  # what :func:`~autoscale.selection.auto.what_ships` returned, before the test members
    )
    test_confirmed: dict[str, dict[str, list]] = dataclasses.field(default_factory=dict)
    pick: str | None = None  # what ships: the choice, unless it harms a test member
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    # member -> the hindsight limit's precision loss on its held-out steps (after the choice)
    limits: dict[str, float] = dataclasses.field(default_factory=dict)
    # scaler -> member -> the share of the achievable precision gain over torch it captures
    limit_shares: dict[str, dict[str, float | None]] = dataclasses.field(default_factory=dict)

    def mean_limit_share(self, scaler: str, members: list[str]) -> float | None:
        """The mean of ``scaler``'s shares of the limit over ``members`` (those with a gain)."""
        shares = [self.limit_shares.get(scaler, {}).get(m) for m in members]
        shares = [x for x in shares if x is not None]
        return sum(shares) / len(shares) if shares else None

    @property
    def chosen_on(self) -> list[str]:
        """The members the choice reads: train and validation."""
        return [m for m in self.searched + self.left_out if m not in self.test]

    def long_summary(self, scaler: str) -> dict[str, dict]:
        """Member -> {scaler, torch} -> skip rate, eval loss, precision loss, kept, exact zeros and
        zeroed steps of ``scaler``'s long runs (empty when it had none)."""
        long = self.long_runs.get(scaler)
        if long is None:
            return {}
        return {
            m: {
                who: {
                    "skip_rate": run[who]["card"].skip_rate,
                    "eval_loss": run[who]["card"].eval_loss,
                    "precision_loss": run[who]["card"].precision_loss,
                    "kept": ev.kept_share(run[who]),
                    "exact_zeros": ev.structural_share(run[who]),
                    "zeroed_steps": ev.zeroed_steps(run[who]),
                }
                for who in (scaler, "torch")
            }
            for m, run in long.runs.items()
        }
