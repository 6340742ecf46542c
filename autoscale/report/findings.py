"""What a record shows, in plain words: each finding says what happened, with numbers, and what
to do about it. Only findings the record supports are made."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from autoscale.errors import ConfigError
from autoscale.report.replay import Outcome, RecordReplay

__all__ = ["SPIKE_BITS", "Finding", "findings", "loss_jumps"]

# a finite loss this many bits (256x) above the largest of the last SPIKE_MEMORY finite losses the
# scaler did not skip is a spike. A long memory: against the 16 before it, the preference members'
# losses jump up to 52 bits (a collapsed loss, then a pair ranked wrong); against 256, by at most
# 5.6 (experiments/results/spike_jump.md, spike_jump_memory256.md)
SPIKE_BITS, SPIKE_MEMORY = 8.0, 256


@dataclass(frozen=True)
class Finding:
    """One finding: a title, what the record shows, and what to do."""

    title: str
    detail: str
    advice: str


def _steps(idx: np.ndarray, most: int = 6) -> str:
    shown = ", ".join(str(int(i)) for i in idx[:most])
    return shown + (f" and {len(idx) - most} more" if len(idx) > most else "")


def _ends(idx: np.ndarray, n: int) -> str:
    """Where the last of the steps ``idx`` is the record's last: nothing after it is seen."""
    return f" (the last of them, step {n - 1}, ends the record)" if idx[-1] == n - 1 else ""


def findings(
    replay: RecordReplay, recorded: Outcome, outcomes: dict[str, Outcome]
) -> list[Finding]:
    """The findings of a record, most serious first."""
    if recorded.steps == 0:
        return []
    # the spikes first: the findings that advise auto point to them
    spikes = _dropped_spikes(replay, recorded, outcomes)
    found = [
        _nonfinite_losses(replay, recorded, spikes is not None),
        _at_minimum(recorded),
        spikes,
        _underflow(replay, recorded, outcomes, spikes is not None),
        _schedule_counted_skips(replay, recorded),
    ]
    return [f for f in found if f is not None] or [_nothing_to_fix(recorded)]


def loss_jumps(
    loss: np.ndarray, remembered: np.ndarray | None = None, memory: int = SPIKE_MEMORY
) -> np.ndarray:
    """Per step, log2 of its ``|loss|`` over the largest of the previous ``memory`` finite
    non-zero ones (NaN for a step whose loss is not such, or with none before it); with
    ``remembered`` (a mask), only the steps it marks enter that memory."""
    out = np.full(len(loss), np.nan)
    keep = np.ones(len(loss), dtype=bool) if remembered is None else np.asarray(remembered)
    seen: deque[float] = deque(maxlen=memory)  # log2 |loss| of the remembered steps
    for i, v in enumerate(np.abs(np.asarray(loss, dtype=np.float64)).tolist()):
        if not 0.0 < v < math.inf:
            continue
        bits = math.log2(v)
        if seen:
            out[i] = bits - max(seen)
        if keep[i]:
            seen.append(bits)
    return out


SPIKE_ADVICE = " (with the gradients clipped: the loss spikes above)"


def _times(bits: float) -> str:
    """A factor of ``2**bits``, readable: 837x, or 2^52x."""
    return f"{2.0**bits:,.0f}x" if bits < 20 else f"2^{bits:.0f}x"


def _dropped_spikes(
    replay: RecordReplay, recorded: Outcome, outcomes: dict[str, Outcome]
) -> Finding | None:
    """Finite loss spikes the recorded scaler's overflow dropped and ``auto`` (replayed) takes:
    taking a spike applies its update, which can diverge a run without gradient clipping
    (``experiments/results/spike_harm.md``), so a user switching to ``auto`` is told first. A
    spike is measured against the steps the scaler did not skip (a dropped spike does not hide
    the next one)."""
    t, skipped = replay.inst, recorded.skipped
    jumps = loss_jumps(t.scaler_loss, remembered=~skipped)
    with np.errstate(invalid="ignore"):
        idx = np.flatnonzero(skipped & ~t.nonfinite & (jumps > SPIKE_BITS))
    if not len(idx):
        return None
    auto = outcomes.get("auto")
    if auto is None:  # (a page of other scalers: the advice to use auto still comes)
        try:
            auto = replay.replay("auto")
        except ConfigError:
            return None
    taken = int((~auto.skipped[idx]).sum())
    if not taken:
        return None
    low, high = _times(float(jumps[idx].min())), _times(float(jumps[idx].max()))
    # auto whose guard skips spikes (amax-loss's spike_bits), replayed on the same steps
    dropped = int(replay.replay("auto", spike_bits=SPIKE_BITS).skipped[idx].sum())
    skip = (
        f', or let auto\'s guard skip such spikes: autoscale.get_scaler("auto", '
        f"spike_bits={SPIKE_BITS:g}) skips {dropped} of these {len(idx)} in the replay"
        if dropped
        else ""
    )
    return Finding(
        "Loss spikes: this scaler dropped them, auto would take them",
        f"{len(idx)} of the {int(skipped.sum())} skipped steps (steps {_steps(idx)}) had a finite "
        f"loss {low if low == high else f'{low} to {high}'} the largest of the {SPIKE_MEMORY} "
        "losses before it that the scaler did not skip: their gradients overflowed at its "
        f"scale, so it dropped them as a side effect. Replayed, auto takes {taken} of them, each "
        "at a lower scale of its own, as fp32 or bf16 training would. (A preference/DPO-style "
        "loss jumps so on the pairs it ranks wrong, which are what it learns from.)",
        "A step taken applies its gradient, which grows with its loss: with plain SGD and no "
        "gradient clipping a few such steps can diverge a run (Adam-style updates are bounded "
        "and suffer far less). Before switching to auto, clip the "
        "unscaled gradients (scaler.unscale_(optimizer), then "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))"
        f"{skip}, or find the batches (the step numbers above).",
    )


def _nonfinite_losses(
    replay: RecordReplay, recorded: Outcome, spikes: bool = False
) -> Finding | None:
    """Steps skipped for a non-finite loss, which no scale saves, and what the scaler did after
    them (``spikes``: its advice to use ``auto`` points to the loss-spike finding). One count of
    skipped steps everywhere (the table's): what happened after a step is seen on the next one,
    so the record's last step, when skipped, is counted and said to be last."""
    n, skipped = recorded.steps, recorded.skipped
    n_skipped = int(skipped.sum())
    nf = np.flatnonzero(replay.inst.nonfinite & skipped)
    if not len(nf):
        return None
    at_min = recorded.scales <= recorded.min_scale  # min_scale 0: unknown, never true
    pinned = int(at_min[nf].sum())
    followed = nf[nf + 1 < n]
    lowered = int((recorded.scales[followed + 1] < recorded.scales[followed]).sum())
    last = _ends(nf, n)
    which = "All" if len(nf) == n_skipped else f"{len(nf)} of the"
    detail = (
        f"{which} {n_skipped} skipped steps ({100 * len(nf) / n:.1f}% of {n}) had a "
        f"non-finite loss (steps {_steps(nf)}): the forward pass overflowed or the batch was "
        "bad before any scaling, and no loss scale fixes such a step."
    )
    if not len(followed):
        detail += f" The record ends at step {n - 1}: what the scaler did after it is not seen"
    elif lowered == 0:
        detail += (
            f" The scaler kept its scale after each of them{last}, which is right: a lower "
            "scale saves none of them and loses precision on the steps that follow"
        )
    else:
        which = "every one" if lowered == len(followed) else str(lowered)
        detail += (
            f" Yet the scaler lowered its scale after {which} of them{last}, losing precision "
            "on the steps that followed for nothing"
        )
    detail += f"; {pinned} of them came at its minimum scale." if pinned else "."
    advice = (
        "Find the batches (the step numbers above) or the layer that overflows in the "
        "forward pass; bf16 autocast has fp32's range and avoids it where the device "
        "supports it (torch.cuda.is_bf16_supported())."
    )
    if lowered:
        advice += (
            " Meanwhile a rule that does not lower its scale for a non-finite loss keeps "
            "the gradients' precision (auto lowers only such a step's own scale): "
            "autoscale wrap --scaler auto -- <your command>"
            + (SPIKE_ADVICE if spikes else "")
            + "."
        )
    return Finding("Non-finite losses: no loss scale fixes these", detail, advice)


def _at_minimum(recorded: Outcome) -> Finding | None:
    """Steps at the scaler's minimum scale, where DeepSpeed and Megatron stop a run."""
    if not recorded.at_min:
        return None
    return Finding(
        "The scale sat at its minimum",
        f"{recorded.at_min} of {recorded.steps} steps ran at the scaler's minimum scale "
        f"({recorded.min_scale:g}); DeepSpeed and Megatron stop the run there "
        '("Current loss scale already at minimum").',
        "See the non-finite losses above, if any; otherwise the gradients overflow at "
        "every scale: check the loss and the learning rate.",
    )


def _underflow(
    replay: RecordReplay, recorded: Outcome, outcomes: dict[str, Outcome], spikes: bool = False
) -> Finding | None:
    """Gradients below fp16's range after scaling, where a share of them was, and the rule
    that would have lost fewest on the replay (``spikes``: the loss-spike finding came first,
    and the advice to use ``auto`` points to it)."""
    t, prec = replay.inst, recorded.precision_loss
    if not (math.isfinite(prec) and prec > 0.005):
        return None
    headroom = t.threshold - np.log2(np.maximum(t.scale, 1e-300))
    clean = ~recorded.skipped & np.isfinite(headroom)
    median_room = float(np.median(headroom[clean])) if clean.any() else math.nan
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
    return Finding(
        "Gradients lost to underflow",
        f"On average {100 * prec:.2f}% of the non-zero gradient elements fell below "
        f"fp16's normal range (2^-14) after scaling, and lost precision or became 0.{room}{better}",
        "Use a scaler that keeps the scale near the overflow threshold: "
        "autoscale wrap --scaler auto -- <your command>" + (SPIKE_ADVICE if spikes else "") + ".",
    )


def _schedule_counted_skips(replay: RecordReplay, recorded: Outcome) -> Finding | None:
    """A learning-rate schedule that moved on steps the optimizer did not take."""
    n, skipped = recorded.steps, recorded.skipped
    lr = np.asarray(replay.record.column("lr"), dtype=np.float64)
    if not (np.isfinite(lr).all() and n > 2):
        return None
    moved = np.diff(lr) != 0  # moved[i]: the rate changed between step i and step i + 1
    sk = np.flatnonzero(skipped)
    followed = sk[sk + 1 < n]
    counted = int(moved[followed].sum())
    clean_moves = moved[~skipped[:-1]]
    if not (counted and clean_moves.mean() > 0.5):
        return None
    return Finding(
        "The learning-rate schedule counted skipped steps",
        f"The learning rate moved after {counted} of the {int(skipped.sum())} skipped steps, "
        f"steps the optimizer did not take{_ends(sk, n)}, so the schedule ran ahead "
        "of training.",
        "Step the scheduler only when the step was taken: "
        "if not scaler.step_was_skipped: scheduler.step() (every autoscale scaler has "
        "step_was_skipped; the Hugging Face Trainer and Lightning check it themselves "
        "only in some versions).",
    )


def _nothing_to_fix(recorded: Outcome) -> Finding:
    n, prec, n_skipped = recorded.steps, recorded.precision_loss, int(recorded.skipped.sum())
    return Finding(
        "Nothing to fix in this run",
        f"{n_skipped} of {n} steps skipped, "
        f"{100 * prec:.2f}% of gradient elements below fp16's range on average."
        if math.isfinite(prec)
        else f"{n_skipped} of {n} steps skipped.",
        "The scaler this run used did its job here.",
    )
