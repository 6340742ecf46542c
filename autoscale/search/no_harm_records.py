"""The no-harm check of a search on records (:class:`RecordsCheck`): a record cannot be trained
again, so the candidate and ``torch`` are replayed over each whole run and judged on its clean
steps, with :class:`~autoscale.search.no_harm.NoHarmCheck`'s interface. The rule:
docs/your-run.md, "A policy for your run: autoscale search --traces" (phase 4).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoscale.search.budget import Ledger
from autoscale.search.no_harm import Verdict
from autoscale.training.bar import SKIP_POINTS

__all__ = ["RecordsCheck", "WHERE", "totals"]

WHERE = "on the replay of the whole records"
PRECISION_POINTS = SKIP_POINTS  # the bar's margin, for gradient elements below fp16's range


class RecordsCheck:
    """Replays candidates over ``records`` (:class:`~autoscale.observe.RunRecord`).

    Args:
        ledger: Time spent goes to ``work:no-harm``.
        reference: Fresh ``torch`` scalers with the bounds the candidates have.
        run_s: Estimated seconds of one candidate's check, until one is measured.
    """

    def __init__(
        self,
        records: list[Any],
        ledger: Ledger,
        reference: Callable[[], Any],
        run_s: float = 0.0,
    ) -> None:
        from autoscale.report.replay import RecordReplay

        self.ledger, self.reference = ledger, reference
        self.replays = [RecordReplay(r) for r in records]
        self._torch: dict[int, Any] = {}
        self.run_s = run_s  # seconds of one candidate's replay of every run (measured by each)

    def screen(
        self, factory: Callable[[], Any], label: str, deadline: float | None = None
    ) -> Verdict:
        """Nothing cheaper than :meth:`check` screens a replay: it passes."""
        return Verdict(label, True, screened=True)

    def cost(self, timings: Any = None, candidates: int = 1) -> float:
        """Seconds of ``candidates`` checks (``timings`` unused: replay, measured)."""
        return candidates * self.run_s

    def _torch_outcome(self, i: int) -> Any:
        if i not in self._torch:
            self._torch[i] = self.replays[i].replay_scaler(self.reference(), "torch")
        return self._torch[i]

    def check(
        self, factory: Callable[[], Any], label: str, deadline: float | None = None
    ) -> Verdict:
        """The candidate's replay of every run against torch's (a run with no clean step is left
        out; none at all fails). ``deadline`` is ignored: replay takes seconds."""
        import numpy as np

        t0 = time.perf_counter()
        reasons: list[str] = []
        runs: dict[str, dict[str, Any]] = {}
        with self.ledger.track("work:no-harm"):
            for i, rp in enumerate(self.replays):
                clean = ~rp.inst.nonfinite & np.isfinite(rp.inst.threshold)
                name = str(Path(rp.record.path).resolve())
                if not clean.any():
                    continue
                # fresh, as validated (its initial scale and bounds: the windows' or its own)
                mine = _stats(rp.replay_scaler(factory(), label), clean)
                ref = _stats(self._torch_outcome(i), clean)
                runs[name] = {"candidate": [mine], "torch": [ref]}
                if mine["skip_rate"] > ref["skip_rate"] + SKIP_POINTS:
                    reasons.append(
                        f"{name}: skips {100 * mine['skip_rate']:.2f}% of the clean steps, torch "
                        f"{100 * ref['skip_rate']:.2f}%"
                    )
                if mine["precision_loss"] > ref["precision_loss"] + PRECISION_POINTS:
                    reasons.append(
                        f"{name}: loses {100 * mine['precision_loss']:.2f}% of gradient elements "
                        f"below fp16's range, torch {100 * ref['precision_loss']:.2f}%"
                    )
        if not runs:
            reasons.append("no recorded run has a clean step (a finite loss and a known threshold)")
        self.run_s = time.perf_counter() - t0
        return Verdict(label, not reasons, reasons, runs, where=WHERE)


def _stats(outcome: Any, clean: Any) -> dict[str, Any]:
    """Skip rate and mean precision loss over the clean steps (0 where none applied has one)."""
    import numpy as np

    p = outcome.precision[clean & ~outcome.skipped]
    p = p[np.isfinite(p)]
    return {
        "clean_steps": int(clean.sum()),
        "skip_rate": float(outcome.skipped[clean].mean()),
        "precision_loss": float(p.mean()) if p.size else 0.0,
    }


def totals(verdict: Verdict) -> dict[str, Any]:
    """The verdict's runs pooled over their clean steps: what a policy's scorecard keeps."""
    out: dict[str, Any] = {"passed": verdict.passed, "why": "; ".join(verdict.reasons)}
    runs = list(verdict.runs.values())
    n = sum(r["candidate"][0]["clean_steps"] for r in runs)
    out["clean_steps"] = n
    for who, prefix in (("candidate", ""), ("torch", "torch_")):
        for key in ("skip_rate", "precision_loss"):
            total = sum(r[who][0][key] * r[who][0]["clean_steps"] for r in runs)
            out[prefix + key] = total / n if n else float("nan")
    return out
