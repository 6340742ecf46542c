"""``autoscale search`` end to end: a budgeted plan in six phases, each with a deadline.

1. **measure** a few real steps of the workload (:func:`~autoscale.search.plan.measure`);
2. **plan** the search to the budget (:func:`~autoscale.search.plan.make_plan`); a study that
   exists keeps its stored shape, so every worker and every resume scores trials alike;
3. **record** traces of the train and test instances (cached next to the storage);
4. **search** on replay: parametric trials stop once bookkeeping reaches
   :data:`BOOKKEEPING_SHARE` of the run's projected wall time (a replay trial costs milliseconds,
   its storage writes more: past that, trials cost more bookkeeping than search), RL trials fill
   the search time; the time not used flows to validation;
5. **validate** the best few candidates and every built-in rule on real steps of the test
   instances (episodes shared between workers through the study);
6. **export** the study's best validated trial, print it against every built-in rule.

Several workers may run this on one storage: Optuna keeps trials unique; the first worker creates
the study and its plan, the others adopt it; traces are recorded once per host (locks); each
worker validates the study's best candidates not yet validated, and exports the study-wide best
validated trial when it finishes (under a lock), so the last worker to finish leaves the export.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoscale.envs.spec import EnvSpec
from autoscale.errors import ConfigError
from autoscale.search.budget import Budget, Ledger, format_duration
from autoscale.search.export import (
    best_trial,
    card_summary,
    check_export_target,
    export_trial,
    policy_label,
    top_candidates,
)
from autoscale.search.loop import TrialLoop
from autoscale.search.plan import Plan, Timing, make_plan, measure, validate_cost
from autoscale.search.report import comparison_rows, comparison_table, draw_comparison
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
    study_kwargs,
    study_note,
    wait_for_spec,
)
from autoscale.search.traces import cached_share, load_traces
from autoscale.search.trials import (
    REFERENCE_RULE,
    ParametricObjective,
    ReplayBench,
    RLObjective,
    TrialRecorder,
    store_artifact,
    worker_id,
    write_note,
)
from autoscale.search.validate import Validated, Validator, real_cards

__all__ = ["SearchConfig", "SearchResult", "SearchRunner", "PHASES", "BOOKKEEPING_SHARE"]

PHASES = ("measure", "plan", "record", "search", "validate", "export")
BOOKKEEPING_SHARE = 0.03  # parametric trials stop when bookkeeping reaches this share of the run
MAX_CANDIDATES = 5
MIN_SEARCH_SHARE = 0.10  # the search gets at least this share of the budget when it can
RL_SHARE_OF_BOTH = 0.7  # with --space both, RL gets this share of the search time


@dataclass
class SearchConfig:
    """What ``autoscale search`` was asked for (strings already turned into objects).

    Attributes:
        base: The env spec of the workload (reshaped by the plan).
        explicit: The user named the workload (``--env``/``--model``/``--scenario``); a study
            that exists must then have that workload, else its own is adopted.
    """

    base: EnvSpec
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
    exported: Path | None = None
    table: str = ""
    wall_s: float = 0.0
    budget_s: float = 0.0
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

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        cfg = self.cfg
        _preload()
        with self.ledger.track("bk:optuna"):
            storage = open_storage(cfg.storage)
            stored = (
                optuna.load_study(study_name=cfg.study, storage=storage)
                if cfg.study in study_names(storage)
                else None
            )
        base = self._adopt(stored) if stored is not None else cfg.base
        folder = artifacts_dir(cfg.storage, cfg.artifacts)
        store = artifact_store(folder)
        check_export_target(cfg.export, cfg.policy_dir, cfg.study, cfg.force)
        self.out(
            f"search {cfg.space} policies for {describe_spec(base)} in {format_duration(self.budget.seconds)}; "
            f"study '{cfg.study}' in {mask_url(cfg.storage)}"
            + (" (resuming)" if stored is not None else "")
        )

        with self.ledger.track("work:measure"):
            timing = measure(
                base.workload,
                limit_s=max(1.0, min(0.25 * self.budget.seconds, self.budget.left())),
                step_share_s=max(0.2, 0.01 * self.budget.seconds),
            )
        self.say("measure", timing.describe())

        rules = _rules_torch_first()
        plan = self._plan(base, timing, rules, folder, reshape=stored is None)
        study = self._open_study(storage, stored, plan, folder)
        plan = self.result.plan
        spec = plan.spec

        with self.ledger.track("work:record"):
            trace, stats = load_traces(
                spec,
                folder,
                timing=timing,
                stop_at=self.budget.end - validate_cost(spec, timing, 2),
                progress=cfg.progress,
            )
        timing = _refine(timing, stats)
        n = len(trace.instances)
        self.say(
            "record",
            f"{n} instances x {spec.episode.steps} real steps: {stats['recorded']} recorded "
            f"in {format_duration(stats['wall_s'])}, {stats['cached']} from the cache",
        )

        with tempfile.TemporaryDirectory(prefix="autoscale-search-") as tmp:
            workdir = Path(tmp)
            with self.ledger.track("work:replay"):
                bench = ReplayBench(spec, trace)
            recorder = TrialRecorder(bench, store, self.ledger, workdir, self.warn)
            self._search(study, plan, bench, recorder, timing, workdir)
            validated = self._validate(study, plan, bench, store, timing, workdir)
            self._finish(study, plan, validated, store, workdir)
        self.result.wall_s = self.budget.elapsed()
        return self.result

    def _adopt(self, stored: Any) -> EnvSpec:
        spec = wait_for_spec(stored)
        if self.cfg.explicit:
            check_workload(spec, self.cfg.base, self.cfg.study)
        return spec

    def _plan(
        self, base: EnvSpec, timing: Timing, rules: tuple[str, ...], folder: Path, *, reshape: bool
    ) -> Plan:
        plan = make_plan(
            base,
            timing,
            self.budget.left(),
            space=self.cfg.space,
            rules=rules,
            cached=lambda s: cached_share(s, folder),
            reshape=reshape,
        )
        self.say("plan", plan.describe())
        self.result.plan = plan
        return plan

    def _open_study(self, storage: Any, stored: Any, plan: Plan, folder: Path) -> Any:
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
                    self.say(
                        "plan", f"failed {stale} trial(s) left running by stopped workers here"
                    )
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
                    spec = wait_for_spec(study)
                    self._plan(spec, plan.timing, plan.rules, folder, reshape=False)
            study.set_user_attr(
                f"worker:{self.worker}",
                {
                    "command": cfg.command,
                    "budget_s": self.budget.seconds,
                    "started": time.time(),
                    "timing": self.result.plan.to_dict()["timing"],
                },
            )
        return study

    # ------------------------------------------------------------------ search
    def _search(self, study, plan: Plan, bench, recorder, timing: Timing, workdir: Path) -> None:
        spec = plan.spec
        names = [i.name for i in spec.instances["test"]]
        with self.ledger.track("bk:attrs"):
            attrs = study.user_attrs
        pending = [r for r in plan.rules if len(real_cards(attrs, f"rule:{r}", names)) < len(names)]
        # Validation's share: the candidate and every rule not yet validated (or, in a plan that
        # cannot afford them all, the candidate and torch), plus room for more candidates. When
        # the phases before ran slower than measured, the search still gets MIN_SEARCH_SHARE of
        # the budget: validation adapts (a rule that no longer fits is shown on replay).
        must = validate_cost(spec, timing, 1 + min(1, len(pending)))
        need = validate_cost(
            spec, timing, 1 + (len(pending) if plan.all_rules_real else min(1, len(pending)))
        )
        one = validate_cost(spec, timing, 1)
        now, end = time.monotonic(), self.budget.end
        extra = min((MAX_CANDIDATES - 1) * one, 0.15 * max(0.0, end - now - need))
        floor = min(now + MIN_SEARCH_SHARE * self.budget.seconds, end - must)
        stop = max(end - need - extra, floor)
        if stop - now < 1.0:
            self.say(
                "search",
                "no time left to search after validation's share; validating what the study has",
            )
            return
        t0 = time.monotonic()
        if plan.space in ("parametric", "both"):
            objective_fn = ParametricObjective(bench, recorder, self.ledger, parametric_families())
            until = (
                stop if plan.space == "parametric" else t0 + (1 - RL_SHARE_OF_BOTH) * (stop - t0)
            )
            # the run without more trials: what is done, and validation's share after them
            projected = self.budget.elapsed() + (end - stop)
            self._trials(
                study, objective_fn, until, bookkeeping_cap_s=BOOKKEEPING_SHARE * projected
            )
        if plan.space in ("rl", "both"):
            objective_fn = RLObjective(
                bench, recorder, self.ledger, stop_at=stop, seed=self.cfg.seed, workdir=workdir
            )
            self._trials(study, objective_fn, stop - RLObjective.MIN_TRIAL_S / 2)
        c = self.counts
        best = _best_line(study)
        self.say(
            "search",
            f"{sum(c.values())} trials in {format_duration(time.monotonic() - t0)} ({c['complete']} complete, "
            f"{c['pruned']} pruned, {c['failed']} failed); {best}",
        )

    def _trials(
        self, study, objective_fn, stop_at: float, *, bookkeeping_cap_s: float = float("inf")
    ) -> None:
        TrialLoop(
            study,
            self.ledger,
            worker=self.worker,
            warn=self.warn,
            counts=self.counts,
            n_trials=self.cfg.n_trials,
            bookkeeping_cap_s=bookkeeping_cap_s,
            min_trials=len(parametric_families()) + 4,
            progress=self.cfg.progress,
        ).run(objective_fn, stop_at)

    # ------------------------------------------------------------------ validation
    def _validate(
        self, study, plan: Plan, bench, store, timing: Timing, workdir: Path
    ) -> dict[str, Validated]:
        import optuna

        from autoscale.agents.evaluate import scaler_for

        spec = plan.spec
        with self.ledger.track("bk:optuna"):
            complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        candidates = [
            (f"trial:{t.number}", policy_label(t), factory)
            for t, factory in top_candidates(
                complete, spec, store, workdir, MAX_CANDIDATES, self.warn
            )
        ]
        rules = [(f"rule:{r}", r, lambda r=r: scaler_for(r, spec)) for r in plan.rules]
        order = candidates[:1] + rules + candidates[1:]
        trials_by_key = {f"trial:{t.number}": t for t in complete}
        validator = Validator(
            study, spec, self.ledger, timing, worker=self.worker, progress=self.cfg.progress
        )
        t0 = time.monotonic()
        results = validator.run(
            order,
            self.budget.end,
            on_done=lambda v: self._note_validated(study, trials_by_key.get(v.key), v, spec),
        )
        n_cand = sum(1 for k in results if k.startswith("trial:"))
        n_rules = sum(1 for k in results if k.startswith("rule:"))
        msg = (
            f"{n_cand} candidate(s) and {n_rules} of {len(plan.rules)} built-in rules on {len(spec.instances['test'])} "
            f"test instances x {spec.episode.steps} real steps in {format_duration(time.monotonic() - t0)}"
        )
        if validator.skipped:
            msg += f"; no time left for: {' | '.join(validator.skipped)}"
        self.say("validate", msg)
        for key, label, factory in rules:  # rules without real steps: replay of the real test steps
            if key not in results:
                with self.ledger.track("work:replay"):
                    cards, records = bench.run("test", factory)
                names = bench.instances("test")
                results[key] = Validated(
                    key, label, [cards[n] for n in names], False, records[names[0]]
                )
        return results

    def _note_validated(self, study, trial, v: Validated, spec: EnvSpec) -> None:
        if trial is None:
            return
        import optuna
        from optuna_dashboard import get_note

        with self.ledger.track("bk:notes"):
            try:
                handle = optuna.trial.Trial(study, trial._trial_id)
                body = get_note(handle)
                body += (
                    f"\n**Validated on real steps** of {len(v.cards)} test instances x {spec.episode.steps} steps: "
                    f"objective {v.objective(spec.reward):.4f}.\n"
                )
                write_note(handle, body)
            except Exception as exc:
                self.warn(f"could not update trial {trial.number}'s note: {exc}")

    # ------------------------------------------------------------------ export and report
    def _finish(
        self, study, plan: Plan, validated: dict[str, Validated], store, workdir: Path
    ) -> None:
        from autoscale.scalers import get_scaler

        cfg, spec, weights = self.cfg, plan.spec, plan.spec.reward
        winner = None
        try:
            with self.ledger.track("bk:attrs"):
                trial, cards, how = best_trial(study, spec)
            winner = (trial, cards) if cards is not None else None
        except ConfigError:
            pass
        own = None
        if winner is None:
            self.say("export", "nothing exported: no candidate completed validation on real steps")
        else:
            trial, cards = winner
            label = f"{cfg.export} ({policy_label(trial)})"
            where = f"real steps: {len(cards)} test episodes of {spec.episode.steps} steps"
            with (
                self.ledger.track("work:export"),
                file_lock(
                    artifacts_dir(cfg.storage, cfg.artifacts)
                    / "locks"
                    / f"export-{cfg.export}.lock"
                ),
            ):
                path = export_trial(
                    study,
                    trial,
                    cfg.export,
                    spec=spec,
                    store=store,
                    out_dir=cfg.policy_dir,
                    force=cfg.force,
                    scorecard=card_summary(cards, weights, where),
                    provenance={
                        "storage": mask_url(cfg.storage),
                        "searched_on": "replay of recorded real steps",
                    },
                )
                get_scaler(str(path), device="cpu")  # it loads
            self.result.exported, self.result.winner = path, label
            self.say(
                "export",
                f"{path} ({policy_label(trial)}, {how}); use it with autoscale.get_scaler('{cfg.export}')",
            )
            mine = validated.get(f"trial:{trial.number}")
            own = Validated(
                f"trial:{trial.number}", label, cards, True, mine.records if mine else None
            )
        rows = comparison_rows(own, validated)
        if not rows:
            return
        self.result.table = comparison_table(rows, spec)
        self.out(self.result.table)
        with self.ledger.track("bk:notes"):
            try:
                write_note(study, study_note(cfg.study, plan, self.result.table))
            except Exception as exc:
                self.warn(f"could not update the study note: {exc}")
        self._comparison_plot(study, rows, store, workdir)

    def _comparison_plot(self, study, rows: dict[str, Validated], store, workdir: Path) -> None:
        """A PNG of the real-step trajectories, kept as a study artifact, where time and the
        bookkeeping share (about 0.3 s a figure) allow."""
        room = BOOKKEEPING_SHARE * self.budget.elapsed() - self.ledger.total("bk:")
        if room < 0.5 or self.budget.left() + 0.5 * self.budget.reserve < 1.0:
            return
        from matplotlib.figure import Figure  # noqa: F401  (import outside the timed drawing)

        path = workdir / "comparison.png"
        first = self.result.plan.spec.instances["test"][0].name
        with self.ledger.track("bk:plots"):
            try:
                drawn = draw_comparison(
                    rows, path, f"{self.cfg.study}: test instance {first}, real steps"
                )
            except Exception as exc:
                self.warn(f"could not draw the comparison: {exc}")
                return
        if drawn:
            with self.ledger.track("bk:artifacts"):
                try:
                    store_artifact(store, path, study, "image/png")
                except Exception as exc:
                    self.warn(f"could not store the comparison plot: {exc}")


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


def _refine(timing: Timing, stats: dict[str, float]) -> Timing:
    """The step time observed while recording, once there is enough of it."""
    import dataclasses

    if stats["steps"] < 8:
        return timing
    per = (stats["wall_s"] - stats["recorded"] * (timing.build_s + timing.eval_s)) / stats["steps"]
    return dataclasses.replace(timing, step_s=max(per, 0.5 * timing.step_s))


def _best_line(study: Any) -> str:
    try:
        best = study.best_trial
    except ValueError:
        return "no completed trial yet"
    p = best.user_attrs.get("policy", {})
    what = p.get("rule") or f"{p.get('algo')} agent"
    return f"best: trial {best.number} ({what}), objective {best.value:.4f} on the train replay"
