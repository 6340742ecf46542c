"""The trial loop: ask, run, tell, until a deadline, a trial count or a bookkeeping cap."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from autoscale.search.budget import Ledger

__all__ = ["TrialLoop"]


class TrialLoop:
    """Runs trials of one study for one worker.

    A trial that raises is failed (its error kept as a user attribute) and the loop goes on; a
    pruned one is told so; an interrupt fails the running trial, so none is left running, and
    propagates. Time outside the objective's own ledger accounting and the sampler's and pruner's
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
                self.counts[self._one(objective_fn)] += 1
                ran += 1
                tracked = self.ledger.total("") - inside
                self.ledger.add("bk:optuna", max(0.0, time.perf_counter() - t0 - tracked))
                if bar is not None:
                    bar.n = round(min(time.monotonic() - t_start, bar.total), 1)
                    bar.set_postfix_str(f"trials {ran}", refresh=False)
                    bar.refresh()
        finally:
            if bar is not None:
                bar.close()

    def _one(self, objective_fn: Callable[[Any], float]) -> str:
        import optuna
        from optuna.trial import TrialState

        trial = self.study.ask()
        told = False
        try:
            trial.set_user_attr("worker", self.worker)
            try:
                value = objective_fn(trial)
            except optuna.TrialPruned:
                self.study.tell(trial, state=TrialState.PRUNED)
                told = True
                return "pruned"
            except Exception as exc:
                self.warn(f"trial {trial.number} failed: {type(exc).__name__}: {exc}")
                with contextlib.suppress(Exception):
                    trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:1000])
                self.study.tell(trial, state=TrialState.FAIL)
                told = True
                return "failed"
            self.study.tell(trial, value)
            told = True
            return "complete"
        except KeyboardInterrupt:
            if not told:
                with contextlib.suppress(Exception):
                    self.study.tell(trial, state=TrialState.FAIL)
            raise
