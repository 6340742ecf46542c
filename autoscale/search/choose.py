"""The pick: rank what was validated, put the best through the no-harm check, export the first that
passes, and say why at each step.

Candidates and built-in rules are ranked on the same real-step test episodes by the objective
against ``torch`` (:func:`~autoscale.search.export.rank`). Walking down the ranking, each one runs
the no-harm check (:mod:`autoscale.search.gate`): screened on replay of ``torch``'s long clean runs
first, then its own long clean runs. The first that passes is exported; a built-in rule that ranks
first is exported as itself (its defaults) and said to be one. Verdicts are kept in the study, so a
resumed search or another worker does not run them again. ``torch`` passes by definition: it is
the reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autoscale.search.budget import Ledger, format_duration
from autoscale.search.candidates import TORCH
from autoscale.search.gate import NoHarmCheck, Verdict
from autoscale.search.timing import Timings
from autoscale.search.validate import Validated
from autoscale.training.scorecard import json_safe

__all__ = ["Choice", "choose", "GATE_PREFIX"]

GATE_PREFIX = "no-harm:"


@dataclass
class Choice:
    """What :func:`choose` decided.

    Attributes:
        winner: The first validated scaler of the ranking that passed the check (None: none).
        verdicts: The verdicts reached, in the order they were reached (stored ones included).
        unchecked: Labels the time left could not check.
    """

    winner: Validated | None
    verdicts: list[Verdict] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)


def _stored(study: Any, key: str) -> Verdict | None:
    data = study.user_attrs.get(GATE_PREFIX + key)
    if not data:
        return None
    return Verdict(**{k: data[k] for k in ("label", "passed", "reasons", "runs", "screened")})


def choose(
    study: Any,
    ranked: list[Validated],
    factories: dict[str, Callable[[], Any]],
    gate: NoHarmCheck,
    timings: Timings,
    ledger: Ledger,
    *,
    stop_at: float,
    say: Callable[[str], None],
) -> Choice:
    """Walk ``ranked`` (best first) until one passes the no-harm check or time runs out.

    Args:
        factories: Key -> a factory of fresh scalers of that validated scaler.
        stop_at: ``time.monotonic()`` past which no real check starts (its estimated cost must
            fit before it).
    """
    choice = Choice(None)
    for v in ranked:
        if not v.real:
            choice.unchecked.append(f"{v.label} (validated on replay only)")
            continue
        if v.key == TORCH:
            choice.winner = v
            return choice
        verdict = _stored(study, v.key)
        fresh = verdict is None
        if verdict is None:
            factory = factories[v.key]
            verdict = gate.screen(factory, v.label)
            if verdict.passed:
                need = 1.2 * gate.cost(timings, 1)
                if time.monotonic() + need > stop_at:
                    choice.unchecked.append(
                        f"{v.label} (its no-harm check needs ~{format_duration(need)}, "
                        f"{format_duration(max(0.0, stop_at - time.monotonic()))} left)"
                    )
                    continue
                verdict = gate.check(factory, v.label)
            with ledger.track("bk:attrs"):
                study.set_user_attr(GATE_PREFIX + v.key, json_safe(verdict.to_dict()))
        choice.verdicts.append(verdict)
        if fresh:
            say(verdict.summary())
        if verdict.passed:
            choice.winner = v
            return choice
    return choice
