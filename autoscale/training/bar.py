"""The bar: what "no worse than torch" means, in one place.

A scaler is held against ``torch`` on the same workloads and seeds, by their scorecards
(:class:`~autoscale.training.scorecard.Scorecard`). Two forms, one set of definitions:

* :func:`acceptance`: on short held-out episodes (a suite member's test instances), the mean skip
  rate at most torch's + :data:`SKIP_POINTS`, precision loss lower than torch's where torch
  underflows (loses precision on more than :data:`UNDERFLOW` of the elements), and eval loss no
  worse than torch's beyond seed noise: on three episodes the spread of torch's (a screen), on
  more paired episodes the mean paired difference within :data:`CONFIRM_Z` standard errors;
* :func:`harm`: one long clean run against torch's on the same seed (the search's no-harm check
  and the long runs of the ``auto`` build, both through
  :func:`~autoscale.training.long_run.long_run_harm`): a divergence torch avoids, a skip rate
  more than torch's + :data:`SKIP_POINTS`, an eval loss above torch's by more than the seed
  noise, or (where it is measured) a share of gradient elements kept at fp16 precision more than
  :data:`SKIP_POINTS` below torch's: the share of those an fp32 backward of the same step leaves
  non-zero (:func:`~autoscale.training.long_run.kept_share`).

Seed noise is never below :data:`NOISE_FLOOR` of torch's eval loss.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "CONFIRM_Z",
    "NOISE_FLOOR",
    "SKIP_POINTS",
    "UNDERFLOW",
    "acceptance",
    "first_passing",
    "harm",
    "mean",
    "missed_on_loss_alone",
    "paired_difference",
    "seed_noise",
]

SKIP_POINTS = 0.005  # skip rate may exceed torch's by this much (half a percentage point)
UNDERFLOW = 0.01  # torch "underflows" where it loses precision on more than 1% of elements
CONFIRM_Z = 2.0  # a paired mean difference beyond 2 standard errors is more than seed noise
NOISE_FLOOR = 0.002  # seed noise is at least this share of torch's eval loss


def mean(cards: list, field: str) -> float:
    """Mean of a scorecard field over episodes (a non-finite precision loss counts as 1)."""
    values = [getattr(c, field) for c in cards]
    if field == "precision_loss":
        values = [v if math.isfinite(v) else 1.0 for v in values]
    return math.fsum(values) / len(values)


def paired_difference(mine: list, ref: list, field: str = "eval_loss") -> tuple[float, float]:
    """Mean and standard error of ``mine - ref`` over paired episodes (same instance and seed)."""
    diffs = [getattr(a, field) - getattr(b, field) for a, b in zip(mine, ref, strict=True)]
    if len(diffs) < 2:
        return math.fsum(diffs) / max(len(diffs), 1), math.inf
    return statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))


def seed_noise(evals: list[float]) -> float:
    """torch's seed noise from its eval losses on several seeds: the spread of the finite ones,
    at least :data:`NOISE_FLOOR` of their mean (0 where none is: :func:`harm` applies the floor
    of each seed's own loss). A seed whose eval loss overflowed tells nothing of the spread: as an
    inf it would forgive any loss, as a NaN refuse every one."""
    finite = [e for e in evals if math.isfinite(e)]
    if not finite:
        return 0.0
    return max(max(finite) - min(finite), NOISE_FLOOR * abs(statistics.mean(finite)))


def acceptance(mine: list, ref: list, paired: bool = False) -> dict[str, Any]:
    """The bar on held-out episodes: ``mine`` and ``ref`` (torch's) scorecards of the same
    episodes. ``paired``: judge eval loss by the paired difference (more episodes, where the
    three-episode screen could not tell it from noise), else by the spread of torch's.

    Returns ``{"skip", "loss", "precision", "met": bool, "values": {...}}``."""
    evals = [c.eval_loss for c in ref]
    floor = NOISE_FLOOR * abs(statistics.mean(evals))
    skip, skip_ref = mean(mine, "skip_rate"), mean(ref, "skip_rate")
    loss, loss_ref = mean(mine, "eval_loss"), mean(ref, "eval_loss")
    prec, prec_ref = mean(mine, "precision_loss"), mean(ref, "precision_loss")
    if not paired:
        noise = max(max(evals) - min(evals), floor)
        loss_ok = loss <= loss_ref + noise
        pair = None
    else:
        diff, err = paired_difference(mine, ref)
        noise = max(CONFIRM_Z * err, floor)
        loss_ok = math.isfinite(diff) and diff <= noise
        pair = {"mean_difference": diff, "standard_error": err, "episodes": len(mine)}
    row = {
        "skip": skip <= skip_ref + SKIP_POINTS,
        "loss": loss_ok,
        "precision": prec < prec_ref if prec_ref > UNDERFLOW else True,
        "values": {
            "skip_rate": skip, "torch_skip_rate": skip_ref, "eval_loss": loss,
            "torch_eval_loss": loss_ref, "noise": noise, "precision_loss": prec,
            "torch_precision_loss": prec_ref, "episodes": len(mine), "paired": pair,
        },
    }  # fmt: skip
    row["met"] = row["skip"] and row["loss"] and row["precision"]
    return row


def missed_on_loss_alone(row: dict[str, Any]) -> bool:
    """Whether a three-episode :func:`acceptance` row misses the bar by eval loss alone (the case
    more paired episodes settle)."""
    return row["skip"] and row["precision"] and not row["loss"] and row["values"]["paired"] is None


def harm(
    mine: Any,
    ref: Any,
    noise: float = 0.0,
    steps: int | None = None,
    kept: float | None = None,
    kept_ref: float | None = None,
) -> list[str]:
    """How one long clean run (scorecard ``mine``) is worse than torch's (``ref``) on the same
    seed; empty: no harm. ``noise``: torch's seed noise (see :func:`seed_noise`; at least
    :data:`NOISE_FLOOR` of ``ref``'s eval loss here); ``steps`` names the run's length in the
    reasons; ``kept``/``kept_ref``: shares of gradient elements kept at fp16 precision of those an
    fp32 backward leaves non-zero (:func:`~autoscale.training.long_run.kept_share`), where
    measured (the scorecard's precision loss cannot stand in: it cannot rank two scalers whose
    fp16 backward zeroes different numbers of elements)."""
    why = []
    if mine.diverged and not ref.diverged:
        why.append("training diverged (torch's did not)")
    if mine.skip_rate > ref.skip_rate + SKIP_POINTS:
        of = f" of {steps} steps" if steps else ""
        why.append(
            f"skipped {100 * mine.skip_rate:.2f}%{of}, torch {100 * ref.skip_rate:.2f}% "
            f"(+{100 * SKIP_POINTS:.1f} points allowed)"
        )
    tol = max(noise, NOISE_FLOOR * abs(ref.eval_loss))
    # NaN or inf: worse; where torch's own eval loss is not finite there is nothing to be worse than
    if math.isfinite(ref.eval_loss) and not mine.eval_loss <= ref.eval_loss + tol:
        why.append(
            f"final eval loss {mine.eval_loss:.5g}, torch {ref.eval_loss:.5g} (seed noise {tol:.2g})"
        )
    if kept is not None:
        bad_ref = kept_ref is None or not math.isfinite(kept_ref)
        if not math.isfinite(kept) or (not bad_ref and kept < kept_ref - SKIP_POINTS):
            ref_text = "n/a" if bad_ref else f"{100 * kept_ref:.2f}%"
            why.append(
                f"keeps {100 * kept:.2f}% of gradient elements at fp16 precision (of those an "
                f"fp32 backward leaves non-zero), torch {ref_text}"
            )
    return why


def first_passing(
    ranked: Iterable[str], stages: list[Callable[[str], list[str]]]
) -> tuple[str | None, dict[str, list[str]]]:
    """What ships: the first candidate, in ``ranked`` order, that passes every stage.

    Each stage maps a candidate to the reasons it fails (empty: passed); a candidate meets the
    stages in order and stops at the first it fails (the later ones cost real runs), and a
    candidate that fails is passed over, never argued with: the bar is a harm gate, not a
    contest. Returns the pick (None: none passed) and, for every candidate that met a stage,
    the reasons it collected (empty for the pick)."""
    reasons: dict[str, list[str]] = {}
    for candidate in ranked:
        reasons[candidate] = []
        for stage in stages:
            why = stage(candidate)
            if why:
                reasons[candidate] = list(why)
                break
        else:
            return candidate, reasons
    return None, reasons
