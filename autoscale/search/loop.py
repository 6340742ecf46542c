"""The trial loop (:class:`TrialLoop`): Optuna's ``study.optimize`` until a deadline or this
worker's trial count, safe to Ctrl-C. ``optimize`` runs under
:func:`~autoscale.search.interrupts.deferred_interrupt` and only the objective (and the end of each
trial's callback) is :func:`~autoscale.search.interrupts.interruptible`, so a Ctrl-C never lands
inside Optuna's ask or tell and leaves no trial RUNNING.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from autoscale.processes import raise_if_interrupted
from autoscale.search.budget import OUTCOMES, Ledger
from autoscale.search.interrupts import deferred_interrupt, interruptible
from autoscale.search.storage import lost_connection

__all__ = ["TrialLoop"]


class TrialLoop:
    """Runs trials of one study for one worker.

    Args:
        counts: ``complete``/``pruned``/``failed`` counters, updated in place.
        n_trials: Stop once this worker has run this many trials in all.
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
        progress: bool = False,
    ) -> None:
        self.study, self.ledger, self.worker, self.warn = study, ledger, worker, warn
        self.counts, self.n_trials, self.progress = counts, n_trials, progress

    def _bar(self, seconds: float) -> Any:
        """The seconds' progress bar, where progress is drawn; else None."""
        if not self.progress:
            return None
        from autoscale.progress import progress_bar

        return progress_bar(
            round(seconds, 1),
            desc="search",
            unit="s",
            bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}",
        )

    def run(self, objective_fn: Callable[[Any], float], stop_at: float) -> None:
        """Run trials until ``stop_at`` (``time.monotonic()``) or ``n_trials``."""
        import optuna

        from autoscale.search.study import fail_worker_trials

        left = None if self.n_trials is None else self.n_trials - sum(self.counts.values())
        timeout = stop_at - time.monotonic()
        if timeout <= 0 or (left is not None and left <= 0):
            return
        bar = self._bar(timeout)
        t_start = time.monotonic()
        # what is left of optimize's wall time after objectives and sampler/pruner is bk:optuna
        inside, alg_inside = [0.0], [0.0]

        def objective(trial: Any) -> float:
            trial.set_user_attr("worker", self.worker)
            t0, alg0 = time.perf_counter(), self.ledger.total("alg:")
            try:
                with interruptible():
                    value = objective_fn(trial)
                    raise_if_interrupted()  # a Ctrl-C dropped inside it (in a __del__, say)
                    return value
            except optuna.TrialPruned:
                raise
            except KeyboardInterrupt:
                trial.set_user_attr("error", "KeyboardInterrupt: interrupted")
                raise
            except Exception as exc:
                if lost_connection(exc) is not None:
                    raise  # the storage is gone: the command says so once, not per trial
                error = f"{type(exc).__name__}: {exc}"
                self.warn(f"trial {trial.number} failed: {error}")
                trial.set_user_attr("error", error[:1000])
                raise
            finally:
                inside[0] += time.perf_counter() - t0
                alg_inside[0] += self.ledger.total("alg:") - alg0

        def after(study: Any, frozen: Any) -> None:
            outcome = OUTCOMES.get(frozen.state.name)
            if outcome:
                self.counts[outcome] += 1
            if bar is not None:
                bar.n = round(min(time.monotonic() - t_start, bar.total), 1)
                bar.set_postfix_str(f"trials {sum(self.counts.values())}", refresh=False)
                bar.refresh()
            with interruptible():  # a Ctrl-C held through the tell: out now, before the next ask
                raise_if_interrupted()

        t0, alg0 = time.perf_counter(), self.ledger.total("alg:")
        try:
            with deferred_interrupt():
                try:
                    self.study.optimize(
                        objective,
                        n_trials=left,
                        timeout=stop_at - time.monotonic(),
                        catch=(Exception,),
                        callbacks=[after],
                        gc_after_trial=False,
                    )
                except KeyboardInterrupt:
                    fail_worker_trials(self.study, self.worker)  # what Optuna could not tell
                    raise
        finally:
            alg_outside = self.ledger.total("alg:") - alg0 - alg_inside[0]
            outside = time.perf_counter() - t0 - inside[0] - alg_outside
            self.ledger.add("bk:optuna", max(0.0, outside))
            if bar is not None:
                bar.close()
