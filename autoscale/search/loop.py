"""The trial loop: ask, run, tell, until a deadline, a trial count or a bookkeeping cap."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from autoscale.search.budget import Ledger
from autoscale.search.interrupts import deferred_interrupt
from autoscale.search.study import fail_worker_trials

__all__ = ["TrialLoop"]

_OUTCOMES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}


class TrialLoop:
    """Runs trials of one study for one worker.

    A trial that raises is failed (its error kept as a user attribute) and the loop goes on; a
    pruned one is told so. Ctrl-C leaves no trial RUNNING: ask and tell run under
    :func:`~autoscale.search.interrupts.deferred_interrupt` (a SIGINT inside them comes out
    after them), an interrupt in the objective fails the trial, and on the way out any trial of
    this worker still running is failed; then the ``KeyboardInterrupt`` propagates. Time outside the objective's own ledger accounting and the sampler's and pruner's
    (``alg:``): ask, tell, storing suggestions and reports, goes to the ledger as ``bk:optuna``.

    Args:
        counts: ``complete``/``pruned``/``failed`` counters, updated in place.
        n_trials: Stop once this worker has run this many trials in all.
        bookkeeping_cap_s: Stop once the ledger's bookkeeping passes this many seconds (after
            ``min_trials``).
    """

    def __init__(
        self,
        study: Any,
        ledger: Ledger,
        *,
        worker: str,
        warn: Callable[[str], None],
        counts: dict[str, int],
        n_trials: int | None = None,
        bookkeeping_cap_s: float = float("inf"),
        min_trials: int = 0,
        progress: bool = False,
    ) -> None:
        self.study, self.ledger, self.worker, self.warn = study, ledger, worker, warn
        self.counts, self.n_trials = counts, n_trials
        self.cap_s, self.min_trials, self.progress = bookkeeping_cap_s, min_trials, progress

    def run(self, objective_fn: Callable[[Any], float], stop_at: float) -> None:
        """Run trials until ``stop_at`` (``time.monotonic()``), ``n_trials`` or the bookkeeping
        cap."""
        ran = 0
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=round(max(0.0, stop_at - time.monotonic()), 1),
                desc="search",
                unit="s",
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}",
            )
        t_start = time.monotonic()
        try:
            while time.monotonic() < stop_at:
                if self.n_trials is not None and sum(self.counts.values()) >= self.n_trials:
                    break
                if ran >= self.min_trials and self.ledger.total("bk:") > self.cap_s:
                    break
                t0 = time.perf_counter()
                inside = self.ledger.total("")
                self._one(objective_fn)
                ran += 1
                tracked = self.ledger.total("") - inside
                self.ledger.add("bk:optuna", max(0.0, time.perf_counter() - t0 - tracked))
                if bar is not None:
                    bar.n = round(min(time.monotonic() - t_start, bar.total), 1)
                    bar.set_postfix_str(f"trials {ran}", refresh=False)
                    bar.refresh()
        except KeyboardInterrupt:
            with deferred_interrupt():  # what _one could not tell (its tell raised)
                fail_worker_trials(self.study, self.worker)
            raise
        finally:
            if bar is not None:
                bar.close()

    def _one(self, objective_fn: Callable[[Any], float]) -> None:
        from optuna.trial import TrialState

        # ask and tell are atomic for Ctrl-C: a SIGINT inside them comes out after them, when
        # the trial is in hand (or told), so none is left RUNNING
        trial = None
        try:
            with deferred_interrupt():
                trial = self.study.ask()
                trial.set_user_attr("worker", self.worker)
            value, state, error = self._objective(objective_fn, trial)
        except KeyboardInterrupt:
            if trial is not None:
                with deferred_interrupt(), contextlib.suppress(Exception):  # else run() sweeps
                    self._fail(trial, "KeyboardInterrupt: interrupted")
            raise
        with deferred_interrupt():
            if state == TrialState.FAIL:
                self._fail(trial, error)
            elif state == TrialState.PRUNED:
                self.study.tell(trial, state=state)
            else:
                self.study.tell(trial, value)
            self.counts[_OUTCOMES[state.name]] += 1

    def _objective(
        self, objective_fn: Callable[[Any], float], trial: Any
    ) -> tuple[float | None, Any, str]:
        """Run the objective: its value, the state to tell, and the error of a failed trial."""
        import optuna
        from optuna.trial import TrialState

        try:
            return objective_fn(trial), TrialState.COMPLETE, ""
        except optuna.TrialPruned:
            return None, TrialState.PRUNED, ""
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.warn(f"trial {trial.number} failed: {error}")
            return None, TrialState.FAIL, error

    def _fail(self, trial: Any, error: str) -> None:
        """Tell ``trial`` failed, keeping ``error`` as a user attribute when the storage takes it."""
        from optuna.trial import TrialState

        with contextlib.suppress(Exception):
            trial.set_user_attr("error", error[:1000])
        self.study.tell(trial, state=TrialState.FAIL)
