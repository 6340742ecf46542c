"""The pick: :func:`choose` holds the ranking of what was validated against ``auto`` (the bar),
puts each lead that clears it through the no-harm check, picks the first that passes (else
``auto``, or ``torch`` where ``auto`` harms the run), and says why at each step. Verdicts and
refusals are kept in the study for resumes, other workers and ``autoscale export``
(:class:`StoredPick`). User-facing detail: docs/search.md ("``auto`` is the bar", "A lead that
keeps the loss", "A lead that holds over the horizon").
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autoscale.search.budget import Ledger, format_duration, plural
from autoscale.search.candidates import AUTO, TORCH
from autoscale.search.no_harm import Check, OutOfTime, Verdict
from autoscale.search.objective import Lead, lead
from autoscale.search.timing import MARGIN, Timings
from autoscale.search.validate import Validated
from autoscale.training.scorecard import json_safe

__all__ = [
    "Choice",
    "choose",
    "StoredPick",
    "refusal",
    "family_refusal",
    "horizon_refusal",
    "loss_refusal",
    "stored_verdict",
    "verdict_key",
    "VERDICT_PREFIX",
    "record_pick",
    "stored_refusal",
    "unchecked_lines",
]

VERDICT_PREFIX = "no-harm-v2:"  # v2: the check's long runs include a drifting one
REFUSED_PREFIX = "refused:"  # why the search refused a lead, by candidate (study attributes)
CHECK_SHAPE = "no-harm-shape"  # the shape of the check the latest pick of the search ran


@dataclass
class Choice:
    """What :func:`choose` decided.

    Attributes:
        winner: The pick (None: ``auto`` was not validated on real steps, or nothing passed).
        why: The reason, in words.
        bar: ``auto``'s validation (None: not validated on real steps).
        leads: Key -> the lead over ``auto`` of each scaler ranked above it.
        refused: Key -> why a lead does not count.
        verdicts: The verdicts reached, in order (stored ones included).
        reused: Those of them read back from the study, not reached by this call.
        unchecked: (label, reason) of each scaler left unchecked.
    """

    winner: Validated | None
    why: str = ""
    bar: Validated | None = None
    leads: dict[str, Lead] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    verdicts: list[Verdict] = field(default_factory=list)
    reused: list[Verdict] = field(default_factory=list)
    unchecked: list[tuple[str, str]] = field(default_factory=list)


def verdict_key(key: Any, shape: str = "") -> str:
    """The study attribute of ``key``'s no-harm verdict by a check of ``shape`` (may be empty)."""
    return f"{VERDICT_PREFIX}{key}@{shape}" if shape else f"{VERDICT_PREFIX}{key}"


def record_pick(study: Any, choice: Choice, shape: str) -> None:
    """Keep in ``study`` what ``autoscale export`` cannot decide again from the rows: why each
    lead was refused (the horizon's replay needs the search's bench) and the check's shape."""
    attrs = study.user_attrs
    for key, why in choice.refused.items():
        if attrs.get(REFUSED_PREFIX + str(key)) != why:
            study.set_user_attr(REFUSED_PREFIX + str(key), why)
    if attrs.get(CHECK_SHAPE) != shape:
        study.set_user_attr(CHECK_SHAPE, shape)


def stored_refusal(attrs: dict[str, Any], key: Any) -> str | None:
    """Why the search refused ``key``'s lead (:func:`record_pick`), or None."""
    return attrs.get(REFUSED_PREFIX + str(key))


def stored_verdict(study: Any, key: Any, shape: str | None = None) -> Verdict | None:
    """The no-harm verdict the study holds for ``key`` (None: never checked, or it did not fit).

    ``shape``: only a verdict of a check of that shape (``""``: of a check without one); None:
    the verdict stored last, of any shape (``autoscale export``)."""
    attrs = study.user_attrs
    if shape is not None:
        data = attrs.get(verdict_key(key, shape))
    else:
        head = verdict_key(key)
        mine = [v for k, v in attrs.items() if k == head or k.startswith(head + "@")]
        data = max(mine, key=lambda v: v.get("stored_at", 0.0) if v else 0.0, default=None)
    if not data:
        return None
    return Verdict(
        **{k: data[k] for k in ("label", "passed", "reasons", "runs", "screened")},
        where=data.get("where", ""),
        shape=data.get("shape", ""),
    )


def choose(
    study: Any,
    ranked: list[Validated],
    factories: dict[str, Callable[[], Any]],
    no_harm: Check | None,
    timings: Timings | None,
    ledger: Ledger | None,
    *,
    weights: Any,
    stop_at: float,
    say: Callable[[str], None],
    refuse: Callable[[Validated], str | None] | None = None,
    replay_counts: bool = False,
    shape: str | None = None,
) -> Choice:
    """Walk ``ranked`` (best first) down to ``auto``: the first scaler whose lead over ``auto``
    clears the seed noise, is not refused and passes the no-harm check.

    Args:
        factories: Key -> a factory of fresh scalers of that validated scaler.
        no_harm: The check; None: only the verdicts the study holds count (``autoscale export``).
        weights: The reward weights of the objective.
        stop_at: ``time.monotonic()`` by which a real check must fit to start.
        refuse: Why the user may not get a scaler (None: they may).
        replay_counts: Replayed rows count (a search on records: replay is all there is).
        shape: Without ``no_harm``, the check shape whose stored verdicts count (None: latest).
    """
    choice = Choice(None)
    real = [v for v in ranked if v.real or replay_counts]
    replayed = [v.label for v in ranked if not (v.real or replay_counts)]
    if replayed:
        choice.unchecked.append((", ".join(replayed), "validated on replay only"))
    reference = next((v for v in real if v.key == TORCH), None)
    choice.bar = next((v for v in real if v.key == AUTO), None)
    if reference is None or choice.bar is None:
        on = "" if replay_counts else " on real steps"
        choice.why = f"auto could not be validated{on} in the budget"
        return choice
    bar = choice.bar
    for v in real:
        if v.key == AUTO:
            break
        choice.leads[v.key] = ld = lead(v.cards, bar.cards, reference.cards, weights)
        if not ld.clear:
            continue
        why = None if replay_counts else loss_refusal(v, bar)  # replay keeps the recorded loss
        why = why or (refuse(v) if refuse is not None else None)
        if why:
            choice.refused[v.key] = why
            continue
        if v.key == TORCH:  # the reference: no check
            choice.winner, choice.why = v, _beats(v, ld)
            return choice
        verdict = _verdict(
            study, v, factories, no_harm, timings, ledger, stop_at, say, choice, shape
        )
        if verdict is not None and verdict.passed:
            choice.winner, choice.why = v, _beats(v, ld) + " and passed the no-harm check"
            return choice
    lost = _why_auto(choice, real)
    verdict = _verdict(study, bar, factories, no_harm, timings, ledger, stop_at, say, choice, shape)
    if verdict is None or verdict.passed:
        choice.winner = bar
        checked = ""
        if verdict is None:
            checked = (
                " (its no-harm check did not fit in the time left)"
                if no_harm is not None
                else " (the study holds no no-harm verdict for it)"
            )
        choice.why = f"auto is the best found for this run: {lost}{checked}"
        return choice
    harms = f"auto harms this run ({'; '.join(verdict.reasons)})"
    choice.winner, choice.why = reference, f"{harms}: torch's own rule, the reference"
    return choice


def _why_auto(choice: Choice, real: list[Validated]) -> str:
    """Why nothing above ``auto`` in the ranking is the pick, in words."""
    best = next((k for k in choice.leads if k not in choice.refused), None)
    if best is None and choice.refused:
        key, why = next(iter(choice.refused.items()))
        return f"{_label(real, key)} led it beyond the seed noise, but {why}"
    if best is None:
        return "no candidate ranked above it on these episodes"
    if choice.leads[best].clear:
        return "no candidate that led it beyond the seed noise passed the no-harm check"
    ld = choice.leads[best]
    if not math.isfinite(ld.noise):  # one paired episode a member: no spread to measure
        return (
            f"the best ({_label(real, best)}) led it by {ld.lead:.4f} on "
            f"{plural(ld.episodes, 'held-out episode')}, one a member: too few to tell a lead "
            "from seed noise (a member needs two)"
        )
    return (
        f"the best ({_label(real, best)}) led it by {ld.lead:.4f}, within the seed noise "
        f"({ld.noise:.4f} on {ld.episodes} episodes)"
    )


def loss_refusal(v: Validated, bar: Validated) -> str | None:
    """Why a lead over ``auto`` does not count on the loss, or None: ``v``'s held-out eval loss,
    paired with ``auto``'s, is higher beyond the seed noise (as the ``auto`` build's bar judges
    it), or not finite where ``auto``'s is. The objective does not price the final loss."""
    from autoscale.training.bar import CONFIRM_Z, NOISE_FLOOR

    rel = []
    for member, mine in v.cards.items():
        for a, b in zip(mine, bar.cards.get(member) or []):
            if not math.isfinite(b.eval_loss) or b.eval_loss == 0.0:
                continue
            if not math.isfinite(a.eval_loss):
                return "its held-out eval loss is not finite where auto's is"
            rel.append((a.eval_loss - b.eval_loss) / abs(b.eval_loss))
    if not rel:
        return None
    diff = statistics.fmean(rel)
    err = statistics.stdev(rel) / math.sqrt(len(rel)) if len(rel) > 1 else math.inf
    noise = max(CONFIRM_Z * err, NOISE_FLOOR)
    if diff <= noise:
        return None
    return (
        f"its held-out eval loss is {100 * diff:.1f}% above auto's, beyond the seed noise "
        f"({100 * noise:.1f}% on {len(rel)} episodes)"
    )


def _label(rows: list[Validated], key: str) -> str:
    return next(v.label for v in rows if v.key == key)


def _beats(v: Validated, ld: Lead) -> str:
    return (
        f"{v.label} beat auto by {ld.lead:.4f} on the objective, more than the seed noise "
        f"({ld.noise:.4f} on {ld.episodes} held-out episodes)"
    )


def unchecked_lines(unchecked: list[tuple[str, str]]) -> list[str]:
    """The scalers a pick left unchecked (``(label, reason)`` each), one line per reason."""
    by_reason: dict[str, list[str]] = {}
    for label, why in unchecked:
        by_reason.setdefault(why, []).append(label)
    return [
        f"not checked: {'; '.join(labels)}" + (f" ({why})" if why else "")
        for why, labels in by_reason.items()
    ]


def _verdict(
    study: Any,
    v: Validated,
    factories: dict[str, Callable[[], Any]],
    no_harm: Check | None,
    timings: Timings | None,
    ledger: Ledger | None,
    stop_at: float,
    say: Callable[[str], None],
    choice: Choice,
    stored_shape: str | None = None,
) -> Verdict | None:
    """``v``'s verdict, stored or reached now; None where no check fits or none is stored."""
    shape = getattr(no_harm, "shape", "") if no_harm is not None else stored_shape
    verdict = stored_verdict(study, v.key, shape)
    fresh = verdict is None
    if verdict is None and no_harm is None:
        choice.unchecked.append((v.label, "the study holds no no-harm verdict for it"))
        return None
    if verdict is None:
        factory = factories[v.key]

        def fits() -> bool:  # what the check still needs (torch's runs not cached included)
            need = MARGIN * no_harm.cost(timings, 1)
            if time.monotonic() + need <= stop_at:
                return True
            choice.unchecked.append(
                (
                    v.label,
                    f"its no-harm check needs ~{format_duration(need)}, "
                    f"{format_duration(max(0.0, stop_at - time.monotonic()))} left",
                )
            )
            return False

        # the screen may run torch's uncached runs: it starts only where the whole check fits
        if not fits():
            return None
        try:
            verdict = no_harm.screen(factory, v.label, deadline=stop_at)
            if verdict.passed:
                if not fits():
                    return None
                verdict = no_harm.check(factory, v.label, deadline=stop_at)
        except OutOfTime as exc:  # a machine slower than planned: the check says nothing
            choice.unchecked.append((v.label, str(exc)))
            return None
        stored = {**verdict.to_dict(), "stored_at": time.time()}
        with ledger.track("bk:attrs"):
            study.set_user_attr(verdict_key(v.key, shape), json_safe(stored))
    choice.verdicts.append(verdict)
    if fresh:
        say(verdict.summary())
    else:
        choice.reused.append(verdict)
    return verdict


def horizon_refusal(
    bench: Any,
    factory: Callable[[], Any],
    bar: Callable[[], Any],
    replays: dict[Any, Any] | None = None,
) -> str | None:
    """Why a lead over ``auto`` on short real-step episodes does not count, or None: it must also
    hold, by ``LEAD_FLOOR``, on the replay of the same held-out runs at the plan's horizon.
    ``replays`` caches ``auto``'s replay per bench."""
    from autoscale.search.objective import LEAD_FLOOR

    mine = bench.objective("test", bench.run("test", factory)[0])
    replays = {} if replays is None else replays
    if id(bench) not in replays:  # the bench is kept beside its replay: its id stays its own
        replays[id(bench)] = (bench, bench.run("test", bar))
    cards, records = replays[id(bench)][1]
    theirs = bench.objective("test", cards)
    if theirs - mine > LEAD_FLOOR:
        return None
    steps = max(len(r) for r in records.values())
    return (
        f"its lead does not hold on the {steps}-step replay of the same held-out runs "
        f"(objective {mine:+.4f}, auto {theirs:+.4f})"
    )


def refusal(
    v: Validated,
    study: Any,
    families: tuple[str, ...] | None,
    bench: Any,
    factories: dict[str, Callable[[], Any]],
    replays: dict[Any, Any] | None = None,
) -> str | None:
    """Why the user may not get ``v`` (:func:`family_refusal`, :func:`horizon_refusal`), or None."""
    if v.key.is_policy:
        return None
    why = family_refusal(v, study, families)
    return why or horizon_refusal(bench, factories[v.key], factories[AUTO], replays)


def family_refusal(v: Validated, study: Any, families: tuple[str, ...] | None) -> str | None:
    """Why the user may not get ``v``'s family (a fixed scale not asked for), or None."""
    from autoscale.scalers.registry import rule_class

    if v.key.is_policy:
        return None
    trial = None if v.key.is_rule else study.trials[v.key.number]
    family = v.key.name if trial is None else trial.user_attrs.get("policy", {}).get("rule")
    cls = rule_class(family) if family else None
    if cls is not None and not cls.adapts and family not in (families or ()):
        return f"'{family}' cannot follow drifting gradients (ask for it with --family {family})"
    return None


@dataclass
class StoredPick:
    """What the search exports, decided from what a study holds (``autoscale export``).

    Attributes:
        choice: The pick (None: ``torch`` has no real-step validation: nothing is exported).
        rows: Key -> every scaler validated on real steps of every test episode.
        reference: ``torch``'s row (None: not validated).
        families: The rule families the study's plan searched (``torch`` included).
        weights: The reward weights of the objective.
    """

    choice: Choice | None
    rows: dict[str, Validated]
    reference: Validated | None
    families: tuple[str, ...]
    weights: Any

    @property
    def key(self) -> str | None:
        """What the search exports: its winner, ``auto`` where none won; None: nothing."""
        if self.choice is None:
            return None
        return AUTO if self.choice.winner is None else self.choice.winner.key

    def objections(self, study: Any, key: str) -> list[str]:
        """Why the search does not export ``key``, one reason a string (empty: it does)."""
        choice, v = self.choice, self.rows.get(key)
        if choice is None or self.reference is None:
            return ["torch has no real-step validation in the study: the search exports nothing"]
        if v is None:
            return ["it was not validated on real steps of the test instances"]
        if key == self.key:
            return []
        attrs = study.user_attrs
        why = stored_refusal(attrs, key) or family_refusal(v, study, self.families)
        out = [why] if why else []
        if choice.bar is not None and key != AUTO:
            bar, ref = choice.bar.cards, self.reference.cards
            ld = choice.leads.get(key) or lead(v.cards, bar, ref, self.weights)
            if not ld.clear and not math.isfinite(ld.noise):
                out.append(
                    f"its lead over auto ({ld.lead:+.4f}) is on one held-out episode a member, "
                    "too few to tell from seed noise"
                )
            elif not ld.clear:
                out.append(
                    f"it does not lead auto beyond the seed noise (lead {ld.lead:+.4f}, noise "
                    f"{ld.noise:.4f} on {ld.episodes} episodes)"
                )
        verdict = stored_verdict(study, key, attrs.get(CHECK_SHAPE))
        if key != TORCH and verdict is None:  # the reference is never checked
            out.append("the study holds no no-harm verdict for it")
        elif verdict is not None and not verdict.passed:
            out.append("it fails the no-harm check: " + "; ".join(verdict.reasons))
        return out or [f"the search ranks {choice.winner.label if choice.winner else 'auto'} first"]
