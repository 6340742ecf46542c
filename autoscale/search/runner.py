"""``autoscale search`` end to end: :class:`SearchRunner` runs one worker's phases (measure, plan,
record, search, validate, export) for a :class:`SearchConfig`; phases 4-6 run in rounds decided
in one place, :meth:`SearchRunner._next_round`. A :class:`Source` replaces the first phases for a
search of a user's records. User-facing detail: docs/search.md ("The budget is spent", "Many
workers, one study") and docs/design.md section 7.
"""

from __future__ import annotations

import contextlib
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from autoscale.envs.suite import SuiteSpec, as_suite
from autoscale.processes import owner_tag
from autoscale.search.agent_trials import RLObjective
from autoscale.search.bench import ReplayBench
from autoscale.search.budget import Budget, Ledger, format_duration, plural, trial_counts
from autoscale.search.candidates import AUTO, TORCH, Candidate
from autoscale.search.choose import choose, family_refusal, record_pick, refusal, unchecked_lines
from autoscale.search.export import (
    SEARCH_EXPORT,
    card_summary,
    check_export_target,
    export_candidate,
    policy_label,
    rank,
    rows_where,
    top_candidates,
)
from autoscale.search.loop import TrialLoop
from autoscale.search.no_harm import NO_HARM_STEPS, NoHarmCheck, no_harm_proxy, no_harm_workloads
from autoscale.search.plan import (
    CHECKED_CANDIDATES,
    MIN_HORIZON,
    SLOW,
    Plan,
    StoredPlan,
    instance_count,
    least_after_record,
    make_plan,
    replan,
)
from autoscale.search.report import comparison_table, draw_comparison, limit_block, member_table
from autoscale.search.space import parametric_families, searched_families
from autoscale.search.storage import (
    DEFAULT_STORAGE,
    artifact_store,
    artifacts_dir,
    file_lock,
    mask_url,
    open_storage,
    storage_id,
    study_names,
)
from autoscale.search.study import (
    check_source,
    check_workload,
    describe_new_study,
    describe_spec,
    fail_stale_trials,
    store_plan,
    study_kwargs,
    study_note,
    wait_for_plan,
)
from autoscale.search.timing import MARGIN, NoHarmPlan, Timings, measure_all
from autoscale.search.traces import cached_share, keep_planned, load_traces, pace_of
from autoscale.search.trials import (
    ParametricObjective,
    TrialRecorder,
    best_line,
    store_artifact,
    write_note,
)
from autoscale.search.validate import Validated, Validator
from autoscale.training.threads import fit_threads

__all__ = [
    "SearchConfig",
    "SearchResult",
    "SearchRunner",
    "Round",
    "Source",
    "PHASES",
    "CANDIDATES_PER_ROUND",
    "MAX_ROUNDS",
    "rules_torch_first",
]

PHASES = ("measure", "plan", "record", "search", "validate", "export")
CANDIDATES_PER_ROUND = 3  # candidates the first round and the tail validate (the best first)
MAX_ROUNDS = 12
TAIL_SHARE = 0.05  # the tail's replay trials need this share of the budget left
RL_SHARE_OF_BOTH = 0.7  # with --space both, RL gets this share of the search time
AUTO_UNMEASURED = "exporting auto, the shipped general policy, unmeasured here"


@dataclass
class SearchConfig:
    """What ``autoscale search`` was asked for (strings already turned into objects).

    Attributes:
        base: The env spec or suite of the workloads (reshaped by the plan).
        explicit: The user named the workload, which an existing study must then have.
        families: The rule families searched (``--family``; None: every family that adapts).
            ``torch`` is always validated: it is the reference.
        warm_start: The study's first RL trial fine-tunes the shipped agent
            (:mod:`autoscale.agents.warm`).
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
    exported: Path | None = None
    table: str = ""
    wall_s: float = 0.0
    budget_s: float = 0.0
    stopped_early: str | None = None
    answer: list[str] = field(default_factory=list)
    replanned: list[str] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)


@dataclass(frozen=True)
class Round:
    """One round, as :meth:`SearchRunner._next_round` decided it when the round started.

    Attributes:
        number: 1 for the first.
        candidates: How many of the best candidates not validated yet it validates.
        search_until: Its replay search stops here (``time.monotonic()``; None: the tail).
        check_at: Validation past torch, auto and the agent stops here (a check still fits).
        tail_before: The tail's replay trials run if validation ends before this (None: no tail).
    """

    number: int
    candidates: int
    search_until: float | None
    check_at: float
    tail_before: float | None = None


class Source(Protocol):
    """Where a search's episodes come from other than a workload's real steps
    (:class:`~autoscale.search.on_traces.RecordsSource`: a user's records).

    Attributes:
        phases: The phases said, in order.
        searched_on: What the trials were scored on, in the search's line.
        provenance: What the exported manifest's workload says of the evidence.
        round: The one round the search runs (its ``search_until`` None: no search).
    """

    phases: tuple[str, ...]
    searched_on: str
    provenance: dict[str, Any]
    round: Round

    def open(self, runner: SearchRunner) -> ReplayBench:
        """The phases before the search: set ``runner.study``, ``plan``, ``families``,
        ``validator`` and ``no_harm``; return the bench of the traces searched."""

    def validated_line(self, runner: SearchRunner, seconds: float) -> str:
        """The validate phase's line, once the round validated in ``seconds``."""

    def scorecard(self, runner: SearchRunner, chosen: Validated | None) -> dict[str, Any]:
        """What the exported manifest's scorecard adds for the pick ``chosen``."""

    def exported(
        self, runner: SearchRunner, path: Path, how: str, chosen: Validated | None, since: float
    ) -> None:
        """Say what was exported to ``path`` (``how``), the pick started at ``since``."""


def _print(text: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(text)
    sys.stdout.flush()


class SearchRunner:
    """Runs one worker's search (see the module docstring).

    Args:
        cfg: The request.
        budget: The wall-clock budget (started when the process did, for the CLI).
        out: Where phase messages go (default: printed above the progress bars).
        source: Where the episodes come from (None: real steps of ``cfg.base``).

    Attributes:
        plan: The plan in use (the study's; re-planned or re-timed after recording).
        no_harm: Its no-harm check, rebuilt only where a plan changes it.
        study: The Optuna study, once opened.
        counts: This worker's trials by outcome (``complete``, ``pruned``, ``failed``).
        validated: Scorecards of everything validated so far, by :class:`Candidate` key.
        result: What the search did so far.
    """

    def __init__(
        self,
        cfg: SearchConfig,
        budget: Budget,
        out: Callable[[str], None] | None = None,
        source: Source | None = None,
    ):
        self.cfg, self.budget, self.source = cfg, budget, source
        self.out = out or _print
        self.phases = PHASES if source is None else source.phases
        self.ledger = Ledger()
        self.worker = owner_tag()  # host:pid, naming the worker that ran a trial
        self.creator = False  # this worker created the study: it plans it (see _replan)
        self.counts = {"complete": 0, "pruned": 0, "failed": 0}
        self.min_search_s = max(2.0, 0.02 * budget.seconds)
        if cfg.space != "parametric":  # the first round holds one RL trial (the warm start)
            self.min_search_s = max(self.min_search_s, 2.5 * RLObjective.MIN_TRIAL_S)
        self.result = SearchResult(
            cfg.study, None, self.counts, budget_s=budget.seconds, ledger=self.ledger
        )
        self.plan: Plan | None = None
        self.no_harm: NoHarmCheck | None = None  # the check of the plan (see _use)
        self.study: Any = None
        self.validated: dict[str, Validated] = {}
        self.factories: dict[str, Callable[[], Any]] = {}
        self.exported: Candidate | None = None  # the key exported last
        self.said: set[str] = set()  # lines about the pick said once
        self.choice: Any = None  # the last pick (autoscale.search.choose.Choice)
        self.auto_replays: dict[Any, Any] = {}  # auto's horizon replay, once a bench
        self.first_cuts: list[str] = []  # what the re-plan of a resumed study's first run traded

    # ------------------------------------------------------------------ messages
    def say(self, phase: str, text: str) -> None:
        """A phase's line, numbered among the search's phases."""
        n = f"{self.phases.index(phase) + 1}/{len(self.phases)} " if phase in self.phases else ""
        self.out(f"[{n}{phase}] {text}")

    def warn(self, text: str) -> None:
        from tqdm.auto import tqdm

        tqdm.write(f"warning: {text}", file=sys.stderr)

    # ------------------------------------------------------------------ the phases
    def run(self) -> SearchResult:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are said once, here
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        cfg = self.cfg
        # the export target is checked before anything is written (the storage, caches)
        check_export_target(
            cfg.export, cfg.policy_dir, cfg.study, cfg.force, storage=mask_url(cfg.storage)
        )
        _preload()
        bench = self._open() if self.source is None else self.source.open(self)
        with tempfile.TemporaryDirectory(prefix="autoscale-search-") as tmp:
            self._rounds(bench, Path(tmp))
        self.result.wall_s = self.budget.elapsed()
        return self.result

    def artifacts(self) -> None:
        """The folder of the storage's artifacts (:attr:`folder`), and its store (:attr:`store`)."""
        self.folder = artifacts_dir(self.cfg.storage, self.cfg.artifacts)
        self.store = artifact_store(self.folder)

    def _open(self) -> ReplayBench:
        """Measure, plan, record (and re-plan); the bench of the traces recorded."""
        import optuna

        cfg = self.cfg
        with self.ledger.track("bk:optuna"):
            storage = open_storage(cfg.storage)
            stored = (
                optuna.load_study(study_name=cfg.study, storage=storage)
                if cfg.study in study_names(storage)
                else None
            )
        kept = self._adopt(stored) if stored is not None else None
        base = kept[0] if kept is not None else as_suite(cfg.base)
        self.artifacts()
        self.out(
            f"search {cfg.space} policies for {describe_spec(base)} in {format_duration(self.budget.seconds)}; "
            f"study '{cfg.study}' in {mask_url(cfg.storage)}" + (" (resuming)" if stored else "")
        )
        timings, no_harm = self._measure(base)
        self._plan(base, timings, no_harm, kept)
        self._open_study(storage, stored)
        with self.ledger.track("work:record"):
            traces, stats = self._record()
        traces = self._replan(traces, stats)
        plan = self.plan
        with self.ledger.track("work:replay"):
            bench = ReplayBench(plan.suite, traces)
        self.validator = Validator(
            self.study,
            plan.validation,
            self.ledger,
            plan.timings,
            worker=self.worker,
            progress=self.cfg.progress,
        )
        self.families = {r: parametric_families()[r] for r in plan.rules}
        return bench

    def _measure(self, base: SuiteSpec) -> tuple[Timings, NoHarmPlan]:
        """Time the workloads, the no-harm check's and their proxies; (timings, unfitted check)."""
        no_harm = NoHarmPlan(no_harm_workloads(list(base.members)), NO_HARM_STEPS)
        proxies = [p for p in map(no_harm_proxy, no_harm.workloads) if p is not None]
        with self.ledger.track("work:measure"):
            self.threads = fit_threads()  # measured with the threads it records with
            timings = measure_all(
                [m.workload for m in base.members] + list(no_harm.workloads) + proxies,
                limit_s=max(1.0, min(0.25 * self.budget.seconds, self.budget.left())),
                step_share_s=max(0.2, 0.01 * self.budget.seconds),
            )
        self.say("measure", f"{timings.describe()}; {self.threads.describe()}")
        self._check(no_harm, base)
        return timings, no_harm

    def _check(self, no_harm: NoHarmPlan, suite: SuiteSpec) -> None:
        """Check with ``no_harm``: the check in use is kept where it is that one."""
        kw = suite.episode.scale_kwargs()
        if self.no_harm is None or (self.no_harm.no_harm, self.no_harm.scale_kw) != (no_harm, kw):
            self.no_harm = NoHarmCheck(
                no_harm, self.folder, self.ledger, kw, progress=self.cfg.progress
            )

    def _use(self, plan: Plan) -> None:
        """Go on with ``plan`` and the no-harm check it fitted to the budget."""
        self.plan = self.result.plan = plan
        self._check(plan.no_harm, plan.suite)

    def _plan(
        self,
        base: SuiteSpec,
        timings: Timings,
        no_harm: NoHarmPlan,
        kept: StoredPlan | None,
    ) -> Plan:
        def cached(shaped: SuiteSpec, steps: int) -> float:
            return cached_share(
                shaped,
                self.folder,
                steps,
                lambda m, k: timings.of(m.workload).run_s(k, record=True),
            )

        plan = make_plan(
            base,
            timings,
            self.budget.left(),
            no_harm=no_harm,
            space=self.cfg.space,
            rules=rules_torch_first(self.cfg.families),
            cached_traces=cached,
            cached_no_harm=self.no_harm.cached,
            stored=kept,
            warm_start=self.cfg.warm_start,
            min_search_s=self.min_search_s,
        )
        self.say("plan", plan.describe())
        if kept is not None and self.first_cuts:  # (a busy machine's plan, kept on a quiet one)
            self.say(
                "plan",
                "the study keeps the plan its first run bent to its recording ("
                + "; ".join(self.first_cuts)
                + "); a new --study NAME plans afresh for this machine",
            )
        self._use(plan)
        return plan

    def _adopt(self, stored: Any) -> StoredPlan:
        check_source(stored.user_attrs, self.cfg.study)
        kept = wait_for_plan(stored, self._waiting, give_up_at=self.budget.end)
        self.first_cuts = list(stored.user_attrs.get("replanned") or [])  # (said at plan)
        if self.cfg.explicit:
            check_workload(kept[0], as_suite(self.cfg.base), self.cfg.study)
        return kept

    def _waiting(self, planner: str) -> None:
        self.out(
            f"study '{self.cfg.study}' is being planned by the worker that created it ({planner}): "
            "waiting for the plan it stores after recording"
        )

    def _open_study(self, storage: Any, stored: Any) -> Any:
        """Create the study, or load it (a worker that loses the race adopts the winner's plan)."""
        import optuna

        cfg, plan = self.cfg, self.plan
        before = len(stored.get_trials(deepcopy=False)) if stored is not None else 0
        kwargs = study_kwargs(cfg.seed, before, self.ledger)
        with self.ledger.track("bk:optuna"):
            if stored is not None:
                study = optuna.load_study(study_name=cfg.study, storage=storage, **kwargs)
                stale = fail_stale_trials(study, storage)
                if stale:
                    self.say(
                        "plan", f"failed {plural(stale, 'trial')} left running by stopped workers"
                    )
            else:
                try:
                    study = optuna.create_study(
                        study_name=cfg.study, storage=storage, direction="minimize", **kwargs
                    )
                    budget = {"text": cfg.budget_text, "seconds": self.budget.seconds}
                    until = time.time() + self.budget.left()
                    describe_new_study(
                        study,
                        plan,
                        command=cfg.command,
                        budget=budget,
                        planner=self.worker,
                        until=until,
                    )
                    self.creator = True
                except optuna.exceptions.DuplicatedStudyError:  # another worker was faster
                    study = optuna.load_study(study_name=cfg.study, storage=storage, **kwargs)
                    self.say("plan", "another worker created the study first: adopting its plan")
                    kept = wait_for_plan(study, self._waiting, give_up_at=self.budget.end)
                    check_source(study.user_attrs, cfg.study)
                    self.first_cuts = list(study.user_attrs.get("replanned") or [])
                    self._plan(plan.suite, plan.timings, plan.no_harm, kept)
            study.set_user_attr(
                f"worker:{self.worker}",
                {
                    "command": cfg.command,
                    "budget_s": self.budget.seconds,
                    "started": time.time(),
                    "timing": self.plan.timings.to_dict(),
                },
            )
        self.study = study
        return study

    def _record(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Record the plan's traces. The study's creator bends recording to the machine's pace
        (:mod:`~autoscale.search.plan`); any other worker records the plan whole, or stops with a
        BudgetError where the least the later phases need begins (what it recorded stays cached)."""
        plan = self.plan
        after = MARGIN * (plan.validate_s + plan.no_harm_s)
        least = least_after_record(plan, self.no_harm.cached) + self.min_search_s
        bend: dict[str, Any] = {"stop_at": self.budget.end - least}
        if self.creator:
            bend = {
                "stop_at": lambda pace: self.budget.end - max(1.0, pace) * after,
                "floor_at": self.budget.end - least,
                "shrink_to": MIN_HORIZON,
            }

        def retune(pace: float) -> None:
            before = self.threads.threads
            self.threads = fit_threads()
            if self.threads.threads != before:
                self.say(
                    "record",
                    f"steps run {pace:.1f}x slower than measured: now {self.threads.describe()}",
                )

        traces, stats = load_traces(
            plan.suite,
            self.folder,
            plan.trace_steps,
            cost=lambda m, n: plan.timings.of(m.workload).run_s(n, record=True),
            progress=self.cfg.progress,
            warn=self.warn,
            on_slow=retune,
            **bend,
        )
        n = instance_count(plan.suite)
        pace = pace_of(stats)
        slower = f" ({pace:.1f}x the measured time)" if pace > SLOW else ""
        self.say(
            "record",
            f"{n} instances x {plan.trace_steps} real steps: {stats['recorded']} recorded "
            f"in {format_duration(stats['wall_s'])}{slower}, {stats['cached']} from the cache"
            + (f", {len(stats['dropped'])} left out" if stats["dropped"] else "")
            + (
                f", {len(stats['shortened'])} shortened (the shortest {stats['shortest']} steps)"
                if stats["shortened"]
                else ""
            ),
        )
        return traces, stats

    def _replan(self, traces: dict, stats: dict) -> dict[str, Any]:
        """The traces to replay after recording. Only the study's creator re-plans (and stores
        the plan for good, before anything is scored); others re-time their own phases."""
        plan = self.plan
        new = replan(
            plan,
            traces if self.creator else None,
            stats,
            left_s=self.budget.left(),
            budget_s=self.budget.seconds,
            min_search_s=self.min_search_s,
            cached_no_harm=self.no_harm.cached,
        )
        if not self.creator:
            if new is not plan:
                self.say(
                    "plan",
                    f"steps ran {pace_of(stats):.1f}x slower than measured: this worker's phases "
                    "are timed at that pace (the study's plan stays)",
                )
                self._use(new)
            return traces
        if new is not plan:
            traded = new.cuts[len(plan.cuts) :]
            self.say(
                "plan", "re-planned: " + ("; ".join(traded) or "steps ran slower than measured")
            )
            self.result.replanned = list(traded)
            self._use(new)
            with self.ledger.track("work:record"):
                traces = keep_planned(new.suite, traces, self.folder, new.trace_steps)
        with self.ledger.track("bk:optuna"):
            store_plan(self.study, None if new is plan else new, self.result.replanned)
        return traces

    # ------------------------------------------------------------------ the rounds
    def _rounds(self, bench: ReplayBench, workdir: Path) -> None:
        """Search, validate, pick and export, in rounds while :meth:`_next_round` starts one."""
        self.workdir, self.bench = workdir, bench
        self.recorder = TrialRecorder(bench, self.store, self.ledger, workdir, self.warn)
        rules = self.plan.rules
        self.factories = {Candidate.rule(r): (lambda r=r: bench.scaler(r)) for r in rules}
        self.factories[AUTO] = lambda: bench.scaler(AUTO.name)
        last, new = None, False
        while (r := self._next_round(last, new, time.monotonic())) is not None:
            if r.search_until is not None:
                self._search(r.search_until, r.number == 1)
            new = self._validate(r)
            if new or r.tail_before is None:  # the tail picks again only where it validated
                self._pick()
            if r.tail_before is not None:
                self._tail_search(r.tail_before)
            last = r

    def _next_round(self, last: Round | None, new: bool, now: float) -> Round | None:
        """The round to start at ``now`` after ``last`` (which validated something ``new``), or
        None to stop.

        The first round always runs, its search stopped where validation and the checks still
        fit (but lasting ``min_search_s`` where the least of a round fits). Stop without torch's
        validation, when nothing new was validated and ``--n-trials`` ran, or after
        :data:`MAX_ROUNDS` or the tail. A later round runs where one candidate, one check and
        ``min_search_s`` fit; else the tail: validation, then parametric replay trials (not RL:
        seconds to minutes each). ``check_at`` keeps a margin over the check's own ``MARGIN``: a
        busier machine would leave it a few seconds short.
        """
        if self.source is not None:  # the one round its source planned
            return self.source.round if last is None else None
        plan, validator, end = self.plan, self.validator, self.budget.end
        check_at = end - (MARGIN + 0.2) * self.no_harm.cost(plan.timings, 1)
        number = 1 if last is None else last.number + 1
        if last is None:  # after its search: validate (the best few, the rules), check picks
            held = self._held([Candidate.rule(r) for r in plan.rules] + [AUTO])
            rules_left = [
                r for r in plan.rules if Candidate.rule(r) not in {*self.validated, *held}
            ]
            n_rules = len(rules_left) if plan.all_rules_real else min(1, len(rules_left))
            n_rules += not self._bar_real() and AUTO not in held  # the bar
            k = CANDIDATES_PER_ROUND
            kept = k if plan.all_rules_real else 1  # as plan.validated_scalers priced them
            after = validator.cost(
                kept + n_rules + self._agent_pending()
            ) + MARGIN * self.no_harm.cost(plan.timings, CHECKED_CANDIDATES)
            stop = end - after
            if stop - now < self.min_search_s:  # torch, the bar where it is not yet, a candidate
                least = validator.cost(2 + (not self._bar_real())) + MARGIN * self.no_harm.cost(
                    plan.timings, 1
                )
                stop = max(stop, min(now + self.min_search_s, end - least))
            return Round(number, k, stop, check_at)
        if TORCH not in self.validated:
            return None
        if not new and self._exhausted():
            self.result.stopped_early = (
                "every candidate of the study is validated and checked: nothing left to learn"
            )
            self.say(
                "export",
                f"stopping with {format_duration(end - now)} left: {self.result.stopped_early}",
            )
            return None
        if last.number >= MAX_ROUNDS or last.tail_before is not None:
            return None
        after = validator.cost(1 + self._agent_pending()) + MARGIN * self.no_harm.cost(
            plan.timings, 1
        )
        if end - now >= after + self.min_search_s:
            return Round(number, 1, end - after, check_at)
        tail_before = end - TAIL_SHARE * self.budget.seconds
        return Round(number, CANDIDATES_PER_ROUND, None, check_at, tail_before)

    def _held(self, keys: list[Candidate]) -> set[Candidate]:
        """Of ``keys``, those the study holds real-step scorecards of for every test episode."""
        from autoscale.search.validate import PREFIX, real_cards

        attrs, names = self.study.user_attrs, self.validator.names
        return {
            k
            for k in keys
            if "on" not in (attrs.get(PREFIX + k) or {})  # (replayed rows are not real steps)
            and len(real_cards(attrs, k, names)) == len(names)
        }

    def _agent_pending(self) -> bool:
        """Whether an agent is still to reach real steps (the round's reserve counts it)."""
        if self.plan.space == "parametric":
            return False
        done = {c.number for c in map(Candidate.parse, self.validated) if c.is_trial}
        trials = self.study.get_trials(deepcopy=False) if done else []
        kinds = {trials[n].user_attrs.get("policy", {}).get("kind") for n in done}
        return "residual" not in kinds

    def _exhausted(self) -> bool:
        """No trial to run (``--n-trials`` reached) and none left to validate."""
        return self.cfg.n_trials is not None and sum(self.counts.values()) >= self.cfg.n_trials

    # ------------------------------------------------------------------ search
    def _search(self, stop: float, first: bool) -> None:
        plan, bench = self.plan, self.bench
        t0 = time.monotonic()
        before = dict(self.counts)
        rl = plan.space in ("rl", "both") and RLObjective.fits(
            bench.suite, self.warn if first else None, self.cfg.warm_start
        )
        if rl and first:  # the agent that starts at auto, whatever the time: it reaches validation
            self._baselines()  # the rules' enqueued defaults first: an agent must not take one
            self._warm_trial(stop)
        if stop - time.monotonic() < 1.0:
            if first and self.counts == before:
                self.say(
                    "search",
                    "none of the budget is left to search before validation and the no-harm "
                    "check (the plan keeps the rest for them); validating what the study has",
                )
            if self.counts == before:
                return
        elif plan.space in ("parametric", "both"):
            t1 = time.monotonic()  # (after the warm trial: RL's share holds the rest)
            until = stop if not rl else t1 + (1 - RL_SHARE_OF_BOTH) * (stop - t1)
            self._trials(self._parametric(), until)
        if rl and stop - time.monotonic() >= 1.0:
            self._trials(self._rl(stop), stop - RLObjective.MIN_TRIAL_S / 2)
        c = self._since(before)
        on = "" if self.source is None else f" {self.source.searched_on}"
        self.say(
            "search",
            f"{trial_counts(c)} in {format_duration(time.monotonic() - t0)}{on}; "
            + best_line(self.study),
        )

    def _baselines(self) -> None:
        """Score the rules' enqueued defaults first, whatever the time: an agent trial that took
        one would carry the ``baseline`` mark and never reach validation."""
        import optuna

        waiting = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
        if not waiting or self.plan.space not in ("parametric", "both"):
            return
        stop_at = time.monotonic() + RLObjective.MIN_TRIAL_S * len(waiting)
        self._trials(self._parametric(), stop_at, n_trials=self._more(len(waiting)), progress=False)

    def _warm_trial(self, stop: float) -> None:
        """The study's first RL trial (the shipped agent, fine-tuned), run even where no time is
        left to search, so an agent that starts at ``auto`` always reaches validation."""
        objective_fn = self._rl(stop)
        if objective_fn.warm is None or any(
            t.user_attrs.get("warm_start") for t in self.study.get_trials(deepcopy=False)
        ):
            return
        stop_at = max(stop, time.monotonic() + RLObjective.MIN_TRIAL_S)
        self._trials(objective_fn, stop_at, n_trials=self._more(1), progress=False)

    def _more(self, k: int) -> int:
        """This worker's trial count after ``k`` more, within ``--n-trials``."""
        n = sum(self.counts.values()) + k
        return n if self.cfg.n_trials is None else min(n, self.cfg.n_trials)

    def _tail_search(self, start_by: float) -> None:
        """The tail's parametric replay trials to the end, unless past ``start_by``."""
        left = self.budget.left()
        if time.monotonic() >= start_by:
            return
        why = "less than a round is left (searching, then validating and checking candidates)"
        before = dict(self.counts)
        t0 = time.monotonic()
        if self.plan.space in ("parametric", "both"):
            self._trials(self._parametric(), self.budget.end)
        c = self._since(before)
        if not sum(c.values()):  # an RL space, the trial limit (--n-trials) reached, no trial fit
            self.result.stopped_early = why
            self.say("export", f"stopping with {format_duration(self.budget.left())} left: {why}")
            return
        self.result.stopped_early = (
            f"{why}; its last {format_duration(time.monotonic() - t0)} went to the replay search: "
            f"{trial_counts(c)} kept "
            "in the study for a resumed search, not validated in this run"
        )
        self.say("export", f"{format_duration(left)} left: {self.result.stopped_early}")

    def _parametric(self) -> ParametricObjective:
        return ParametricObjective(self.bench, self.recorder, self.ledger, self.families)

    def _rl(self, stop: float) -> RLObjective:
        return RLObjective(
            self.bench, self.recorder, self.ledger, stop_at=stop, seed=self.cfg.seed,
            workdir=self.workdir, warm_start=self.cfg.warm_start, warn=self.warn,
        )  # fmt: skip

    def _trials(
        self, objective_fn: Any, stop_at: float, n_trials: int | None = None, progress: bool = True
    ) -> None:
        """Trials until ``stop_at`` or ``n_trials`` of this worker in all (``--n-trials``)."""
        TrialLoop(
            self.study,
            self.ledger,
            worker=self.worker,
            warn=self.warn,
            counts=self.counts,
            n_trials=self.cfg.n_trials if n_trials is None else n_trials,
            progress=self.cfg.progress and progress,
        ).run(objective_fn, stop_at)

    def _since(self, before: dict[str, int]) -> dict[str, int]:
        return {k: self.counts[k] - before[k] for k in self.counts}

    # ------------------------------------------------------------------ validation
    def _validate(self, r: Round) -> bool:
        """Validate what :meth:`_to_validate` orders; True if anything new was."""
        first, validator = r.number == 1, self.validator
        order, rules, trials, agent = self._to_validate(r.candidates)
        if not order:
            return False
        t0 = time.monotonic()

        def note(v: Validated) -> None:
            self._note_validated(trials.get(v.key.number) if v.key.is_trial else None, v)

        # torch, auto and the round's agent in any time left; the others until check_at (a
        # pick's check still fits after it), or in any time left once it has passed
        results: dict[str, Validated] = {}
        keys = [o[0] for o in order]
        cut = keys.index(agent) if agent in keys else len(order)
        groups = [
            ([o for o in order if o[0] in (TORCH, AUTO)], True),
            ([o for o in order[:cut] if o[0] not in (TORCH, AUTO)], False),
            (order[cut : cut + 1], True),
            ([o for o in order[cut + 1 :] if o[0] not in (TORCH, AUTO)], False),
        ]
        for group, any_time in groups:
            late = any_time or r.check_at <= time.monotonic()
            if group:
                until = self.budget.end if late else r.check_at
                results.update(validator.run(group, until, on_done=note))
        self.validated.update(results)
        if not results and not first:  # a later round that fitted nothing says nothing new
            validator.skipped.clear()
            return False
        if self.source is not None:
            msg = self.source.validated_line(self, time.monotonic() - t0)
        else:
            n_cand = sum(1 for k in results if Candidate.parse(k).is_trial)
            n_rules = sum(1 for k in self.validated if Candidate.parse(k).is_rule)
            msg = (
                f"{plural(n_cand, 'candidate')}; auto{'' if self._bar_real() else ' not yet'}; "
                f"{n_rules} of {len(self.plan.rules)} built-in rules so far; on "
                f"{plural(len(validator.names), 'test episode')} x {self.plan.steps} real steps "
                f"in {format_duration(time.monotonic() - t0)}"
            )
        if validator.skipped:
            msg += f"; no time left for: {' | '.join(validator.skipped)}"
            validator.skipped.clear()
        self.say("validate", msg)
        if first:
            self._replay_rules(rules)
        return bool(results)

    def _to_validate(self, k: int) -> tuple[list, list, dict[int, Any], Candidate | None]:
        """(key, label, factory) to validate, in order: torch, auto, the best of the ``k`` best
        candidates not validated yet (and an agent), the other rules and candidates; returns
        (that order, the rules in it, the trials by number, the agent's key or None)."""
        import optuna

        plan = self.plan
        with self.ledger.track("bk:optuna"):
            complete = self.study.get_trials(
                deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)
            )
        done = {c.number for c in map(Candidate.parse, self.validated) if c.is_trial}
        agent = "residual" if self._agent_pending() else None
        candidates = top_candidates(
            complete, plan.suite, self.store, self.workdir, k, self.warn, skip=done, one_of=agent
        )
        order = []
        for t, factory in candidates:
            self.factories[Candidate.trial(t.number)] = factory
            order.append((Candidate.trial(t.number), policy_label(t), factory))
        agents = [
            i for i, (t, _) in enumerate(candidates)
            if t.user_attrs.get("policy", {}).get("kind") == "residual"
        ]  # fmt: skip
        warm = [i for i in agents if candidates[i][0].user_attrs.get("warm_start")]
        first = (warm or agents)[0] if agent and agents else None
        if first is not None and first > 0:  # the agent after the best
            order.insert(1, order.pop(first))
        rules = [
            (Candidate.rule(r), r, self.factories[Candidate.rule(r)])
            for r in plan.rules
            if Candidate.rule(r) not in self.validated
        ]
        bar = [] if self._bar_real() else [(AUTO, AUTO.name, self.factories[AUTO])]
        rules = rules[:1] + bar + rules[1:]
        n = 2 if first is not None else 1  # the agent beside the best
        first_agent = None if first is None else Candidate.trial(candidates[first][0].number)
        order = rules[:2] + order[:n] + rules[2:] + order[n:]
        return order, rules, {t.number: t for t, _ in candidates}, first_agent

    def _replay_rules(self, rules: list) -> None:
        """Score the rules the first round left without real steps on the test replay."""
        for key, label, factory in rules:
            if key not in self.validated:
                cards: dict[str, list] = {}
                with self.ledger.track("work:replay"):
                    for m in self.bench.members:
                        cards[m] = [
                            self.bench.episode("test", factory, ep)[0]
                            for ep in self.bench.member_episodes("test", m)
                            if ep.offset == 0
                        ]
                self.validated[key] = Validated(key, label, cards, False, None)

    def _bar_real(self) -> bool:
        """Whether ``auto`` (the bar) is validated on real steps (replay does not count)."""
        v = self.validated.get(AUTO)
        return v is not None and v.real

    def _note_validated(self, trial, v: Validated) -> None:
        if trial is None:
            return
        import optuna
        from optuna_dashboard import get_note

        with self.ledger.track("bk:notes"):
            try:
                handle = optuna.trial.Trial(self.study, trial._trial_id)
                n, steps = sum(len(c) for c in v.cards.values()), self.plan.steps
                on = (
                    f"real steps** of {n} test episodes x {steps} steps"
                    if v.real
                    else f"the replay** of {n} held-out windows x {steps} recorded steps"
                )
                body = get_note(handle) + f"\n**Validated on {on}.\n"
                write_note(handle, body)
            except Exception as exc:
                self.warn(f"could not update trial {trial.number}'s note: {exc}")

    # ------------------------------------------------------------------ pick and export
    def _pick(self) -> None:
        """Rank, check, export what changed, report (nothing without torch's validation)."""
        if TORCH not in self.validated:
            self.say(
                "export",
                "nothing exported: torch could not be validated on real steps in the budget",
            )
            return
        t0, reference = time.monotonic(), self.validated[TORCH]
        ranked = rank(self.validated, reference, self.plan.suite.reward)
        chosen = self._choose(ranked)
        key = AUTO if chosen is None else chosen.key
        if key != self.exported:  # None only where auto had no real validation: auto itself
            self._export(chosen, reference, t0)
            self.exported = key
        if self.source is None:  # a source's validate line has said the ranking
            self._report(ranked, reference, self.exported)

    def _choose(self, ranked: list[Validated]) -> Validated | None:
        # a source's rows are replay at the horizon itself (no lead to hold there again), and
        # its check always fits its plan, so nothing is exported unchecked
        replay = self.source is not None
        study, families = self.study, self.cfg.families
        choice = choose(
            study,
            ranked,
            self.factories,
            self.no_harm,
            self.plan.timings,
            self.ledger,
            weights=self.plan.suite.reward,
            stop_at=math.inf if replay else self.budget.end,
            say=lambda text: self.say("export", text),
            refuse=(lambda v: family_refusal(v, study, families))
            if replay
            else (
                lambda v: refusal(v, study, families, self.bench, self.factories, self.auto_replays)
            ),
            replay_counts=replay,
        )
        with self.ledger.track("bk:attrs"):  # what `autoscale export` cannot decide again
            record_pick(study, choice, getattr(self.no_harm, "shape", ""))
        self.choice = choice
        # each said once: (what marks it said, the line)
        lines = [
            (text, text)
            for text in (
                f"{self.validated[key].label} leads auto beyond the seed noise, but {why}"
                for key, why in choice.refused.items()
            )
        ]
        # a scaler left unchecked is said once (its seconds left differ from round to round)
        unchecked = [u for u in choice.unchecked if f"unchecked:{u[0]}" not in self.said]
        self.said.update(f"unchecked:{label}" for label, _ in unchecked)
        lines += [(text, text) for text in unchecked_lines(unchecked)]
        # a verdict an earlier run stored: said once, as one reached now was (by choose)
        reused = {id(v) for v in choice.reused}
        self.said.update(f"verdict:{v.label}" for v in choice.verdicts if id(v) not in reused)
        lines += [
            (
                f"verdict:{v.label}",
                f"{v.summary()} (the verdict an earlier run of this check stored)",
            )
            for v in choice.reused
        ]
        if choice.winner is None and choice.bar is None:
            lines.append(("auto unmeasured", f"{choice.why}: " + AUTO_UNMEASURED))
        for mark, text in lines:
            if mark not in self.said:
                self.said.add(mark)
                self.say("export", text)
        return choice.winner

    def _export(self, chosen: Validated | None, reference: Validated, since: float) -> None:
        """Export ``chosen`` (None: ``auto``, unmeasured) with its evidence, and say so."""
        from autoscale.scalers import make_scaler
        from autoscale.scalers.policies import policy_ref
        from autoscale.search.answer import answer_lines, evidence

        cfg, choice, plan, study = self.cfg, self.choice, self.plan, self.study
        provenance = {
            "storage": storage_id(cfg.storage),
            "exported_by": SEARCH_EXPORT,  # (a resumed search may replace it, see export.py)
            **(
                {"searched_on": "replay of recorded real steps"}
                if self.source is None
                else self.source.provenance
            ),
        }
        if chosen is not None:
            where = rows_where(chosen, plan.validation)
            summary = card_summary(chosen.cards, reference.cards, plan.suite.reward, where)
            summary["evidence"] = evidence(choice, chosen, reference, plan.suite.reward)
        else:
            summary = {"evidence": {"why": choice.why, "bar": AUTO.name}}
        if self.source is not None:
            summary.update(self.source.scorecard(self, chosen))
        with (
            self.ledger.track("work:export"),
            file_lock(self.folder / "locks" / f"export-{cfg.export}.lock"),
        ):
            kw = {
                "out_dir": cfg.policy_dir,
                "force": cfg.force,
                "scorecard": summary,
                "provenance": provenance,
            }
            key = AUTO if chosen is None else chosen.key
            path, how = export_candidate(
                study, key, cfg.export, suite=plan.suite, store=self.store, **kw
            )
            make_scaler(str(path), device="cpu")  # it loads
        self.result.exported, self.result.winner = path, f"{cfg.export} ({how})"
        if self.source is not None:
            self.source.exported(self, path, how, chosen, since)
            return
        self.say(
            "export", f"{path} ({how}); use it with autoscale.get_scaler('{policy_ref(path)}')"
        )
        if chosen is None:
            self.result.answer = [f"answer: exported '{cfg.export}' = {how}", f"why: {choice.why}"]
        else:
            self.result.answer = answer_lines(
                cfg.export, how, choice, chosen, reference, plan.suite.reward, plan.steps
            )

    def _report(self, ranked, reference, winner) -> None:
        plan = self.plan
        real = [v for v in ranked if v.real] + [v for v in ranked if not v.real]
        table = comparison_table(real, reference, plan.validation, winner)
        if not plan.suite.is_single:
            table += "\n" + member_table(real, reference, plan.validation)
        limit = limit_block([*real, reference], self.bench.traces, plan.validation)
        table += "".join("\n" + line for line in limit)
        if table == self.result.table:
            return
        self.result.table = table
        self.out(table)
        with self.ledger.track("bk:notes"):
            try:
                write_note(self.study, study_note(self.cfg.study, plan, table))
            except Exception as exc:
                self.warn(f"could not update the study note: {exc}")
        self._comparison_plot(real[:4])

    def _comparison_plot(self, rows: list[Validated]) -> None:
        """A PNG of the real-step trajectories as a study artifact, where time allows."""
        if self.budget.left() + 0.5 * self.budget.reserve < 1.0:
            return
        from matplotlib.figure import Figure  # noqa: F401  (import outside the timed drawing)

        path = self.workdir / "comparison.png"
        first = self.plan.validation.members[0]
        title = f"{self.cfg.study}: {first.name} {first.instances['test'][0].name}, real steps"
        with self.ledger.track("bk:plots"):
            try:
                drawn = draw_comparison(rows, path, title)
            except Exception as exc:
                self.warn(f"could not draw the comparison: {exc}")
                return
        if drawn:
            with self.ledger.track("bk:artifacts"):
                try:
                    store_artifact(self.store, path, self.study, "image/png")
                except Exception as exc:
                    self.warn(f"could not store the comparison plot: {exc}")


def _preload() -> None:
    """Import what storage access loads lazily, so the ledger counts it as start-up."""
    import importlib

    for name in (
        "sqlalchemy.orm",
        "alembic.command",
        "optuna.storages._rdb.models",
        "optuna_dashboard",
    ):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def rules_torch_first(families: Sequence[str] | None = None) -> tuple[str, ...]:
    """The built-in rules a search validates and searches: ``torch`` (the reference) first, then
    ``families`` (None: every family whose scale adapts to the gradients)."""
    rules = list(searched_families(families))
    return tuple([TORCH.name] + [r for r in rules if r != TORCH.name])
