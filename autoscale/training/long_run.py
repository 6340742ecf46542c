"""Long runs, measured and judged against ``torch``: the one long-run harm check.

A policy is used for whole runs, so both places that judge one by long real runs take their steps
here and judge them by one rule: the search's no-harm check before an export
(:class:`~autoscale.search.no_harm.NoHarmCheck`, 1000 steps) and the ``auto`` build's long runs
(:func:`~autoscale.selection.suite_eval.long_runs`, 2000 steps).

* :func:`measured_run`: the steps of one run, with the precision they kept measured against an
  fp32 reference backward on one applied step in every :data:`REFERENCE_EVERY`
  (:func:`reference_live`);
* :func:`kept_share`: the share of gradient elements a run kept at fp16 precision (what the
  bar's precision clause reads);
* :func:`long_run_harm`: how a run is worse than ``torch``'s on the same seed
  (:func:`~autoscale.training.bar.harm` on those shares).

Why a reference backward: the scorecard's precision loss has the elements that are non-zero
*after* the fp16 backward as its denominator, so a scale that flushes gradients to zero, whole
steps of them, looks more precise by it; the share of the elements an fp32 backward of the same
step leaves non-zero that reach the optimizer at fp16 precision falls instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from autoscale.training import bar

__all__ = [
    "MEASURE",
    "REFERENCE_EVERY",
    "kept_share",
    "long_run_harm",
    "measured_run",
    "reference_live",
    "structural_share",
]

REFERENCE_EVERY = 10  # a long run compares one step in 10 with an fp32 backward of it
# The precision measure's name and version: what a verdict or a stored run was judged by (a change
# to what kept_share means bumps it, so nothing judged by the old one is reused).
MEASURE = "kept-fp32-v1"


def measured_run(
    run: Any,
    steps: int,
    *,
    reference: bool = True,
    progress: bool = False,
    callback: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """Take ``steps`` steps of ``run`` (a :class:`~autoscale.training.TrainingRun`) and measure
    them: ``{"card", "records", "kept", "structural", "nonzero"}``, the scorecard and step
    records of the steps taken, and per step:

    ``kept``: on one applied step in every :data:`REFERENCE_EVERY` (the first of each window
    that is not skipped and whose fp32 gradient is not all zero), the share of the gradient
    elements that an fp32 backward of that step leaves non-zero (at the step's weights, on its
    batch, without autocast: :func:`reference_live`) which reach the optimizer non-zero at fp16
    normal precision (``|g| * S >= 2^-14``); NaN on skipped and unsampled steps. Unlike the
    scorecard's precision loss, whose denominator is the elements that are non-zero *after* the
    fp16 backward, it falls when a low scale flushes gradients to zero. Unlike a share of *all*
    elements, it does not count the elements that are zero in exact arithmetic too (a ReLU off
    for the whole batch, an embedding row no token used): their number is the model's, and two
    runs that drifted apart have different numbers of them (``structural`` is that share, per
    sampled step, shown and not judged). ``nonzero`` is, per step, the number of non-zero
    gradient elements (-1 on skipped steps).

    ``reference=False`` takes no reference backward (``kept`` and ``structural`` are then all
    NaN): for runs drawn, not judged. ``progress`` shows a bar; ``callback`` is called with each
    step's record, and returning ``False`` stops the run there (the card then has fewer steps).
    """
    params = [p for p in run.model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    out: dict[str, Any] = {"kept": [], "structural": [], "nonzero": []}
    first = len(run.records)
    done = -1  # the last window with a sample
    # the reference of a step is taken just before it: of the first here, of each next one after
    # the step before it (where the run stands between steps, as before its first)
    live = reference_live(run, params) if reference else None

    def after(rec: Any) -> bool | None:
        nonlocal done, live
        index = len(out["kept"])
        kept, structural, nonzero, sampled = _measure(rec, params, live, numel)
        out["kept"].append(kept)
        out["structural"].append(structural)
        out["nonzero"].append(nonzero)
        if sampled:
            done = index // REFERENCE_EVERY
        if callback is not None and callback(rec) is False:
            return False
        # one per window: a skipped step, or one whose exact gradient is all zero, passes the
        # window's sample to the next step
        due = reference and index + 1 < steps and (index + 1) // REFERENCE_EVERY > done
        live = reference_live(run, params) if due else None
        return None

    out["card"] = run.run(steps, progress=progress, callback=after)
    out["records"] = list(run.records[first:])
    return out


def _measure(rec: Any, params: list, live: list | None, numel: int) -> tuple:
    """(kept, structural, nonzero, sampled) of the step just taken (see :func:`measured_run`)."""
    if rec.found_inf or not math.isfinite(rec.precision_loss):
        return math.nan, math.nan, -1, False
    grads = [p.grad for p in params if p.grad is not None]
    nonzero = sum(int(g.count_nonzero()) for g in grads)
    if live is None:
        return math.nan, math.nan, nonzero, False
    n_live = sum(int(m.sum()) for m in live)
    structural = 1.0 - n_live / numel
    if not n_live:
        return math.nan, structural, nonzero, False
    reached = sum(
        int((p.grad[m] != 0).sum()) for p, m in zip(params, live, strict=True) if p.grad is not None
    )
    return reached * (1.0 - rec.precision_loss) / n_live, structural, nonzero, True


def reference_live(run: Any, params: list) -> list:
    """Per parameter of ``params``: where an fp32 backward of ``run``'s next step (its weights,
    its batch and loss weight, every micro-batch, no autocast) leaves the gradient finite and
    non-zero. The run is returned to where it was, so the step it then takes is the one it would
    have taken:

    - the step's batches are drawn first (and kept by the stream, as it keeps every batch), so a
      stream that draws from torch's global generator draws as the step would with one
      micro-batch (with more, its draws and the forwards' random numbers interleave differently);
    - the step's first forward runs as the step runs it (:meth:`TrainingRun.peek_loss`: fp16
      autocast, the emulation), so a scenario that samples at the step, as rl-finetune samples a
      rollout at each round's first step, samples what the step will train on, and the fp32
      backward reuses it (further micro-batches sample without autocast);
    - weights, optimizer, scaler, random generators, stream cursor, scenario state and step
      records come back with :meth:`TrainingRun.restore`, every parameter's ``.grad`` as it was.
    """
    import torch

    accum = run.spec.grad_accum
    cursor = run.data.state_dict()
    for _ in range(accum):
        run.data.next_batch()
    run.data.load_state_dict(cursor)
    grads = [(p, p.grad) for p in run.model.parameters()]
    snap = run.snapshot()
    try:
        run.peek_loss()
        run.data.load_state_dict(snap.data)
        run.model.zero_grad(set_to_none=True)
        weight = run.scenario.loss_weight(run.step_index) / accum
        for micro in range(accum):
            batch = run.data.next_batch()
            objective = run.scenario.objective(run.data, run.model, batch, run.step_index, micro)
            (objective.float() * weight).backward()
        return [
            (p.grad != 0) & p.grad.isfinite()
            if p.grad is not None
            else torch.zeros_like(p, dtype=torch.bool)
            for p in params
        ]
    finally:
        run.restore(snap)
        for p, g in grads:
            p.grad = g


def kept_share(run: dict[str, Any]) -> float:
    """Mean over its sampled applied steps of a :func:`measured_run` run's ``kept`` share (NaN if
    none)."""
    vals = [k for k in run["kept"] if math.isfinite(k)]
    return math.fsum(vals) / len(vals) if vals else math.nan


def structural_share(run: dict[str, Any]) -> float:
    """Mean over its sampled applied steps of a :func:`measured_run` run's ``structural`` share
    (the gradient elements an fp32 backward leaves zero too; NaN if none or not measured)."""
    vals = [k for k in run.get("structural", []) if math.isfinite(k)]
    return math.fsum(vals) / len(vals) if vals else math.nan


def long_run_harm(
    mine: dict[str, Any], ref: dict[str, Any], noise: float = 0.0, steps: int | None = None
) -> list[str]:
    """How the long run ``mine`` is worse than ``torch``'s run ``ref`` on the same seed (both
    :func:`measured_run` results, or ``{"card", "kept"}``); empty: no harm. The bar's
    :func:`~autoscale.training.bar.harm`: a divergence torch avoids, a skip rate more than
    torch's + 0.5 points, an eval loss above torch's by more than ``noise`` (torch's seed noise,
    at least 0.2% of its eval loss), or a :func:`kept_share` more than 0.5 points below torch's
    (where neither run has a sampled step there is no evidence either way, and precision is not
    judged). ``steps`` names the run's length in the reasons."""
    kept, kept_ref = kept_share(mine), kept_share(ref)
    if math.isnan(kept) and math.isnan(kept_ref):
        return bar.harm(mine["card"], ref["card"], noise, steps)
    return bar.harm(mine["card"], ref["card"], noise, steps, kept, kept_ref)
