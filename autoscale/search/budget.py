"""Wall-clock budgets: parsing (``90s``, ``30m``, ``2h``, ``1h30m``), deadlines, and a time ledger.

The budget clock starts when autoscale was first imported (``autoscale.IMPORT_TIME``), not when the
search code runs, so imports (torch and the rest) are paid from the budget the user gave.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from autoscale.errors import BudgetError

__all__ = [
    "Budget",
    "Ledger",
    "format_duration",
    "parse_budget",
    "percent",
    "plural",
    "process_elapsed",
    "trial_counts",
    "outcome_counts",
    "OUTCOMES",
]

_BUDGET_RE = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")
BUDGET_FORMS = "90s, 30m, 2h or 1h30m (h, m, s; largest unit first)"


def parse_budget(text: str) -> float:
    """Seconds in a budget written like ``90s``, ``30m``, ``2h`` or ``1h30m``.

    Raises:
        BudgetError: anything else (a bare number is refused: seconds or minutes?).
    """
    raw = str(text)
    compact = raw.strip().lower().replace(" ", "")
    m = _BUDGET_RE.fullmatch(compact)
    if not compact or m is None or not any(m.groups()):
        raise BudgetError(f"--budget '{raw}' is not a duration; write it like {BUDGET_FORMS}")
    h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    seconds = 3600 * h + 60 * mi + s
    if not seconds > 0:
        raise BudgetError(f"--budget '{raw}' is zero; give a positive duration like {BUDGET_FORMS}")
    return seconds


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, an ``s`` added unless ``n`` is 1 (``1 test episode``, ``0 candidates``)."""
    return f"{n} {word}{'' if n == 1 else 's'}"


OUTCOMES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}  # a trial's end, by state


def outcome_counts(trials: list[Any]) -> dict[str, int]:
    """Optuna trials counted by how they ended (:data:`OUTCOMES`; waiting or running ones not)."""
    counts = dict.fromkeys(OUTCOMES.values(), 0)
    for t in trials:
        if t.state.name in OUTCOMES:
            counts[OUTCOMES[t.state.name]] += 1
    return counts


def trial_counts(counts: dict[str, int], after: str = "") -> str:
    """``12 trials (9 complete, 3 pruned, 0 failed)``, ``after`` inside the brackets, from counts
    by outcome (``complete``, ``pruned``, ``failed``)."""
    c = counts
    return (
        f"{plural(sum(c.values()), 'trial')} ({c['complete']} complete, {c['pruned']} pruned, "
        f"{c['failed']} failed{after})"
    )


def percent(share: float | None) -> str:
    """A share in percent (``12.50%``); ``n/a`` where there is none (NaN, or None as stored)."""
    return f"{100 * share:.2f}%" if share is not None and math.isfinite(share) else "n/a"


def format_duration(seconds: float) -> str:
    """``3725`` -> ``1h02m05s``; ``59.4`` -> ``59.4s``; the inverse of :func:`parse_budget`."""
    if not math.isfinite(seconds):
        return str(seconds)
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m" + (f"{s:02d}s" if s else "")
    return f"{m}m{s:02d}s" if s else f"{m}m"


def process_elapsed() -> float:
    """Seconds since autoscale was first imported in this process (not since the process
    started: ``setup && autoscale ...`` may exec autoscale in the shell's own process)."""
    import autoscale

    return max(0.0, time.monotonic() - autoscale.IMPORT_TIME)


@dataclass(frozen=True)
class Budget:
    """A wall-clock budget on the ``time.monotonic()`` clock.

    Attributes:
        seconds: The whole budget.
        start: ``time.monotonic()`` value at which it started.
        reserve: Seconds kept back at the end for export, the final table and exit.
    """

    seconds: float
    start: float
    reserve: float

    @classmethod
    def from_process_start(cls, seconds: float) -> Budget:
        """A budget that started when this process did."""
        reserve = min(60.0, max(3.0, 0.04 * seconds))
        return cls(seconds, time.monotonic() - process_elapsed(), reserve)

    @property
    def end(self) -> float:
        """The monotonic time by which everything but the reserve is done."""
        return self.start + self.seconds - self.reserve

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        """Seconds until :attr:`end` (negative once past it)."""
        return self.end - time.monotonic()


class Ledger:
    """Seconds spent per category (``work:*`` training and evaluation, ``bk:*`` bookkeeping)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def track(self, category: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[category] += time.perf_counter() - t0

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds

    def total(self, prefix: str) -> float:
        """Seconds of every category starting with ``prefix``."""
        return sum(v for k, v in self.seconds.items() if k.startswith(prefix))
