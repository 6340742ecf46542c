"""``autoscale search`` end to end: phases with deadlines, one module each.

1. **measure** real steps of each workload (:mod:`~autoscale.search.plan`);
2. **plan** the search to the budget (a study that exists keeps its stored plan, so every worker
   and every resume scores trials alike);
3. **record** long traces of every member's train and test instances
   (:mod:`~autoscale.search.traces`, cached next to the storage); the worker that creates the
   study then plans what is left again, once, when its steps ran slower than measured
   (:mod:`~autoscale.search.replan`), and stores the plan for good;
4. **search** on replay (:mod:`~autoscale.search.loop`, :mod:`~autoscale.search.trials`);
5. **validate** the best candidates and every built-in rule on real steps of the test instances
   (:mod:`~autoscale.search.validate`, shared between workers through the study);
6. **export** the best of the ranking that passes the no-harm check
   (:mod:`~autoscale.search.choose`, :mod:`~autoscale.search.no_harm`), and print the ranking.

The budget is spent: phases 4-6 run in rounds, and a round that ends with time left gives it to
more trials, more validated candidates and their checks, until less than a round is left (its
last seconds go to replay trials kept in the study) or nothing is left to learn (every candidate
validated and checked); the search says which.

Several workers may run this on one storage: Optuna keeps trials unique; the first worker creates
the study, plans, records and re-plans it; the others wait for the plan it stores, adopt it and
never re-plan it (they bend only their own time to their pace); traces and torch's clean runs are
recorded once per host (locks); each worker validates the study's best candidates not yet
validated, and exports the study-wide pick when it finishes (under a lock), so the last worker to
finish leaves the export.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from autoscale.envs.suite import SuiteSpec, as_suite
from autoscale.search.agent_trials import RLObjective
from autoscale.search.bench import ReplayBench
from autoscale.search.budget import Budget, Ledger, format_duration
from autoscale.search.export import check_export_target
from autoscale.search.no_harm import NO_HARM_STEPS, NoHarmCheck, no_harm_proxy, no_harm_workloads
from autoscale.search.plan import Plan, make_plan
from autoscale.search.replan import (
    MIN_HORIZON,
    SLOW,
    least_after_record,
    pace_of,
    replan,
    retime,
)
from autoscale.search.rounds import Rounds
from autoscale.search.session import SearchConfig, SearchResult, Session
from autoscale.search.space import searched_families
from autoscale.search.storage import (
    artifact_store,
    artifacts_dir,
    mask_url,
    open_storage,
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
    wait_for_plan,
)
from autoscale.search.timing import NoHarmPlan, Timings, measure_all
from autoscale.search.traces import cached_share, keep_planned, load_traces
from autoscale.search.trials import (
    REFERENCE_RULE,
    TrialRecorder,
    worker_id,
)
from autoscale.search.validate import Validator
from autoscale.training.threads import fit_threads

__all__ = ["SearchConfig", "SearchResult", "SearchRunner", "PHASES", "rules_torch_first"]

PHASES = ("measure", "plan", "record", "search", "validate", "export")


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
    """

    def __init__(self, cfg: SearchConfig, budget: Budget, out: Callable[[str], None] | None = None):
        self.cfg, self.budget = cfg, budget
        self.out = out or _print
        self.ledger = Ledger()
        self.worker = worker_id()
        self.creator = False  # this worker created the study: it plans it (see _replan)
        self.counts = {"complete": 0, "pruned": 0, "failed": 0}
        self.min_search_s = max(2.0, 0.02 * budget.seconds)
        if cfg.space != "parametric":  # the first round holds one RL trial (the warm start)
            self.min_search_s = max(self.min_search_s, 2.5 * RLObjective.MIN_TRIAL_S)
        self.result = SearchResult(
            cfg.study, None, self.counts, budget_s=budget.seconds, ledger=self.ledger
        )

    # ------------------------------------------------------------------ messages
    def say(self, phase: str, text: str) -> None:
        self.out(f"[{PHASES.index(phase) + 1}/{len(PHASES)} {phase}] {text}")

    def warn(self, text: str) -> None:
        from tqdm.auto import tqdm

        tqdm.write(f"warning: {text}", file=sys.stderr)

    # ------------------------------------------------------------------ the phases
    def run(self) -> SearchResult:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are said once, here
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        cfg = self.cfg
        # what the export will need is checked before anything is written (the storage, caches)
        check_export_target(cfg.export, cfg.policy_dir, cfg.study, cfg.force)
        _preload()
        with self.ledger.track("bk:optuna"):
            storage = open_storage(cfg.storage)
            stored = (
                optuna.load_study(study_name=cfg.study, storage=storage)
                if cfg.study in study_names(storage)
                else None
            )
        kept = self._adopt(stored) if stored is not None else None
        base = kept[0] if kept is not None else as_suite(cfg.base)
        self.folder = artifacts_dir(cfg.storage, cfg.artifacts)
        store = artifact_store(self.folder)
        self.out(
            f"search {cfg.space} policies for {describe_spec(base)} in {format_duration(self.budget.seconds)}; "
            f"study '{cfg.study}' in {mask_url(cfg.storage)}" + (" (resuming)" if stored else "")
        )

        no_harm_plan = NoHarmPlan(no_harm_workloads(list(base.members)), NO_HARM_STEPS)
        proxies = [p for p in map(no_harm_proxy, no_harm_plan.workloads) if p is not None]
        with self.ledger.track("work:measure"):
            self.threads = fit_threads()  # measured with the threads it records with
            timings = measure_all(
                [m.workload for m in base.members] + list(no_harm_plan.workloads) + proxies,
                limit_s=max(1.0, min(0.25 * self.budget.seconds, self.budget.left())),
                step_share_s=max(0.2, 0.01 * self.budget.seconds),
            )
        self.say("measure", f"{timings.describe()}; {self.threads.describe()}")
        self.no_harm = NoHarmCheck(
            no_harm_plan, self.folder, self.ledger, _scale_kw(base), progress=cfg.progress
        )
        plan = self._plan(base, timings, no_harm_plan, kept)
        study = self._open_study(storage, stored, plan)
        plan = self.result.plan
        # the check the plan fitted to the budget (a model too slow for long runs is checked on
        # its tiny proxy): its cost decides what the rounds leave time for
        self.no_harm = NoHarmCheck(
            plan.no_harm, self.folder, self.ledger, _scale_kw(base), progress=cfg.progress
        )

        with self.ledger.track("work:record"):
            traces, stats = self._record(plan)
        plan, traces = self._replan(study, plan, traces, stats)

        with tempfile.TemporaryDirectory(prefix="autoscale-search-") as tmp:
            workdir = Path(tmp)
            with self.ledger.track("work:replay"):
                bench = ReplayBench(plan.suite, traces)
            recorder = TrialRecorder(bench, store, self.ledger, workdir, self.warn)
            validator = Validator(
                study,
                plan.validation,
                self.ledger,
                plan.timings,
                worker=self.worker,
                progress=cfg.progress,
            )
            session = Session(
                cfg,
                self.budget,
                self.ledger,
                self.result,
                self.counts,
                self.no_harm,
                self.folder,
                self.worker,
                self.min_search_s,
                self.say,
                self.warn,
                self.out,
            )
            Rounds(session, study, plan, bench, recorder, validator, store, workdir).run()
        self.result.wall_s = self.budget.elapsed()
        return self.result

    def _record(self, plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]:
        """Record the plan's traces. The worker that creates the study bends to the pace the
        machine keeps (see :mod:`~autoscale.search.replan`): the instances beyond each member's
        first ones stop where the phases after recording keep their planned time at that pace;
        the first ones (shortened if need be) where the least of those phases keeps its measured
        time. Any other worker records the study's plan whole, or stops where that least begins
        (a BudgetError: what it recorded stays cached)."""
        after = plan.validate_s + plan.no_harm_s
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
        n = sum(len(m.instances["train"]) + len(m.instances["test"]) for m in plan.suite.members)
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

    def _replan(
        self, study: Any, plan: Plan, traces: dict, stats: dict
    ) -> tuple[Plan, dict[str, Any]]:
        """After recording. The worker that created the study plans what is left again when it
        ran slower than measured or left instances out, caches the traces of the new plan under
        its keys, and stores the plan for good (nothing is scored on the study before). Any
        other worker keeps the study's plan and only times its own phases at its pace."""
        if not self.creator:
            new = retime(plan, stats, left_s=self.budget.left(), cached_no_harm=self.no_harm.cached)
            if new is not plan:
                self.say(
                    "plan",
                    f"steps ran {pace_of(stats):.1f}x slower than measured: this worker's phases "
                    "are timed at that pace (the study's plan stays)",
                )
                self._use(new)
            return new, traces
        new = replan(
            plan,
            traces,
            stats,
            left_s=self.budget.left(),
            budget_s=self.budget.seconds,
            min_search_s=self.min_search_s,
            cached_no_harm=self.no_harm.cached,
        )
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
            store_plan(study, None if new is plan else new)  # the workers waiting adopt it
        return new, traces

    def _use(self, plan: Plan) -> None:
        """Go on with ``plan`` (its no-harm check may be another)."""
        self.result.plan = plan
        self.no_harm = NoHarmCheck(
            plan.no_harm,
            self.folder,
            self.ledger,
            _scale_kw(plan.suite),
            progress=self.cfg.progress,
        )

    def _adopt(self, stored: Any) -> tuple[SuiteSpec, SuiteSpec, int]:
        check_source(stored.user_attrs, self.cfg.study)
        kept = wait_for_plan(stored, self._waiting, give_up_at=self.budget.end)
        if self.cfg.explicit:
            check_workload(kept[0], as_suite(self.cfg.base), self.cfg.study)
        return kept

    def _waiting(self, planner: str) -> None:
        self.out(
            f"study '{self.cfg.study}' is being planned by the worker that created it ({planner}): "
            "waiting for the plan it stores after recording"
        )

    def _plan(
        self,
        base: SuiteSpec,
        timings: Timings,
        no_harm: NoHarmPlan,
        kept: tuple[SuiteSpec, SuiteSpec, int] | None,
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
        )
        self.say("plan", plan.describe())
        self.result.plan = plan
        return plan

    def _open_study(self, storage: Any, stored: Any, plan: Plan) -> Any:
        """Create the study (recording its plan), or load it; a worker that loses the race to
        create it adopts the winner's plan."""
        import optuna

        cfg = self.cfg
        before = len(stored.get_trials(deepcopy=False)) if stored is not None else 0
        kwargs = study_kwargs(cfg.seed, before, self.ledger)
        with self.ledger.track("bk:optuna"):
            if stored is not None:
                study = optuna.load_study(study_name=cfg.study, storage=storage, **kwargs)
                stale = fail_stale_trials(study, storage)
                if stale:
                    self.say("plan", f"failed {stale} trial(s) left running by stopped workers")
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
                    self._plan(plan.suite, plan.timings, plan.no_harm, kept)
            study.set_user_attr(
                f"worker:{self.worker}",
                {
                    "command": cfg.command,
                    "budget_s": self.budget.seconds,
                    "started": time.time(),
                    "timing": self.result.plan.timings.to_dict(),
                },
            )
        return study


def _scale_kw(suite: SuiteSpec) -> dict[str, float]:
    ep = suite.episode
    return {"init_scale": ep.init_scale, "min_scale": ep.min_scale, "max_scale": ep.max_scale}


def _preload() -> None:
    """Import what storage access loads lazily, so module imports count as start-up rather than
    as bookkeeping in the ledger."""
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
    return tuple([REFERENCE_RULE] + [r for r in rules if r != REFERENCE_RULE])
