"""What a record shows, in plain words: each finding says what happened, with numbers, and what
to do about it. Only findings the record supports are made."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autoscale.report.replay import Outcome, RecordReplay

__all__ = ["Finding", "findings"]


@dataclass(frozen=True)
class Finding:
    """One finding: a title, what the record shows, and what to do."""

    title: str
    detail: str
    advice: str


def _steps(idx: np.ndarray, most: int = 6) -> str:
    shown = ", ".join(str(int(i)) for i in idx[:most])
    return shown + (f" and {len(idx) - most} more" if len(idx) > most else "")


def findings(
    replay: RecordReplay, recorded: Outcome, outcomes: dict[str, Outcome]
) -> list[Finding]:
    """The findings of a record, most serious first."""
    out: list[Finding] = []
    rec = replay.record
    n = recorded.steps
    if n == 0:
        return out
    t = replay.inst
    skipped = recorded.skipped
    nonfinite = t.nonfinite
    nf = np.flatnonzero(nonfinite)
    if len(nf):
        at_min = recorded.scales <= recorded.min_scale  # min_scale 0: unknown, never true
        pinned = int((at_min & nonfinite).sum())
        lowered = sum(1 for i in nf if i + 1 < n and recorded.scales[i + 1] < recorded.scales[i])
        detail = (
            f"{len(nf)} of {n} steps ({100 * len(nf) / n:.1f}%) had a non-finite loss (steps "
            f"{_steps(nf)}): the forward pass overflowed or the batch was bad before any scaling. "
            f"No loss scale fixes such a step, yet the scaler lowered the scale after {lowered} of them"
        )
        detail += f", and {pinned} of them came at its minimum scale." if pinned else "."
        out.append(
            Finding(
                "Non-finite losses: no loss scale fixes these",
                detail,
                "Find the batches (the step numbers above) or the layer that overflows in the "
                "forward pass; bf16 autocast has fp32's range and avoids it where the device "
                "supports it (torch.cuda.is_bf16_supported()). A rule that ignores non-finite "
                "losses (auto guards each step's loss) keeps the scale up meanwhile.",
            )
        )
    if recorded.at_min:
        out.append(
            Finding(
                "The scale sat at its minimum",
                f"{recorded.at_min} of {n} steps ran at the scaler's minimum scale "
                f"({recorded.min_scale:g}); DeepSpeed and Megatron stop the run there "
                '("Current loss scale already at minimum").',
                "See the non-finite losses above, if any; otherwise the gradients overflow at "
                "every scale: check the loss and the learning rate.",
            )
        )
    prec = recorded.precision_loss
    headroom = t.threshold - np.log2(np.maximum(t.scale, 1e-300))
    clean = ~skipped & np.isfinite(headroom)
    median_room = float(np.median(headroom[clean])) if clean.any() else math.nan
    if math.isfinite(prec) and prec > 0.005:
        best = min(
            (o for o in outcomes.values() if math.isfinite(o.precision_loss)),
            key=lambda o: o.precision_loss,
            default=None,
        )
        better = (
            f" Replayed, {best.name} would have lost {100 * best.precision_loss:.2f}% "
            f"(skipping {100 * best.skip_rate:.2f}% of steps)."
            if best is not None and best.precision_loss < prec
            else ""
        )
        room = (
            f" On the median step the scale sat {median_room:.1f} bits below its overflow "
            "threshold: a higher scale would have kept them."
            if math.isfinite(median_room) and median_room >= 1
            else ""
        )
        out.append(
            Finding(
                "Gradients lost to underflow",
                f"On average {100 * prec:.2f}% of the non-zero gradient elements fell below "
                f"fp16's normal range (2^-14) after scaling, and lost precision or became 0.{room}{better}",
                "Use a scaler that keeps the scale near the overflow threshold: "
                "autoscale wrap --scaler auto -- <your command>.",
            )
        )
    lr = np.asarray(rec.column("lr"), dtype=np.float64)
    if np.isfinite(lr).all() and n > 2:
        moved = np.diff(lr) != 0
        sk = np.flatnonzero(skipped[:-1])
        counted = int(moved[sk].sum()) if len(sk) else 0
        clean_moves = moved[~skipped[:-1]]
        if counted and clean_moves.mean() > 0.5:
            out.append(
                Finding(
                    "The learning-rate schedule counted skipped steps",
                    f"The learning rate moved after {counted} of the {len(sk)} skipped steps "
                    "(steps the optimizer did not take), so the schedule ran ahead of training.",
                    "Step the scheduler only when the step was taken: "
                    "if not scaler.step_was_skipped: scheduler.step() (every autoscale scaler has "
                    "step_was_skipped; the Hugging Face Trainer and Lightning check it themselves "
                    "only in some versions).",
                )
            )
    if not out:
        out.append(
            Finding(
                "Nothing to fix in this run",
                f"{int(skipped.sum())} of {n} steps skipped, "
                f"{100 * prec:.2f}% of gradient elements below fp16's range on average."
                if math.isfinite(prec)
                else f"{int(skipped.sum())} of {n} steps skipped.",
                "The scaler this run used did its job here.",
            )
        )
    return out
