"""``autoscale search --traces DIR...``: a search on the replay of a user's recorded runs.

The records (``autoscale wrap --record DIR``) become the instances: windows of each run, the
first two thirds train and the rest test, disjoint in time
(:func:`~autoscale.envs.from_records.suite_from_records`). With no way to take real steps, every phase
is replay, and says so (terminal, study note, manifest). Its own four phases:

1. **plan**: the windows, the study (a new one, or the one these records made: "resuming"), and
   what the held-out windows leave a rule to win over ``auto`` (:func:`headroom`). Where no
   candidate could be exported over ``auto`` there (one held-out window, or ``auto`` already as
   good as the windows allow), the search says so and stops: there is nothing for its budget;
2. **search**: parametric rule families with their knobs, scored on the train windows' replay
   against ``torch`` with the suite search's objective (the built-in rules' defaults first), in the
   workload search's trial loop (:class:`~autoscale.search.loop.TrialLoop`: a Ctrl-C never leaves a
   trial running);
3. **validate**: the best trials (:func:`~autoscale.search.export.top_candidates`), every built-in
   rule and ``auto`` on the test windows' replay, kept in the study as the workload search keeps
   its real-step rows, so that ``autoscale export`` reads them; rows that tie are said to tie, and why;
4. **export**: the workload search's pick (:func:`~autoscale.search.choose.choose`), with replay
   as the evidence: ``auto`` is the bar; a candidate ranked above it counts only when its lead over
   ``auto`` is more than the seed noise (paired window by window), a fixed scale only when asked
   for (``--family``), and only when it passes the no-harm check, here the replay of each whole
   run next to ``torch`` (:class:`~autoscale.search.no_harm_records.RecordsCheck`); otherwise the
   next candidate. When none clears the bar, ``auto`` itself is exported under the requested name
   (checked the same way; ``torch``'s rule where it harms the runs). Verdicts are kept in the
   study, as the workload search keeps them. The pick goes out through the one export step
   (:func:`~autoscale.search.export.export_candidate`), its manifest describing the records (the
   command, the steps, what the record says of the run), with the report of the first run with it
   among the counterfactuals.

The export target is checked before anything is written. One study identity check serves both
searches (:func:`~autoscale.search.study.check_source`): a study of records resumes only from the
same records, and a study of a workload is never resumed from records, nor the reverse.

The budget is wall clock, per run: the search takes what the later phases do not need (they cost
seconds). Interrupting keeps every finished trial in the study; the same command resumes it, says
so and how many trials it keeps, and spends its own budget on new ones beside them.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError
from autoscale.search.budget import Ledger, format_duration
from autoscale.search.candidates import AUTO, TORCH, Candidate
from autoscale.search.choose import Choice, choose, family_refusal
from autoscale.search.headroom import Room, headroom
from autoscale.search.no_harm_records import WHERE, RecordsCheck, totals
from autoscale.search.objective import episode_cost
from autoscale.search.runner import SearchResult
from autoscale.search.storage import DEFAULT_STORAGE
from autoscale.search.study import check_source, records_id
from autoscale.search.validate import PREFIX, Validated

__all__ = ["TraceSearch", "TraceSearchConfig", "PHASES", "describe_records", "replay_where"]

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
class TraceSearchConfig:
    """What ``autoscale search --traces`` was asked."""

    traces: tuple[str, ...]
    study: str | None = None
    export: str | None = None
    storage: str = DEFAULT_STORAGE
    artifacts: str | None = None
    policy_dir: str | None = None
    force: bool = False
    seed: int = 0
    n_trials: int | None = None
    horizon: int | None = None
    command: str = "autoscale search --traces"
    families: tuple[str, ...] | None = None  # --family (None: every family that adapts)
    progress: bool = False


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


class TraceSearch:
    """Runs the four phases of a search on records within ``budget`` (see the module docstring).

    Attributes:
        counts: This run's trials by outcome (``complete``, ``pruned``, ``failed``).
        kept: The trials the study held when this run opened it.
        result: What the search did (the workload search's :class:`SearchResult`).
    """

    def __init__(
        self, cfg: TraceSearchConfig, budget: Any, out: Callable[[str], None] | None = None
    ):
        from autoscale.search.trials import worker_id

        self.cfg, self.budget = cfg, budget
        self.out = out or (lambda s: print(s, flush=True))
        self.ledger = Ledger()
        self.worker = worker_id()
        self.counts = {"complete": 0, "pruned": 0, "failed": 0}
        self.kept = 0
        self.study: Any = None
        self.result = SearchResult(
            cfg.study or "", None, self.counts, budget_s=budget.seconds, ledger=self.ledger
        )

    def say(self, phase: str, text: str) -> None:
        """A phase's line, numbered among this search's own phases."""
        n = f"{PHASES.index(phase) + 1}/{len(PHASES)} " if phase in PHASES else ""
        self.out(f"[{n}{phase}] {text}")

    def warn(self, text: str) -> None:
        print(f"warning: {text}", file=sys.stderr, flush=True)

    @property
    def held(self) -> int:
        """Finished trials the study holds now (the kept ones and this run's, an interrupted one
        included)."""
        if self.study is None:
            return self.kept
        return len(_finished(self.study.get_trials(deepcopy=False)))

    def run(self) -> SearchResult:
        import warnings

        import optuna

        from autoscale.envs.from_records import suite_from_records
        from autoscale.observe import read_record
        from autoscale.search.bench import ReplayBench
        from autoscale.search.export import check_export_target

        optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are said once, here
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        cfg = self.cfg
        records = [read_record(p) for p in cfg.traces]
        for rec in records:
            if rec.notes:
                self.out(f"note: {rec.path}: {rec.notes[0]}")
        suite, traces = suite_from_records(records, cfg.horizon)
        name = self.result.study = cfg.study or _default_name(suite)
        # before anything is written: a search must not spend its budget to fail here
        check_export_target(cfg.export or name, cfg.policy_dir, name, cfg.force)
        study = self.study = self._open(name, records, suite)
        bench = ReplayBench(suite, traces)
        room = headroom(bench)
        windows = {m.name: {k: len(v) for k, v in m.instances.items()} for m in suite.members}
        self.say(
            "plan",
            f"{len(records)} record(s), {sum(len(r.steps) for r in records)} steps; windows of "
            f"{suite.episode.steps} steps: {_windows_text(windows)}; {room.describe()}",
        )
        self.result.stopped_early = room.reason()
        if self.result.stopped_early is None:
            self._search(study, bench, records)
        else:
            self.say(
                "search",
                f"none: the records cannot separate a candidate from auto ({room.reason()}); "
                f"stopping after {format_duration(self.budget.elapsed())} instead of spending "
                f"the {format_duration(self.budget.seconds)} budget; {SEPARATE}",
            )
        ranked, factories = self._validate(study, bench, room)
        self._export(study, suite, records, ranked, factories)
        self.result.wall_s = self.budget.elapsed()
        return self.result

    # ------------------------------------------------------------------ plan
    def _open(self, name: str, records: list[Any], suite: Any) -> Any:
        """The study: created with what these records are, or the one they made, resumed (said,
        with the trials it keeps; a trial left running by a stopped search is failed)."""
        import optuna

        from autoscale.search.space import default_trial_params, searched_families
        from autoscale.search.storage import mask_url, open_storage, study_names
        from autoscale.search.study import fail_stale_trials, study_kwargs
        from autoscale.search.trials import write_note

        cfg = self.cfg
        storage = open_storage(cfg.storage)
        existed, before = name in study_names(storage), []
        if existed:
            before = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
        study = optuna.create_study(
            study_name=name,
            storage=storage,
            direction="minimize",
            load_if_exists=True,
            **study_kwargs(cfg.seed, len(before), self.ledger),
        )
        check_source(study.user_attrs, name, records, suite)  # a study of these records, or new
        families = searched_families(cfg.families)
        if "traces" not in study.user_attrs:
            study.set_user_attr("traces", [str(Path(r.path).resolve()) for r in records])
            study.set_user_attr("records", records_id(records))
            study.set_user_attr("command", cfg.command)
            study.set_user_attr("suite", suite.to_dict())
            for rule, defaults in families.items():
                study.enqueue_trial(
                    default_trial_params(rule, defaults, suite.episode),
                    user_attrs={"baseline": True},
                )
            write_note(study, _note(name, records, suite))
        # what autoscale export reads (a study of an earlier autoscale lacks some): the validation
        # suite (the test windows), the families searched, the records described
        if not isinstance(study.user_attrs.get("validation"), dict):
            study.set_user_attr("validation", suite.to_dict())
            study.set_user_attr("validated_on", REPLAY_NOTE)
        if "plan" not in study.user_attrs:
            study.set_user_attr("plan", {"rules": ["torch", *families], "source": "records"})
        if "workload" not in study.user_attrs:
            study.set_user_attr("workload", describe_records(records))
        where = f"study '{name}' in {mask_url(cfg.storage)}"
        if not existed:
            self.say("plan", f"{where}; {REPLAY_NOTE}")
            return study
        stale = fail_stale_trials(study, storage)
        kept = _finished(study.get_trials(deepcopy=False))
        self.kept = len(kept)
        n = {s: sum(1 for t in kept if t.state.name == s) for s in ("COMPLETE", "PRUNED", "FAIL")}
        self.say(
            "plan",
            f"resuming study '{name}': {len(kept)} trials kept ({n['COMPLETE']} complete, "
            f"{n['PRUNED']} pruned, {n['FAIL']} failed"
            + (
                f", {stale} of them left running by a stopped search and failed now"
                if stale
                else ""
            )
            + f"); this run's {format_duration(self.budget.seconds)} budget goes to new trials "
            f"beside them, and validation weighs them all ({mask_url(cfg.storage)})",
        )
        return study

    # ------------------------------------------------------------------ search
    def _search(self, study: Any, bench: Any, records: list[Any]) -> None:
        """Trials on the train windows' replay until what the later phases need is left."""
        from autoscale.report.replay import RecordReplay
        from autoscale.search.loop import TrialLoop
        from autoscale.search.space import searched_families
        from autoscale.search.storage import artifact_store, artifacts_dir
        from autoscale.search.trials import ParametricObjective, TrialRecorder, best_line

        cfg = self.cfg
        families = searched_families(cfg.families)
        folder = artifacts_dir(cfg.storage, cfg.artifacts)
        workdir = folder / "work"
        workdir.mkdir(parents=True, exist_ok=True)
        recorder = TrialRecorder(bench, artifact_store(folder), self.ledger, workdir, self.warn)
        objective = ParametricObjective(bench, recorder, self.ledger, families)
        # what the later phases need: a test replay per candidate and rule, no-harm, the report
        t0 = time.perf_counter()
        bench.run("test", lambda: bench.scaler("torch"))
        per_test = time.perf_counter() - t0
        t0 = time.perf_counter()
        for rec in records:
            RecordReplay(rec).replay("torch")
        per_run = time.perf_counter() - t0
        # validation: candidates and rules on the test windows; no harm: two whole-run replays
        # per candidate tried; the report: every rule on the first run, and its plots (~2 s)
        n = CANDIDATES + len(families)
        reserve = 1.5 * (per_test * n + per_run * (2 * n + len(families) + 2)) + 3.0
        stop_at = self.budget.end - reserve
        if stop_at <= time.monotonic():
            need = self.budget.elapsed() + reserve + self.budget.reserve + 5
            raise ConfigError(
                f"the budget leaves no time to search after validation ({format_duration(reserve)}); "
                f"give --budget {format_duration(need)} or more"
            )
        t_search = time.monotonic()
        TrialLoop(
            study, self.ledger, worker=self.worker, warn=self.warn, counts=self.counts,
            n_trials=cfg.n_trials, progress=cfg.progress,
        ).run(objective, stop_at)  # fmt: skip
        c = self.counts
        self.say(
            "search",
            f"{sum(c.values())} trials in {format_duration(time.monotonic() - t_search)} "
            f"({c['complete']} complete, {c['pruned']} pruned, {c['failed']} failed) on the train "
            f"windows' replay; {best_line(study)}",
        )

    # ------------------------------------------------------------------ validate
    def _validate(
        self, study: Any, bench: Any, room: Room
    ) -> tuple[list[Validated], dict[Candidate, Callable[[], Any]]]:
        """The best distinct trials, every rule and ``auto`` on the test windows' replay, ranked
        as the workload search ranks (:func:`~autoscale.search.export.rank`), kept in the study,
        with a factory of fresh scalers of each."""
        import optuna

        from autoscale.search.export import policy_label, rank, top_candidates
        from autoscale.search.space import searched_families
        from autoscale.search.storage import artifact_store, artifacts_dir

        t0 = time.monotonic()
        cfg = self.cfg
        folder = artifacts_dir(cfg.storage, cfg.artifacts)
        complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        best = top_candidates(
            complete, bench.suite, artifact_store(folder), folder / "work", CANDIDATES, self.warn
        )
        rows: dict[Candidate, tuple[str, Callable[[], Any]]] = {}
        for t, factory in best:
            rows[Candidate.trial(t.number)] = (policy_label(t), factory)
        for rule in dict.fromkeys(["torch", *searched_families(cfg.families), AUTO.name]):
            key = AUTO if rule == AUTO.name else Candidate.rule(rule)
            rows[key] = (rule, lambda r=rule: bench.scaler(r))
        validated = {
            key: Validated(key, label, bench.run("test", factory)[0], False, None)
            for key, (label, factory) in rows.items()
        }
        self._keep(study, validated, bench.suite)
        ranked = rank(validated, validated[TORCH], bench.suite.reward)
        weights, torch_row = bench.suite.reward, validated[TORCH]
        self.say(
            "validate",
            f"in {time.monotonic() - t0:.1f}s, on the replay of {room.windows} held-out window(s) "
            "(objective vs torch, lower is better): "
            + ", ".join(f"{v.label} {v.objective(torch_row, weights):+.4f}" for v in ranked)
            + _tie_text(ranked, torch_row, weights, room, said=self.result.stopped_early),
        )
        return ranked, {key: factory for key, (_, factory) in rows.items()}

    def _keep(self, study: Any, validated: dict[Candidate, Validated], suite: Any) -> None:
        """Each row's cards under the study's validation key, as the workload search keeps its
        real-step rows (``real:KEY``: the study's held-out episodes, here the test windows'
        replay, as its ``validated_on`` says), for ``autoscale export``."""
        from autoscale.envs.suite_env import suite_instances
        from autoscale.training.scorecard import json_safe

        names = suite_instances(suite, "test")
        for key, v in validated.items():
            cards = [c for m in suite.members for c in v.cards[m.name]]
            value = {
                "cards": {n: c.to_dict() for n, c in zip(names, cards, strict=True)},
                "worker": self.worker,
                "on": "replay",
            }
            with self.ledger.track("bk:attrs"):
                study.set_user_attr(PREFIX + key, json_safe(value))

    # ------------------------------------------------------------------ export
    def _export(self, study, suite, records, ranked: list[Validated], factories) -> None:
        """The workload search's pick, checked on the replay of the whole records, exported."""
        from autoscale.report import write_report
        from autoscale.report.page import compare_names
        from autoscale.scalers import make_scaler
        from autoscale.search.export import export_candidate

        cfg, t0 = self.cfg, time.monotonic()
        name = cfg.export or study.study_name
        # the check replays the runs (seconds, kept in the reserve): it always runs, so nothing
        # is exported unchecked
        check = RecordsCheck(records, self.ledger, factories[TORCH])
        choice = choose(
            study, ranked, factories, check, None, self.ledger, weights=suite.reward,
            stop_at=math.inf, say=lambda text: self.say("export", text),
            refuse=lambda v: family_refusal(v, study, cfg.families), replay_counts=True,
        )  # fmt: skip
        pick = choice.winner
        if pick is None:  # torch and auto are always replayed: this says what went wrong
            raise ConfigError(f"nothing to export from study '{study.study_name}': {choice.why}")
        verdict = next((x for x in choice.verdicts if x.label == pick.label), None)
        if verdict is None:  # torch, the reference, is not checked: its numbers for the card
            if pick.key != TORCH:
                raise RuntimeError(f"{pick.label} was picked without a no-harm verdict")
            verdict = check.check(factories[pick.key], pick.label)
        nh = totals(verdict)
        path, how = export_candidate(
            study, pick.key, name, suite=suite, store=None, out_dir=cfg.policy_dir,
            force=cfg.force, scorecard=_scorecard(choice, pick, ranked, suite, nh),
            provenance={"validated_on": REPLAY_NOTE},
        )  # fmt: skip
        make_scaler(str(path), device="cpu")  # it loads
        self.result.exported, self.result.winner = path, f"{name} ({how})"
        report = write_report(records[0], Path(path) / "report.html", [*compare_names(), path.name])
        self.say(
            "export",
            f"{choice.why}; {pick.label} {WHERE}, on their clean steps: skipped "
            f"{_pct(nh['skip_rate'])} vs torch {_pct(nh['torch_skip_rate'])}, below fp16 range "
            f"{_pct(nh['precision_loss'])} vs {_pct(nh['torch_precision_loss'])}; exported to "
            f"{path} ({how}); report {report} (in {time.monotonic() - t0:.1f}s)",
        )
        self.say(
            "done",
            f"use it with autoscale wrap --scaler {path.name} -- <your command>, or "
            f"autoscale.get_scaler('{path.name}'); {REPLAY_NOTE}",
        )

    def summary(self) -> str:
        """What this run did and what the study holds, in one phrase."""
        return f"this run: {sum(self.counts.values())} trials; the study holds {self.held}"


def _finished(trials: list[Any]) -> list[Any]:
    """The trials that ran to an end (complete, pruned or failed: not waiting or running)."""
    return [t for t in trials if t.state.name in ("COMPLETE", "PRUNED", "FAIL")]


def _scorecard(choice: Choice, pick: Validated, ranked, suite, nh) -> dict[str, Any]:
    """The manifest's scorecard, as ``autoscale export`` writes one from the study: the pick's
    held-out rows against ``torch`` and ``auto``, the evidence, and the whole records' replay."""
    from autoscale.search.answer import evidence
    from autoscale.search.export import card_summary

    reference = next(v for v in ranked if v.key == TORCH)
    where = replay_where(pick, suite)
    out = card_summary(pick.cards, reference.cards, suite.reward, where)
    out["evidence"] = evidence(choice, pick, reference, suite.reward)
    out["no_harm_replay"] = nh
    return out


def replay_where(v: Validated, suite: Any) -> str:
    """Where a row of a records search was measured, in words."""
    n = sum(len(c) for c in v.cards.values())
    return f"replay of {n} held-out windows of {suite.episode.steps} recorded steps"


def _tie_text(
    ranked: list[Validated], torch_row: Validated, weights: Any, room: Room, said: str | None
) -> str:
    """Where the best rows score alike on every held-out window: which, and why (what would
    separate them too, unless the search ``said`` it when it stopped)."""

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
    """What a policy searched on ``records`` describes instead of a workload: each run's folder,
    command and steps, and what its record says of it (the scaler, torch, the device)."""
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


def _default_name(suite) -> str:
    import re

    names = "-".join(m.name for m in suite.members)[:60]
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{names}-traces").strip("-.") or "traces"


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
