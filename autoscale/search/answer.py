"""The search's answer in words (:func:`answer_lines`): what was exported, why, and how it compares
with ``torch`` and ``auto`` on the user's held-out steps; the same facts go into the manifest
(:func:`evidence`).
"""

from __future__ import annotations

from typing import Any

from autoscale.search.budget import percent, plural
from autoscale.search.candidates import AUTO, TORCH
from autoscale.search.choose import Choice
from autoscale.search.validate import Validated
from autoscale.training.bar import mean

__all__ = ["answer_lines", "evidence"]


def _row(v: Validated, reference: Validated, weights: Any) -> dict[str, float]:
    cards = v.all_cards()
    return {
        "objective": v.objective(reference, weights),
        "skip_rate": mean(cards, "skip_rate"),
        "precision_loss": mean(cards, "precision_loss"),
        "eval_loss": mean(cards, "eval_loss"),
    }


def evidence(
    choice: Choice, chosen: Validated, reference: Validated, weights: Any
) -> dict[str, Any]:
    """The manifest's record of the pick: why, the held-out rows and every lead weighed."""
    rows = {
        "exported": _row(chosen, reference, weights),
        "torch": _row(reference, reference, weights),
    }
    if choice.bar is not None:
        rows["auto"] = _row(choice.bar, reference, weights)
    return {
        "why": choice.why,
        "bar": AUTO.name,
        "held_out": rows,
        "leads_over_auto": {
            k: {"lead": ld.lead, "noise": ld.noise, "episodes": ld.episodes, "clear": ld.clear}
            for k, ld in choice.leads.items()
        },
        "refused": dict(choice.refused),
    }


def answer_lines(
    name: str,
    how: str,
    choice: Choice,
    chosen: Validated,
    reference: Validated,
    weights: Any,
    steps: int,
) -> list[str]:
    """The last lines of a search: the export, why, and the pick against ``torch`` and ``auto``."""
    n = sum(len(c) for c in chosen.cards.values())
    lines = [f"answer: exported '{name}' = {how}", f"why: {choice.why}"]
    rows = [("exported", chosen)]
    if chosen.key != TORCH:
        rows.append(("torch", reference))
    if choice.bar is not None and chosen.key != AUTO:
        rows.append(("auto", choice.bar))
    if chosen.key in (TORCH, AUTO):
        rows[0] = (f"exported ({chosen.key.name})", chosen)
    parts = []
    for label, v in rows:
        r = _row(v, reference, weights)
        parts.append(
            f"{label}: skipped {percent(r['skip_rate'])}, precision loss "
            f"{percent(r['precision_loss'])}, eval loss {r['eval_loss']:.4g}, objective "
            f"{r['objective']:+.4f}"
        )
    lines.append(
        f"on your {plural(n, 'held-out episode')} of {steps} real steps: " + "; ".join(parts)
    )
    return lines
