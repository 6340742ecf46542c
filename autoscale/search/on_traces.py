"""``autoscale search --traces DIR...``: a user's records as the source of a search.

:class:`RecordsSource` supplies what differs from a workload's search to
:class:`~autoscale.search.runner.SearchRunner`: its plan (windows of the records, and what they
leave to win over ``auto``), replay validation, the replay of whole runs as the no-harm check
(:class:`~autoscale.search.no_harm_records.RecordsCheck`), one round and its export's words.
User-facing detail: docs/your-run.md, "A policy for your run: autoscale search --traces".
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoscale.envs.suite import SuiteSpec
from autoscale.errors import ConfigError
from autoscale.search.bench import ReplayBench
from autoscale.search.budget import (
    OUTCOMES,
    format_duration,
    outcome_counts,
    percent,
    plural,
    trial_counts,
)
from autoscale.search.candidates import TORCH
from autoscale.search.export import rank
from autoscale.search.headroom import Room, headroom
from autoscale.search.no_harm_records import WHERE, RecordsCheck, totals
from autoscale.search.objective import episode_cost
from autoscale.search.runner import Round, rules_torch_first
from autoscale.search.validate import ReplayValidator, Validated

if TYPE_CHECKING:
    from autoscale.search.runner import SearchRunner

__all__ = ["RecordsSource", "RecordsPlan", "PHASES", "describe_records"]

PHASES = ("plan", "search", "validate", "export")
CANDIDATES = 5  # best trials validated
REPLAY_NOTE = (
    "validated on the replay of held-out windows of the recorded runs (no real steps: a record "
    "cannot be trained again); the no-harm check is the replay of the runs' clean steps"
)
SEPARATE = (
    "to separate them, record a longer run or pass more records (--traces A B ...): more held-out "
    "windows, with steps where the scale matters (overflows, gradients near fp16's range)"
)


@dataclass(frozen=True)
class RecordsPlan:
    """What a search on records plans: its windows (searched and validated alike) and rules."""

    suite: SuiteSpec
    rules: tuple[str, ...]
    space: str = "parametric"
    timings: None = None  # nothing is measured on real steps

    @property
    def validation(self) -> SuiteSpec:
        return self.suite

    @property
    def steps(self) -> int:
        return self.suite.episode.steps


class RecordsSource:
    """The records of ``paths`` as a search's source (a bad record is refused when made).

    Attributes:
        records: The runs (:class:`~autoscale.observe.RunRecord`).
        suite: Their windows, as a suite.
        kept: The finished trials the study held when the search opened it.
    """

    phases = PHASES
    searched_on = "on the train windows' replay"
    provenance = {"validated_on": REPLAY_NOTE}

    def __init__(self, paths: tuple[str, ...], horizon: int | None = None) -> None:
        from autoscale.envs.from_records import suite_from_records
        from autoscale.observe import read_record

        self.records = [read_record(p) for p in paths]
        self.suite, self.traces = suite_from_records(self.records, horizon)
        self.kept = 0
        self.round = Round(1, CANDIDATES, None, math.inf)
        self.room: Room | None = None
        self.no_harm: dict[str, Any] = {}

    def default_study(self) -> str:
        """The study's name where none is given: the records' folders'."""
        import re

        names = "-".join(m.name for m in self.suite.members)[:60]
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{names}-traces").strip("-.") or "traces"

    def held(self, study: Any) -> int:
        """Finished trials ``study`` holds now (None: not opened yet, the kept ones)."""
        return self.kept if study is None else len(_finished(study.get_trials(deepcopy=False)))

    # ------------------------------------------------------------------ plan
    def open(self, runner: SearchRunner) -> ReplayBench:
        """The plan phase: the study, the windows and what they leave to win; the search's stop."""
        from autoscale.search.space import searched_families

        for rec in self.records:
            if rec.notes:
                runner.out(f"note: {rec.path}: {rec.notes[0]}")
        runner.plan = RecordsPlan(self.suite, rules_torch_first(runner.cfg.families))
        runner.families = searched_families(runner.cfg.families)
        study = runner.study = self._open_study(runner)
        runner.artifacts()  # (after the storage opened: a bad storage leaves no folder)
        bench = ReplayBench(self.suite, self.traces)
        room = self.room = headroom(bench)
        windows = {m.name: {k: len(v) for k, v in m.instances.items()} for m in self.suite.members}
        runner.say(
            "plan",
            f"{plural(len(self.records), 'record')}, {sum(len(r.steps) for r in self.records)} steps; "
            f"windows of {self.suite.episode.steps} steps: {_windows_text(windows)}; "
            f"{room.describe()}",
        )
        torch = lambda: bench.scaler(TORCH.name)  # noqa: E731
        runner.no_harm = RecordsCheck(self.records, runner.ledger, torch)
        runner.validator = ReplayValidator(bench, study, runner.ledger, worker=runner.worker)
        runner.result.stopped_early = room.reason()
        if room.reason() is None:
            self.round = Round(1, CANDIDATES, self._search_until(runner, bench), math.inf)
        else:
            runner.say(
                "search",
                f"none: the records cannot separate a candidate from auto ({room.reason()}); "
                f"stopping after {format_duration(runner.budget.elapsed())} instead of spending "
                f"the {format_duration(runner.budget.seconds)} budget; {SEPARATE}",
            )
        return bench

    def _search_until(self, runner: SearchRunner, bench: ReplayBench) -> float:
        """Where the search stops: the budget's end less the later phases' time, measured here."""
        from autoscale.report.replay import RecordReplay

        t0 = time.perf_counter()
        bench.run("test", lambda: bench.scaler(TORCH.name))
        per_test = runner.validator.run_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for rec in self.records:
            RecordReplay(rec).replay(TORCH.name)
        per_run = runner.no_harm.run_s = time.perf_counter() - t0
        # validation: candidates and rules on the test windows; no harm: two whole-run replays
        # per candidate tried; the report: every rule on the first run, and its plots (~2 s)
        families = len(runner.families)
        n = CANDIDATES + families
        reserve = 1.5 * (per_test * n + per_run * (2 * n + families + 2)) + 3.0
        stop_at = runner.budget.end - reserve
        if stop_at <= time.monotonic():
            need = runner.budget.elapsed() + reserve + runner.budget.reserve + 5
            raise ConfigError(
                f"the budget leaves no time to search after validation ({format_duration(reserve)}); "
                f"give --budget {format_duration(need)} or more"
            )
        return stop_at

    def _open_study(self, runner: SearchRunner) -> Any:
        """The study: created for these records, or the one they made, resumed (and said)."""
        import optuna

        from autoscale.search.storage import mask_url, open_storage, study_names
        from autoscale.search.study import (
            check_source,
            enqueue_defaults,
            fail_stale_trials,
            records_id,
            study_kwargs,
        )
        from autoscale.search.trials import write_note

        cfg, name, records, suite = runner.cfg, runner.cfg.study, self.records, self.suite
        storage = open_storage(cfg.storage)
        existed, before = name in study_names(storage), []
        if existed:
            before = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
        study = optuna.create_study(
            study_name=name,
            storage=storage,
            direction="minimize",
            load_if_exists=True,
            **study_kwargs(cfg.seed, len(before), runner.ledger),
        )
        check_source(study.user_attrs, name, records, suite)  # a study of these records, or new
        if "traces" not in study.user_attrs:
            study.set_user_attr("traces", [str(Path(r.path).resolve()) for r in records])
            study.set_user_attr("records", records_id(records))
            study.set_user_attr("command", cfg.command)
            study.set_user_attr("suite", suite.to_dict())
            enqueue_defaults(study, runner.families, suite.episode)
            write_note(study, _note(name, records, suite))
        # what autoscale export reads (a study of an earlier autoscale lacks some)
        if not isinstance(study.user_attrs.get("validation"), dict):
            study.set_user_attr("validation", suite.to_dict())
            study.set_user_attr("validated_on", REPLAY_NOTE)
        if "plan" not in study.user_attrs:
            study.set_user_attr("plan", {"rules": list(runner.plan.rules), "source": "records"})
        if "workload" not in study.user_attrs:
            study.set_user_attr("workload", describe_records(records))
        if not existed:
            runner.say("plan", f"study '{name}' in {mask_url(cfg.storage)}; {REPLAY_NOTE}")
            return study
        stale = fail_stale_trials(study, storage)
        kept = _finished(study.get_trials(deepcopy=False))
        self.kept = len(kept)
        n = outcome_counts(kept)
        stopped = f", {stale} of them left running by a stopped search and failed now"
        runner.say(
            "plan",
            f"resuming study '{name}': {trial_counts(n, stopped if stale else '')} kept"
            + f"; this run's {format_duration(runner.budget.seconds)} budget goes to new trials "
            f"beside them, and validation weighs them all ({mask_url(cfg.storage)})",
        )
        return study

    # ------------------------------------------------------------------ validate and export
    def validated_line(self, runner: SearchRunner, seconds: float) -> str:
        """Every row's objective on the held-out windows' replay, best first, and any ties."""
        weights, torch_row = self.suite.reward, runner.validated[TORCH]
        ranked = rank(runner.validated, torch_row, weights)
        return (
            f"in {seconds:.1f}s, on the replay of {plural(self.room.windows, 'held-out window')} "
            "(objective vs torch, lower is better): "
            + ", ".join(f"{v.label} {v.objective(torch_row, weights):+.4f}" for v in ranked)
            + _tie_text(ranked, torch_row, weights, self.room, said=runner.result.stopped_early)
        )

    def scorecard(self, runner: SearchRunner, chosen: Validated | None) -> dict[str, Any]:
        """The pick's replay of the whole records, pooled over their clean steps."""
        if chosen is None:  # torch and auto are always replayed: this says what went wrong
            raise ConfigError(
                f"nothing to export from study '{runner.cfg.study}': {runner.choice.why}"
            )
        verdict = next((x for x in runner.choice.verdicts if x.label == chosen.label), None)
        if verdict is None:  # torch, the reference, is not checked: its numbers for the card
            if chosen.key != TORCH:
                raise RuntimeError(f"{chosen.label} was picked without a no-harm verdict")
            verdict = runner.no_harm.check(runner.factories[chosen.key], chosen.label)
        self.no_harm = totals(verdict)
        return {"no_harm_replay": self.no_harm}

    def exported(
        self, runner: SearchRunner, path: Path, how: str, chosen: Validated | None, since: float
    ) -> None:
        """Say what was exported, write the first run's report beside it, and how to use it."""
        from autoscale.report import write_report
        from autoscale.report.page import compare_names
        from autoscale.scalers.policies import policy_ref

        nh, ref = self.no_harm, policy_ref(path)
        report = write_report(self.records[0], Path(path) / "report.html", [*compare_names(), ref])
        runner.say(
            "export",
            f"{runner.choice.why}; {chosen.label} {WHERE}, on their clean steps: skipped "
            f"{percent(nh['skip_rate'])} vs torch {percent(nh['torch_skip_rate'])}, below fp16 range "
            f"{percent(nh['precision_loss'])} vs {percent(nh['torch_precision_loss'])}; exported to "
            f"{path} ({how}); report {report} (in {time.monotonic() - since:.1f}s)",
        )
        runner.say(
            "done",
            f"use it with autoscale wrap --scaler {ref} -- <your command>, or "
            f"autoscale.get_scaler('{ref}'); {REPLAY_NOTE}",
        )


def _finished(trials: list[Any]) -> list[Any]:
    """The trials that ran to an end (complete, pruned or failed: not waiting or running)."""
    return [t for t in trials if t.state.name in OUTCOMES]


def _tie_text(
    ranked: list[Validated], torch_row: Validated, weights: Any, room: Room, said: str | None
) -> str:
    """Which of the best rows tie on every held-out window, and why ("" where none do)."""

    def costs(v: Validated) -> list[float]:
        return [episode_cost(c, weights) for c in v.all_cards()]

    top = costs(ranked[0])
    tied = [v for v in ranked if all(abs(a - b) <= 1e-12 for a, b in zip(costs(v), top))]
    if len(tied) < 2:
        return ""
    value = ranked[0].objective(torch_row, weights)
    if value <= room.best + 1e-9:
        why = ["they reach the hindsight limit of the held-out windows: no rule does better there"]
        why += [r for r in room.reasons() if "hindsight limit" not in r]
    else:
        why = room.reasons() or ["their scales differ nowhere the held-out steps tell apart"]
    return (
        f"; {', '.join(v.label for v in tied)} tie at {value:+.4f} on every held-out window: the "
        f"records cannot separate them ({'; '.join(why)})" + ("" if said else f"; {SEPARATE}")
    )


def describe_records(records: list[Any]) -> dict[str, Any]:
    """What a policy searched on ``records`` describes instead of a workload."""
    runs = []
    for rec in records:
        meta = rec.meta
        runs.append(
            {
                "path": str(Path(rec.path).resolve()),
                "command": rec.label,
                "steps": len(rec.steps),
                "skipped": sum(1 for s in rec.steps if s.get("found_inf")),
                "scaler": meta.get("scaler"),
                "torch": meta.get("torch"),
                "device": meta.get("device"),
                "started": meta.get("started"),
                "finished": bool(meta.get("finished")),
            }
        )
    first = runs[0]
    more = f" and {len(runs) - 1} more" if len(runs) > 1 else ""
    note = (
        f"searched on the replay of {len(runs)} recorded run{'s' if len(runs) > 1 else ''}: "
        f"{first['path']} ({first['steps']} steps of {first['command']}){more}"
    )
    return {"records": runs, "note": note}


def _windows_text(windows: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{m}: {w['train']} train, {w['test']} test" for m, w in windows.items())


def _note(name, records, suite) -> str:
    windows = {m.name: {k: len(v) for k, v in m.instances.items()} for m in suite.members}
    lines = [
        f"# {name}: a search on recorded runs",
        "",
        f"Records: {', '.join(str(r.path) for r in records)}.",
        f"Windows of {suite.episode.steps} steps; {json.dumps(windows)}.",
        "",
        f"**Validation: {REPLAY_NOTE}.**",
    ]
    return "\n".join(lines) + "\n"
