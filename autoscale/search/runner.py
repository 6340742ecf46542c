"""``autoscale search`` end to end: phases with deadlines, one module each.

1. **measure** real steps of each workload (:mod:`~autoscale.search.plan`);
2. **plan** the search to the budget (a study that exists keeps its stored shape, so every worker
   and every resume scores trials alike);
3. **record** long traces of every member's train and test instances
   (:mod:`~autoscale.search.traces`, cached next to the storage);
4. **search** on replay (:mod:`~autoscale.search.loop`, :mod:`~autoscale.search.trials`);
5. **validate** the best candidates and every built-in rule on real steps of the test instances
   (:mod:`~autoscale.search.validate`, shared between workers through the study);
6. **export** the best of the ranking that passes the no-harm check
   (:mod:`~autoscale.search.choose`, :mod:`~autoscale.search.gate`), and print the ranking.

The budget is spent: phases 4-6 run in rounds, and a round that ends with time left gives it to
more trials, more validated candidates and their checks, until less than a round is left or
nothing is left to learn (every candidate validated and checked); the search then says so.

Several workers may run this on one storage: Optuna keeps trials unique; the first worker creates
the study and its plan, the others adopt it; traces and torch's clean runs are recorded once per
host (locks); each worker validates the study's best candidates not yet validated, and exports
the study-wide pick when it finishes (under a lock), so the last worker to finish leaves the export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoscale.envs.suite import SuiteSpec, as_suite
from autoscale.errors import BudgetError
from autoscale.search.bench import ReplayBench
from autoscale.search.budget import Budget, Ledger, format_duration
from autoscale.search.choose import choose
from autoscale.search.export import (
    card_summary,
    check_export_target,
    export_rule,
    export_trial,
    policy_label,
    rank,
    study_suites,
    top_candidates,
)
from autoscale.search.gate import GATE_STEPS, NoHarmCheck, gate_proxy, gate_workloads
from autoscale.search.loop import TrialLoop
from autoscale.search.plan import GATE_CANDIDATES, Plan, make_plan
from autoscale.search.replan import MIN_HORIZON, SLOW, least_after_record, pace_of, replan
from autoscale.search.report import comparison_table, draw_comparison, member_table
from autoscale.search.space import parametric_families
from autoscale.search.storage import (
    DEFAULT_STORAGE,
    artifact_store,
    artifacts_dir,
    file_lock,
    mask_url,
    open_storage,
    study_names,
)
from autoscale.search.study import (
    check_workload,
    describe_new_study,
    describe_spec,
    fail_stale_trials,
    store_plan,
    study_kwargs,
    study_note,
    wait_for_plan,
)
from autoscale.search.timing import GatePlan, Timings, measure_all
from autoscale.search.traces import cached_share, load_traces
from autoscale.search.trials import (
    REFERENCE_RULE,
    ParametricObjective,
    RLObjective,
    TrialRecorder,
    store_artifact,
    worker_id,
    write_note,
)
from autoscale.search.validate import PREFIX as VALIDATED_PREFIX
from autoscale.search.validate import Validated, Validator
from autoscale.training.threads import fit_threads

__all__ = ["SearchConfig", "SearchResult", "SearchRunner", "PHASES"]

PHASES = ("measure", "plan", "record", "search", "validate", "export")
CANDIDATES_PER_ROUND = 3  # candidates validated per round (the best first)
MAX_ROUNDS = 12
MIN_ROUND_SHARE = 0.05  # a round needs at least this share of the budget to start
RL_SHARE_OF_BOTH = 0.7  # with --space both, RL gets this share of the search time


@dataclass
class SearchConfig:
    """What ``autoscale search`` was asked for (strings already turned into objects).

    Attributes:
        base: The env spec or suite of the workloads (reshaped by the plan).
        explicit: The user named the workload (``--env``/``--model``/``--scenario``); a study
            that exists must then have those workloads, else its own are adopted.
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
    replanned: list[str] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)


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
        self.counts = {"complete": 0, "pruned": 0, "failed": 0}
        self.min_search_s = max(2.0, 0.02 * budget.seconds)
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

        gate_plan = GatePlan(gate_workloads(list(base.members)), GATE_STEPS)
        proxies = [p for p in map(gate_proxy, gate_plan.workloads) if p is not None]
        with self.ledger.track("work:measure"):
            self.threads = fit_threads()  # measured with the threads it records with
            timings = measure_all(
                [m.workload for m in base.members] + list(gate_plan.workloads) + proxies,
                limit_s=max(1.0, min(0.25 * self.budget.seconds, self.budget.left())),
                step_share_s=max(0.2, 0.01 * self.budget.seconds),
            )
        self.say("measure", f"{timings.describe()}; {self.threads.describe()}")
        self.gate = NoHarmCheck(
            gate_plan, self.folder, self.ledger, _scale_kw(base), progress=cfg.progress
        )
        plan = self._plan(base, timings, gate_plan, kept)
        study = self._open_study(storage, stored, plan)
        plan = self.result.plan
        # the check the plan fitted to the budget (a model too slow for long runs is checked on
        # its tiny proxy): its cost decides what the rounds leave time for
        self.gate = NoHarmCheck(
            plan.gate, self.folder, self.ledger, _scale_kw(base), progress=cfg.progress
        )

        with self.ledger.track("work:record"):
            traces, stats = self._record(plan)
        plan = self._replan(study, plan, traces, stats)

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
            self._rounds(study, plan, bench, recorder, validator, store, workdir)
        self.result.wall_s = self.budget.elapsed()
        return self.result

    def _record(self, plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]:
        """Record the plan's traces, bending to the pace the machine keeps (see
        :mod:`~autoscale.search.replan`): the instances beyond each member's first ones stop
        where the phases after recording keep their planned time at that pace; the first ones
        (shortened if need be) where the least of those phases keeps its measured time."""
        after = plan.validate_s + plan.gate_s
        least = least_after_record(plan, self.gate.cached) + self.min_search_s

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
            stop_at=lambda pace: self.budget.end - max(1.0, pace) * after,
            floor_at=self.budget.end - least,
            shrink_to=MIN_HORIZON,
            progress=self.cfg.progress,
            warn=self.warn,
            on_slow=retune,
        )
        n = sum(len(m.instances["train"]) + len(m.instances["test"]) for m in plan.suite.members)
        pace = pace_of(stats)
        slower = f" ({pace:.1f}x the measured time)" if pace > SLOW else ""
        self.say(
            "record",
            f"{n} instances x {plan.trace_steps} real steps: {stats['recorded']} recorded "
            f"in {format_duration(stats['wall_s'])}{slower}, {stats['cached']} from the cache"
            + (f", {len(stats['dropped'])} left out" if stats["dropped"] else ""),
        )
        return traces, stats

    def _replan(self, study: Any, plan: Plan, traces: dict, stats: dict) -> Plan:
        """Plan what is left after recording again when it ran slower than measured or left
        instances out; the study keeps the new shape when nothing was scored on the old one."""
        import optuna

        with self.ledger.track("bk:optuna"):
            attrs = study.user_attrs
            scored = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            stored_suite, stored_validation, stored_steps = study_suites(study)
        if stored_suite != plan.suite:  # another worker re-planned while this one recorded
            self.say(
                "plan", "another worker re-planned the study while recording: adopting its plan"
            )
            plan = dataclasses.replace(
                plan, suite=stored_suite, validation=stored_validation, trace_steps=stored_steps
            )
            traces.update(_only_planned(traces, stored_suite))
            stats = {**stats, "dropped": []}
        new = replan(
            plan,
            traces,
            stats,
            left_s=self.budget.left(),
            budget_s=self.budget.seconds,
            min_search_s=self.min_search_s,
            cached_gate=self.gate.cached,
            keep_validation=any(k.startswith(VALIDATED_PREFIX) for k in attrs),
        )
        if new is plan:
            return plan
        traded = new.cuts[len(plan.cuts) :]
        changed = new.suite != plan.suite or new.validation != plan.validation
        if changed and scored:  # trials were scored on the stored shape: keep it
            if new.suite != stored_suite:
                raise BudgetError(_ran_out_shared(stats))
            new = dataclasses.replace(new, validation=stored_validation)
        self.say("plan", "re-planned: " + ("; ".join(traded) or "steps ran slower than measured"))
        self.result.plan = new
        self.result.replanned = list(traded)
        self.gate = NoHarmCheck(
            new.gate, self.folder, self.ledger, _scale_kw(new.suite), progress=self.cfg.progress
        )
        if changed and not scored:
            with self.ledger.track("bk:optuna"):
                store_plan(study, new)
        return new

    def _adopt(self, stored: Any) -> tuple[SuiteSpec, SuiteSpec, int]:
        kept = wait_for_plan(stored)
        if self.cfg.explicit:
            check_workload(kept[0], as_suite(self.cfg.base), self.cfg.study)
        return kept

    def _plan(
        self,
        base: SuiteSpec,
        timings: Timings,
        gate: GatePlan,
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
            gate=gate,
            space=self.cfg.space,
            rules=_rules_torch_first(),
            cached_traces=cached,
            cached_gate=self.gate.cached,
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
                    describe_new_study(study, plan, command=cfg.command, budget=budget)
                except optuna.exceptions.DuplicatedStudyError:  # another worker was faster
                    study = optuna.load_study(study_name=cfg.study, storage=storage, **kwargs)
                    self.say("plan", "another worker created the study first: adopting its plan")
                    self._plan(plan.suite, plan.timings, plan.gate, wait_for_plan(study))
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

    # ------------------------------------------------------------------ rounds
    def _rounds(self, study, plan: Plan, bench, recorder, validator, store, workdir: Path) -> None:
        """Search, validate, pick and export; then again while a round fits in the time left,
        and the last slack goes to validating more candidates (see the module docstring)."""
        validated: dict[str, Validated] = {}
        factories: dict[str, Callable[[], Any]] = {
            f"rule:{r}": (lambda r=r: bench.scaler(r)) for r in plan.rules
        }
        state = {"exported": None}
        min_search = self.min_search_s
        for round_no in range(1, MAX_ROUNDS + 1):
            self.result.rounds = round_no
            first = round_no == 1
            # what this round leaves time for after its search: validating candidates (the best
            # few and the rules in the first round, the new best in later ones) and checking
            # its pick
            rules_left = [r for r in plan.rules if f"rule:{r}" not in validated]
            n_rules = len(rules_left) if plan.all_rules_real else min(1, len(rules_left))
            k = CANDIDATES_PER_ROUND if first else 1
            after = validator.cost(k + (n_rules if first else 0)) + 1.2 * self.gate.cost(
                plan.timings, GATE_CANDIDATES if first else 1
            )
            if not first and self.budget.left() < after + min_search:
                self._tail(
                    study, plan, bench, validator, store, workdir, validated, factories, state
                )
                break
            least = validator.cost(2) + 1.2 * self.gate.cost(plan.timings, 1)
            stop = search_stop(time.monotonic(), self.budget.end, after, least, min_search, first)
            self._search(study, plan, bench, recorder, stop, workdir, first)
            new = self._validate(
                study, plan, bench, validator, store, workdir, validated, factories, first, k
            )
            if not self._pick(study, plan, validated, factories, store, workdir, state):
                return
            if not new and self._exhausted(study, plan):
                self.result.stopped_early = (
                    "every candidate of the study is validated and checked: nothing left to learn"
                )
                self.say(
                    "export",
                    f"stopping with {format_duration(self.budget.left())} left: "
                    f"{self.result.stopped_early}",
                )
                return

    def _tail(
        self, study, plan, bench, validator, store, workdir, validated, factories, state
    ) -> None:
        """Less than a round is left: validate more of the best candidates in it, pick again, and
        say what is left unused."""
        new = self._validate(
            study,
            plan,
            bench,
            validator,
            store,
            workdir,
            validated,
            factories,
            False,
            CANDIDATES_PER_ROUND,
        )
        if new:
            self._pick(study, plan, validated, factories, store, workdir, state)
        left = self.budget.left()
        if left > MIN_ROUND_SHARE * self.budget.seconds:
            self.result.stopped_early = (
                "less than a round is left (searching, then validating and checking candidates)"
            )
            self.say(
                "export", f"stopping with {format_duration(left)} left: {self.result.stopped_early}"
            )

    def _pick(self, study, plan, validated, factories, store, workdir, state) -> bool:
        """Rank, check, export what changed, report; False when torch has no validation."""
        if "rule:torch" not in validated:
            self.say(
                "export",
                "nothing exported: torch could not be validated on real steps in the budget",
            )
            return False
        reference = validated["rule:torch"]
        ranked = rank(validated, reference, plan.suite.reward)
        chosen = self._choose(study, plan, ranked, factories, state)
        if chosen is not None and chosen.key != state["exported"]:
            self._export(study, plan, chosen, reference, store)
            state["exported"] = chosen.key
        self._report(study, plan, ranked, reference, state["exported"], workdir, store)
        return True

    def _exhausted(self, study, plan: Plan) -> bool:
        """No trial to run (``--n-trials`` reached) and none left to validate."""
        return self.cfg.n_trials is not None and sum(self.counts.values()) >= self.cfg.n_trials

    # ------------------------------------------------------------------ search
    def _search(
        self, study, plan: Plan, bench, recorder, stop: float, workdir: Path, first: bool
    ) -> None:
        now = time.monotonic()
        if stop - now < 1.0:
            if first:
                self.say(
                    "search",
                    "no time left to search after validation's share; validating what the study has",
                )
            return
        t0 = time.monotonic()
        before = dict(self.counts)
        if plan.space in ("parametric", "both"):
            objective_fn = ParametricObjective(bench, recorder, self.ledger, parametric_families())
            until = (
                stop if plan.space == "parametric" else t0 + (1 - RL_SHARE_OF_BOTH) * (stop - t0)
            )
            self._trials(study, objective_fn, until)
        if plan.space in ("rl", "both"):
            objective_fn = RLObjective(
                bench, recorder, self.ledger, stop_at=stop, seed=self.cfg.seed, workdir=workdir
            )
            self._trials(study, objective_fn, stop - RLObjective.MIN_TRIAL_S / 2)
        c = {k: self.counts[k] - before[k] for k in self.counts}
        self.say(
            "search",
            f"{sum(c.values())} trials in {format_duration(time.monotonic() - t0)} ({c['complete']} complete, "
            f"{c['pruned']} pruned, {c['failed']} failed); {_best_line(study)}",
        )

    def _trials(self, study, objective_fn, stop_at: float) -> None:
        TrialLoop(
            study,
            self.ledger,
            worker=self.worker,
            warn=self.warn,
            counts=self.counts,
            n_trials=self.cfg.n_trials,
            progress=self.cfg.progress,
        ).run(objective_fn, stop_at)

    # ------------------------------------------------------------------ validation
    def _validate(
        self, study, plan: Plan, bench, validator, store, workdir, validated, factories, first, k
    ) -> bool:
        """Validate torch, the ``k`` best candidates not validated yet and the rules (first
        round); True if anything new was."""
        import optuna

        with self.ledger.track("bk:optuna"):
            complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        done = {int(k.split(":")[1]) for k in validated if k.startswith("trial:")}
        candidates = top_candidates(complete, plan.suite, store, workdir, k, self.warn, skip=done)
        trials = {t.number: t for t, _ in candidates}
        order = []
        for t, factory in candidates:
            factories[f"trial:{t.number}"] = factory
            order.append((f"trial:{t.number}", policy_label(t), factory))
        rules = [
            (f"rule:{r}", r, factories[f"rule:{r}"])
            for r in plan.rules
            if f"rule:{r}" not in validated
        ]
        # torch first (every objective is measured against it), then the best candidate, the
        # other rules, the other candidates
        order = rules[:1] + order[:1] + rules[1:] + order[1:]
        if not order:
            return False
        t0 = time.monotonic()
        results = validator.run(
            order,
            self.budget.end - 1.2 * self.gate.cost(plan.timings, 1),
            on_done=lambda v: self._note_validated(
                study, trials.get(int(v.key[6:])) if v.key.startswith("trial:") else None, v, plan
            ),
        )
        validated.update(results)
        if not results and not first:  # a later round that fitted nothing says nothing new
            validator.skipped.clear()
            return False
        n_cand = sum(1 for k in results if k.startswith("trial:"))
        n_rules = sum(1 for k in validated if k.startswith("rule:"))
        msg = (
            f"{n_cand} candidate(s); {n_rules} of {len(plan.rules)} built-in rules so far; on "
            f"{len(validator.names)} test episodes x {plan.steps} real steps in {format_duration(time.monotonic() - t0)}"
        )
        if validator.skipped:
            msg += f"; no time left for: {' | '.join(validator.skipped)}"
            validator.skipped.clear()
        self.say("validate", msg)
        if first:  # rules without real steps: replay of the test instances, marked so
            for key, label, factory in rules:
                if key not in validated:
                    cards: dict[str, list] = {}
                    with self.ledger.track("work:replay"):
                        for m in bench.members:
                            cards[m] = [
                                bench.episode("test", factory, ep)[0]
                                for ep in bench.member_episodes("test", m)
                                if ep.offset == 0
                            ]
                    validated[key] = Validated(key, label, cards, False, None)
        return bool(results)

    def _note_validated(self, study, trial, v: Validated, plan: Plan) -> None:
        if trial is None:
            return
        import optuna
        from optuna_dashboard import get_note

        with self.ledger.track("bk:notes"):
            try:
                handle = optuna.trial.Trial(study, trial._trial_id)
                body = get_note(handle)
                body += (
                    f"\n**Validated on real steps** of {sum(len(c) for c in v.cards.values())} test "
                    f"episodes x {plan.steps} steps.\n"
                )
                write_note(handle, body)
            except Exception as exc:
                self.warn(f"could not update trial {trial.number}'s note: {exc}")

    # ------------------------------------------------------------------ pick and export
    def _choose(
        self, study, plan: Plan, ranked: list[Validated], factories, state
    ) -> Validated | None:
        best = ranked[0]
        if best.key.startswith("rule:") and state.get("said_first") != best.key:
            state["said_first"] = best.key
            self.say(
                "export",
                f"the built-in rule '{best.label}' ranks first on the validation episodes: "
                + (
                    "it is the reference"
                    if best.key == "rule:torch"
                    else "exporting it (its defaults) if it does no harm"
                ),
            )
        choice = choose(
            study,
            [v for v in ranked if v.real],
            factories,
            self.gate,
            plan.timings,
            self.ledger,
            stop_at=self.budget.end,
            say=lambda text: self.say("export", text),
        )
        for text in choice.unchecked:
            if text not in state.setdefault("said_unchecked", set()):
                state["said_unchecked"].add(text)
                self.say("export", f"not checked: {text}")
        if choice.winner is None and state.get("said_none") is None:
            state["said_none"] = True
            self.say(
                "export",
                "nothing exported: no validated candidate or rule passed the no-harm check",
            )
        return choice.winner

    def _export(self, study, plan: Plan, chosen: Validated, reference: Validated, store) -> None:
        from autoscale.scalers import get_scaler

        cfg = self.cfg
        where = f"real steps: {sum(len(c) for c in chosen.cards.values())} test episodes of {plan.steps} steps"
        summary = card_summary(chosen.cards, reference.cards, plan.suite.reward, where)
        provenance = {
            "storage": mask_url(cfg.storage),
            "searched_on": "replay of recorded real steps",
        }
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
            if chosen.key.startswith("rule:"):
                rule = chosen.key.split(":", 1)[1]
                path = export_rule(study, rule, cfg.export, suite=plan.suite, **kw)
                how = f"the built-in rule {rule} with its defaults"
            else:
                trial = study.trials[int(chosen.key.split(":", 1)[1])]
                path = export_trial(study, trial, cfg.export, suite=plan.suite, store=store, **kw)
                how = policy_label(trial)
            get_scaler(str(path), device="cpu")  # it loads
        self.result.exported, self.result.winner = path, f"{cfg.export} ({how})"
        self.result.builtin = chosen.key.startswith("rule:")
        self.say("export", f"{path} ({how}); use it with autoscale.get_scaler('{cfg.export}')")

    def _report(self, study, plan: Plan, ranked, reference, winner, workdir: Path, store) -> None:
        real = [v for v in ranked if v.real] + [v for v in ranked if not v.real]
        table = comparison_table(real, reference, plan.validation, winner)
        if not plan.suite.is_single:
            table += "\n" + member_table(real, reference, plan.validation)
        if table == self.result.table:
            return
        self.result.table = table
        self.out(table)
        with self.ledger.track("bk:notes"):
            try:
                write_note(study, study_note(self.cfg.study, plan, table))
            except Exception as exc:
                self.warn(f"could not update the study note: {exc}")
        self._comparison_plot(study, real[:4], workdir, store)

    def _comparison_plot(self, study, rows: list[Validated], workdir: Path, store) -> None:
        """A PNG of the real-step trajectories, kept as a study artifact, where time and the
        bookkeeping share (about 0.3 s a figure) allow."""
        if self.budget.left() + 0.5 * self.budget.reserve < 1.0:
            return
        from matplotlib.figure import Figure  # noqa: F401  (import outside the timed drawing)

        path = workdir / "comparison.png"
        first = self.result.plan.validation.members[0]
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
                    store_artifact(store, path, study, "image/png")
                except Exception as exc:
                    self.warn(f"could not store the comparison plot: {exc}")


def _only_planned(traces: dict[str, Any], suite: SuiteSpec) -> dict[str, Any]:
    """Each member's trace with the instances ``suite`` plans (a worker that adopts a smaller
    plan may have recorded more)."""
    out = {}
    for m in suite.members:
        trace = traces[m.name]
        keep = {i.name for i in m.instances["train"] + m.instances["test"]}
        instances = {k: v for k, v in trace.instances.items() if k in keep}
        out[m.name] = dataclasses.replace(trace, instances=instances)
    return out


def _ran_out_shared(stats: dict[str, Any]) -> str:
    return (
        f"the budget ran out while recording traces ({stats['recorded']} recorded, "
        f"{len(stats['dropped'])} left out, steps at {pace_of(stats):.1f}x the measured time), "
        "and trials of this study were scored on all of them; they stay cached: rerun with a "
        "larger --budget and the same --study to continue"
    )


def search_stop(
    now: float, end: float, after: float, least: float, min_search: float, first: bool
) -> float:
    """When a round's search stops: early enough to leave ``after`` seconds for the round's
    validation and check. When phases before it overran (recording a slow model under load), the
    first round still searches ``min_search`` seconds (replay trials are cheap) as long as the
    ``least`` a round can do after it still fits (torch and one candidate validated, one check);
    what it validates then is cut to the time left, as the validator does."""
    stop = end - after
    if first and stop - now < min_search:
        stop = max(stop, min(now + min_search, end - least))
    return stop


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


def _rules_torch_first() -> tuple[str, ...]:
    rules = list(parametric_families())
    return tuple([REFERENCE_RULE] + [r for r in rules if r != REFERENCE_RULE])


def _best_line(study: Any) -> str:
    try:
        best = study.best_trial
    except ValueError:
        return "no completed trial yet"
    p = best.user_attrs.get("policy", {})
    what = p.get("rule") or f"{p.get('algo')} agent"
    return f"best: trial {best.number} ({what}), objective {best.value:+.4f} on the train replay"
