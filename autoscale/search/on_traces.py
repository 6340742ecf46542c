"""``autoscale search --traces DIR...``: a search on the replay of a user's recorded runs.

The records (``autoscale wrap --record DIR``) become the instances: windows of each run, the
first two thirds train and the rest test, disjoint in time
(:func:`~autoscale.envs.from_records.suite_from_records`). With no way to take real steps, every phase
is replay, and says so (terminal, study note, manifest):

1. **search**: parametric rule families with their knobs, scored on the train windows' replay
   against ``torch`` with the suite search's objective (the built-in rules' defaults first);
2. **validate**: the best trials, every built-in rule and ``auto`` on the test windows' replay;
3. **export**: the workload search's pick (:func:`~autoscale.search.choose.choose`), with replay
   as the evidence: ``auto`` is the bar; a candidate ranked above it counts only when its lead over
   ``auto`` is more than the seed noise (paired window by window), a fixed scale only when asked
   for (``--family``), and only when it passes the no-harm check, here the replay of each whole
   run next to ``torch`` (:class:`~autoscale.search.no_harm_records.RecordsCheck`); otherwise the
   next candidate. When none clears the bar, ``auto`` itself is exported under the requested name
   (checked the same way; ``torch``'s rule where it harms the runs). Verdicts are kept in the
   study, as the workload search keeps them. The pick is written with the report of the first run
   with it among the counterfactuals.

One study identity check serves both searches (:func:`~autoscale.search.study.check_source`): a
study of records resumes only from the same records, and a study of a workload is never resumed
from records, nor the reverse.

Phases are named and numbered as the workload search's (``[2/6 plan]``, ``[4/6 search]``,
``[5/6 validate]``, ``[6/6 export]``: there is nothing to measure or record).

The budget is wall clock: the search takes what the later phases do not need (they cost seconds).
Interrupting keeps every finished trial in the study; the same command resumes it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError
from autoscale.search.candidates import AUTO as AUTO_KEY
from autoscale.search.candidates import TORCH, Candidate
from autoscale.search.choose import choose, family_refusal
from autoscale.search.no_harm_records import WHERE, RecordsCheck, totals
from autoscale.search.study import check_source, records_id
from autoscale.search.validate import Validated

__all__ = ["TraceSearch", "TraceSearchConfig"]

CANDIDATES = 5  # best trials validated
REPLAY_NOTE = (
    "validated on the replay of held-out windows of the recorded runs (no real steps: a record "
    "cannot be trained again); the no-harm check is the replay of the runs' clean steps"
)


@dataclass(frozen=True)
class TraceSearchConfig:
    """What ``autoscale search --traces`` was asked."""

    traces: tuple[str, ...]
    study: str | None = None
    export: str | None = None
    storage: str = "autoscale.db"
    artifacts: str | None = None
    policy_dir: str | None = None
    force: bool = False
    seed: int = 0
    n_trials: int | None = None
    horizon: int | None = None
    command: str = "autoscale search --traces"
    families: tuple[str, ...] | None = None  # --family (None: every family that adapts)


class TraceSearch:
    """Runs the four phases of a search on records within ``budget``."""

    def __init__(
        self, cfg: TraceSearchConfig, budget: Any, out: Callable[[str], None] | None = None
    ):
        self.cfg, self.budget = cfg, budget
        self.out = out or (lambda s: print(s, flush=True))

    def say(self, phase: str, text: str) -> None:
        """A phase's line, named and numbered as the workload search's (no measure or record:
        the records are the steps)."""
        from autoscale.search.runner import PHASES

        self.out(
            f"[{PHASES.index(phase) + 1}/{len(PHASES)} {phase}] {text}"
            if phase in PHASES
            else f"[{phase}] {text}"
        )

    def run(self) -> dict[str, Any]:
        import optuna

        from autoscale.envs.from_records import suite_from_records
        from autoscale.observe import read_record
        from autoscale.search.bench import ReplayBench
        from autoscale.search.budget import Ledger, format_duration
        from autoscale.search.space import default_trial_params, searched_families
        from autoscale.search.storage import artifact_store, artifacts_dir, mask_url, open_storage
        from autoscale.search.study import study_kwargs
        from autoscale.search.trials import ParametricObjective, TrialRecorder, write_note

        cfg = self.cfg
        records = [read_record(p) for p in cfg.traces]
        for rec in records:
            if rec.notes:
                self.out(f"note: {rec.path}: {rec.notes[0]}")
        suite, traces = suite_from_records(records, cfg.horizon)
        h = suite.episode.steps
        windows = {m.name: {k: len(v) for k, v in m.instances.items()} for m in suite.members}
        name = cfg.study or _default_name(suite)
        storage = open_storage(cfg.storage)
        folder = artifacts_dir(cfg.storage, cfg.artifacts)
        store = artifact_store(folder)
        ledger = Ledger()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            study_name=name,
            storage=storage,
            direction="minimize",
            load_if_exists=True,
            **study_kwargs(cfg.seed, 0, ledger),
        )
        families = searched_families(cfg.families)
        check_source(study.user_attrs, name, records, suite)  # a study of these records, or new
        if "traces" not in study.user_attrs:
            study.set_user_attr("traces", [str(Path(r.path).resolve()) for r in records])
            study.set_user_attr("records", records_id(records))
            study.set_user_attr("command", cfg.command)
            study.set_user_attr("validation", REPLAY_NOTE)
            study.set_user_attr("suite", suite.to_dict())
            for rule, defaults in families.items():
                study.enqueue_trial(
                    default_trial_params(rule, defaults, suite.episode),
                    user_attrs={"baseline": True},
                )
            write_note(study, _note(name, records, suite, windows))
        self.say(
            "plan",
            f"{len(records)} record(s), {sum(len(r.steps) for r in records)} steps; windows of {h} "
            f"steps: {_windows_text(windows)}; "
            f"study '{name}' in {mask_url(cfg.storage)}; {REPLAY_NOTE}",
        )
        bench = ReplayBench(suite, traces)
        workdir = folder / "work"
        workdir.mkdir(parents=True, exist_ok=True)
        recorder = TrialRecorder(bench, store, ledger, workdir, lambda s: self.out(f"warning: {s}"))
        objective = ParametricObjective(bench, recorder, ledger, families)
        # what the later phases need: a test replay per candidate and rule, no-harm, the report
        from autoscale.report.replay import RecordReplay

        t0 = time.perf_counter()
        bench.run("test", lambda: bench.scaler("torch"))
        per_test = time.perf_counter() - t0
        t0 = time.perf_counter()
        for rec in records:
            RecordReplay(rec).replay("torch")
        per_run = time.perf_counter() - t0
        # validation: candidates and rules on the test windows; no harm: two whole-run replays
        # per candidate tried; the report: every rule on the first run, its plots (the fixed 3 s)
        n = CANDIDATES + len(families)
        reserve = 1.5 * (per_test * n + per_run * (2 * n + len(families) + 2)) + 3.0
        stop_at = self.budget.end - reserve
        if stop_at <= time.monotonic():
            need = self.budget.elapsed() + reserve + self.budget.reserve + 5
            raise ConfigError(
                f"the budget leaves no time to search after validation ({format_duration(reserve)}); "
                f"give --budget {format_duration(need)} or more"
            )
        before = len(study.trials)
        study.optimize(
            objective,
            n_trials=cfg.n_trials,
            timeout=max(1.0, stop_at - time.monotonic()),
            catch=(ValueError, ArithmeticError),
            show_progress_bar=False,
        )
        done = study.trials[before:]
        states = {
            s: sum(1 for t in done if t.state.name == s) for s in ("COMPLETE", "PRUNED", "FAIL")
        }
        best = study.best_trial
        self.say(
            "search",
            f"{len(done)} trials ({states['COMPLETE']} complete, {states['PRUNED']} pruned, "
            f"{states['FAIL']} failed) on the train windows' replay; best: trial {best.number} "
            f"({best.user_attrs.get('policy', {}).get('rule')}), objective {best.value:+.4f}",
        )
        t_val = time.monotonic()
        ranked, factories = self._validate(study, bench, families)
        torch_row = next(v for v in ranked if v.key == TORCH)

        def value(v: Validated) -> float:
            return v.objective(torch_row, suite.reward)

        self.say(
            "validate",
            f"in {time.monotonic() - t_val:.1f}s, on the test windows' replay (objective vs torch, "
            "lower is better): " + ", ".join(f"{v.label} {value(v):+.4f}" for v in ranked[:6]),
        )
        t_exp = time.monotonic()
        # the check replays the runs (seconds, kept in the reserve above): it always runs, so
        # nothing is exported unchecked
        check = RecordsCheck(records, ledger, factories[TORCH], run_s=2 * per_run)
        choice = choose(
            study,
            ranked,
            factories,
            check,
            None,
            ledger,
            weights=suite.reward,
            stop_at=math.inf,
            say=lambda text: self.say("export", text),
            refuse=lambda v: family_refusal(v, study, cfg.families),
            replay_counts=True,
        )
        pick = choice.winner
        if pick is None:  # torch and auto are always replayed: this says what went wrong
            raise ConfigError(f"nothing to export from study '{name}': {choice.why}")
        verdict = next((x for x in choice.verdicts if x.label == pick.label), None)
        if verdict is None:  # torch, the reference, is not checked: its numbers for the card
            if pick.key != TORCH:
                raise RuntimeError(f"{pick.label} was picked without a no-harm verdict")
            verdict = check.check(factories[pick.key], pick.label)
        nh = totals(verdict)
        path = self._export(study, suite, pick, value(pick), nh, records)
        from autoscale.report import write_report
        from autoscale.report.page import compare_names

        report = write_report(records[0], Path(path) / "report.html", [*compare_names(), path.name])
        self.say(
            "export",
            f"{choice.why}; {pick.label} {WHERE}, on their clean steps: skipped "
            f"{100 * nh['skip_rate']:.2f}% vs torch {100 * nh['torch_skip_rate']:.2f}%, below fp16 "
            f"range {100 * nh['precision_loss']:.2f}% vs {100 * nh['torch_precision_loss']:.2f}%; "
            f"exported to {path}; report {report} (in {time.monotonic() - t_exp:.1f}s)",
        )
        self.say(
            "done",
            f"use it with autoscale wrap --scaler {path.name} -- <your command>, or "
            f"autoscale.get_scaler('{path.name}'); {REPLAY_NOTE}",
        )
        return {
            "study": name,
            "policy": str(path),
            "report": str(report),
            "pick": pick.label,
            "trials": len(done),
            "ledger": ledger,
        }

    def _validate(
        self, study, bench, families
    ) -> tuple[list[Validated], dict[Candidate, Callable[[], Any]]]:
        """The best distinct trials, every rule and ``auto`` on the test windows' replay, ranked
        as the workload search ranks (:func:`~autoscale.search.export.rank`), with a factory of
        fresh scalers of each."""
        from autoscale.search.export import rank

        complete = [
            t for t in study.trials if t.state.name == "COMPLETE" and "policy" in t.user_attrs
        ]
        complete.sort(key=lambda t: t.value)
        factories: dict[Candidate, Callable[[], Any]] = {}
        labels: dict[Candidate, str] = {}
        seen = set()
        for t in complete:
            pol = t.user_attrs["policy"]
            if t.user_attrs.get("baseline"):
                continue  # the rules' defaults are validated as rules below
            same = json.dumps(pol, sort_keys=True)
            if same in seen:
                continue
            seen.add(same)
            key = Candidate.trial(t.number)
            factories[key] = lambda p=pol: bench.scaler(p["rule"], **p["params"])
            labels[key] = f"{pol['rule']}, trial {t.number}"
            if len(factories) >= CANDIDATES:
                break
        for rule in dict.fromkeys(["torch", *families, AUTO_KEY.name]):  # and auto: the bar
            key = AUTO_KEY if rule == AUTO_KEY.name else Candidate.rule(rule)
            factories[key] = lambda r=rule: bench.scaler(r)
            labels[key] = rule
        validated = {
            key: Validated(key, labels[key], bench.run("test", factory)[0], False, None)
            for key, factory in factories.items()
        }
        return rank(validated, validated[TORCH], bench.suite.reward), factories

    def _export(self, study, suite, pick: Validated, value: float, nh, records) -> Path:
        from autoscale.search.export import export_policy, export_rule, export_trial

        name = self.cfg.export or study.study_name
        provenance = {
            "traces": [str(Path(r.path).resolve()) for r in records],
            "validation": REPLAY_NOTE,
        }
        scorecard = {
            "test_replay_objective": value,
            "no_harm_replay": nh,
            "validation": REPLAY_NOTE,
        }
        kw = dict(
            suite=suite,
            out_dir=self.cfg.policy_dir,
            force=self.cfg.force,
            scorecard=scorecard,
            provenance=provenance,
        )
        if pick.key.is_policy:
            return Path(export_policy(study, pick.key.name, name, **kw))
        if pick.key.is_rule:
            return Path(export_rule(study, pick.key.name, name, **kw))
        return Path(export_trial(study, study.trials[pick.key.number], name, store=None, **kw))


def _windows_text(windows: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{m}: {w['train']} train, {w['test']} test" for m, w in windows.items())


def _default_name(suite) -> str:
    import re

    names = "-".join(m.name for m in suite.members)[:60]
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{names}-traces").strip("-.") or "traces"


def _note(name, records, suite, windows) -> str:
    lines = [
        f"# {name}: a search on recorded runs",
        "",
        f"Records: {', '.join(str(r.path) for r in records)}.",
        f"Windows of {suite.episode.steps} steps; {json.dumps(windows)}.",
        "",
        f"**Validation: {REPLAY_NOTE}.**",
    ]
    return "\n".join(lines) + "\n"
