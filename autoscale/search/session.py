"""What one worker's search is asked (:class:`SearchConfig`), what it did (:class:`SearchResult`),
and what its rounds share (:class:`Session`), built once everything they read exists, so that
:mod:`~autoscale.search.rounds` needs nothing of :mod:`~autoscale.search.runner`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoscale.search.budget import Budget, Ledger
from autoscale.search.no_harm import NoHarmCheck
from autoscale.search.plan import Plan
from autoscale.search.storage import DEFAULT_STORAGE

__all__ = ["SearchConfig", "SearchResult", "Session"]


@dataclass
class SearchConfig:
    """What ``autoscale search`` was asked for (strings already turned into objects).

    Attributes:
        base: The env spec or suite of the workloads (reshaped by the plan).
        explicit: The user named the workload (``--env``/``--model``/``--scenario``); a study
            that exists must then have those workloads, else its own are adopted.
        families: The rule families searched (``--family``; None: every family that adapts, a
            fixed scale only when asked for). ``torch`` is always validated: it is the reference.
        warm_start: The study's first RL trial fine-tunes the shipped general agent
            (:mod:`autoscale.agents.warm`) instead of training one from nothing.
    """

    base: Any
    study: str
    export: str
    explicit: bool = True
    space: str = "parametric"
    storage: str = DEFAULT_STORAGE
    n_trials: int | None = None
    seed: int = 0
    force: bool = False
    artifacts: str | None = None
    policy_dir: str | None = None
    progress: bool = True
    command: str = ""
    budget_text: str = ""
    families: tuple[str, ...] | None = None
    warm_start: bool = True


@dataclass
class SearchResult:
    """What a search did (this worker's share of the study)."""

    study: str
    plan: Plan | None
    trials: dict[str, int]
    winner: str | None = None
    builtin: bool = False
    exported: Path | None = None
    table: str = ""
    wall_s: float = 0.0
    budget_s: float = 0.0
    rounds: int = 0
    stopped_early: str | None = None
    answer: list[str] = field(default_factory=list)
    replanned: list[str] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)


@dataclass(frozen=True)
class Session:
    """What the rounds of one worker share with the runner that started them.

    Attributes:
        cfg: The request.
        budget: The wall-clock budget.
        ledger: Where time is counted.
        result: What the search did so far (the rounds fill it in).
        counts: Trials of this worker by state (``complete``, ``pruned``, ``failed``).
        no_harm: The no-harm check the plan fitted to the budget.
        folder: The artifacts folder (locks, caches).
        worker: This worker's id.
        min_search_s: Seconds a round's search keeps at least.
        say: ``say(phase, text)``: a phase's line.
        warn: A warning line.
        out: Where whole tables go.
    """

    cfg: SearchConfig
    budget: Budget
    ledger: Ledger
    result: SearchResult
    counts: dict[str, int]
    no_harm: NoHarmCheck
    folder: Path
    worker: str
    min_search_s: float
    say: Callable[[str, str], None]
    warn: Callable[[str], None]
    out: Callable[[str], None]
