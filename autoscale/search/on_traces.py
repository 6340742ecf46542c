"""``autoscale search --traces DIR...``: a search on the replay of a user's recorded runs.

The records (``autoscale wrap --record DIR``) become the instances: windows of each run, the
first two thirds train and the rest test, disjoint in time
(:func:`~autoscale.envs.from_records.suite_from_records`). With no way to take real steps, every phase
is replay, and says so (terminal, study note, manifest):

1. **search**: parametric rule families with their knobs, scored on the train windows' replay
   against ``torch`` with the suite search's objective (the built-in rules' defaults first);
2. **validate**: the best trials, every built-in rule and ``auto`` on the test windows' replay;
3. **export**: ``auto`` is the bar, as in the workload search: a candidate ranked above it counts
   only when its lead over ``auto`` is more than the seed noise (paired window by window), and a
   fixed scale only when asked for (``--family``); it is replayed over the whole of each run,
   judged on its clean steps (a finite loss and a known overflow threshold: not every gradient
   flushed to zero), next to ``torch``: it may skip at most 0.5 points more of those steps and
   must not lose more gradient elements below fp16's range; otherwise the next candidate. When
   none clears the bar, ``auto`` itself is exported under the requested name (checked the same
   way; ``torch``'s rule where it harms the runs). The pick is written with the report of the
   first run with it among the counterfactuals.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError
from autoscale.search.candidates import AUTO as AUTO_KEY
from autoscale.search.candidates import TORCH, Candidate
from autoscale.search.validate import Validated
from autoscale.training.bar import SKIP_POINTS

__all__ = ["TraceSearch", "TraceSearchConfig"]

# the no-harm check's limits, the bar's (autoscale/training/bar.py), as the workload search's
# check applies them to long real runs: skips and precision loss at most 0.5 points above torch's
NO_HARM_SKIP = SKIP_POINTS
NO_HARM_PRECISION = SKIP_POINTS
CANDIDATES = 5  # best trials validated
AUTO = "auto"  # the shipped general policy: the bar a searched policy must clear
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


@dataclass
class ReplayValidated(Validated):
    """A scaler validated on the test windows' replay (``real`` False): its key (a trial of the
    study, a built-in rule, or ``auto``), the rule and parameters it replays with, its objective
    against ``torch`` there, and its no-harm replay once checked."""

    rule: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    test_objective: float = math.nan
    no_harm: dict[str, Any] | None = None


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
        fresh = "traces" not in study.user_attrs
        if not fresh:
            _check_same_records(study, name, records, suite)
        if fresh:
            study.set_user_attr("traces", [str(Path(r.path).resolve()) for r in records])
            study.set_user_attr("records", _records_id(records))
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
        candidates = self._validate(study, bench, families)
        self.say(
            "validate",
            f"in {time.monotonic() - t_val:.1f}s, on the test windows' replay (objective vs torch, "
            "lower is better): "
            + ", ".join(f"{c.label} {c.test_objective:+.4f}" for c in candidates[:6]),
        )
        t_exp = time.monotonic()
        pick, why = self._pick(candidates, records, bench, suite)
        path = self._export(study, suite, pick, records)
        from autoscale.report import write_report
        from autoscale.report.page import compare_names

        report = write_report(records[0], Path(path) / "report.html", [*compare_names(), path.name])
        nh = pick.no_harm
        self.say(
            "export",
            f"{why}; {pick.label} passed the no-harm check on the clean steps (replay: skipped "
            f"{100 * nh['skip_rate']:.2f}% vs torch {100 * nh['torch_skip_rate']:.2f}%, below fp16 "
            f"range {100 * nh['precision_loss']:.2f}% vs {100 * nh['torch_precision_loss']:.2f}%); "
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

    def _validate(self, study, bench, families) -> list[ReplayValidated]:
        complete = [
            t for t in study.trials if t.state.name == "COMPLETE" and "policy" in t.user_attrs
        ]
        complete.sort(key=lambda t: t.value)
        out: list[ReplayValidated] = []
        seen = set()
        for t in complete:
            pol = t.user_attrs["policy"]
            if t.user_attrs.get("baseline"):
                continue  # the rules' defaults are validated as rules below
            key = json.dumps(pol, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            cards, _ = bench.run("test", lambda p=pol: bench.scaler(p["rule"], **p["params"]))
            value = bench.objective("test", cards)
            label = f"{pol['rule']}, trial {t.number}"
            key = Candidate.trial(t.number)
            out.append(
                ReplayValidated(key, label, cards, False, None, pol["rule"], pol["params"], value)
            )
            if len(out) >= CANDIDATES:
                break
        for rule in dict.fromkeys(["torch", *families, AUTO]):  # the rules, and auto: the bar
            cards, _ = bench.run("test", lambda r=rule: bench.scaler(r))
            key = AUTO_KEY if rule == AUTO else Candidate.rule(rule)
            value = bench.objective("test", cards)
            out.append(ReplayValidated(key, rule, cards, False, None, rule, {}, value))
        # on a tie: auto first, then the rules, then trials
        out.sort(key=lambda c: (c.test_objective, not c.key.is_policy, c.key.is_trial))
        return out

    def _pick(
        self, candidates: list[ReplayValidated], records, bench, suite
    ) -> tuple[ReplayValidated, str]:
        """What is exported, and why: the first candidate ranked above ``auto`` whose lead over
        it is more than the seed noise, that the user may get (a fixed scale only when asked
        for) and that passes the no-harm check; else ``auto`` (checked too); else ``torch``."""
        from autoscale.scalers.registry import rule_class
        from autoscale.search.objective import lead

        auto = next(c for c in candidates if c.key == AUTO_KEY)
        best_lead = None
        for c in candidates:
            if c is auto:
                break
            ld = lead(c.cards, auto.cards, bench.reference_for("test", c.cards), suite.reward)
            best_lead = best_lead or (c, ld)
            cls = rule_class(c.rule)
            if not ld.clear or (
                cls is not None and not cls.adapts and c.rule not in (self.cfg.families or ())
            ):
                continue
            c.no_harm = _no_harm(records, c)
            if c.no_harm["passed"]:
                return (
                    c,
                    f"{c.label} beat auto by {ld.lead:.4f} on the test windows' replay, more than the seed noise ({ld.noise:.4f})",
                )
            self.say("export", f"{c.label} refused: {c.no_harm['why']}")
        if best_lead is None:
            why = "auto is the best found for these records: no candidate ranked above it"
        else:
            c, ld = best_lead
            why = (
                f"auto is the best found for these records: the best ({c.label}) led it by "
                f"{ld.lead:.4f}, within the seed noise ({ld.noise:.4f})"
                if not ld.clear
                else "auto is the best found for these records: no candidate that led it passed"
            )
        auto.no_harm = _no_harm(records, auto)
        if auto.no_harm["passed"]:
            return auto, why
        self.say("export", f"auto refused: {auto.no_harm['why']}")
        torch = next(c for c in candidates if c.key == TORCH)
        torch.no_harm = _no_harm(records, torch)
        return (
            torch,
            f"auto harms these runs ({auto.no_harm['why']}): torch's own rule, the reference",
        )

    def _export(self, study, suite, pick: ReplayValidated, records) -> Path:
        from autoscale.search.export import export_policy, export_rule, export_trial

        name = self.cfg.export or study.study_name
        provenance = {
            "traces": [str(Path(r.path).resolve()) for r in records],
            "validation": REPLAY_NOTE,
        }
        scorecard = {
            "test_replay_objective": pick.test_objective,
            "no_harm_replay": pick.no_harm,
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


def _no_harm(records, c: ReplayValidated) -> dict[str, Any]:
    """The candidate and torch replayed over each whole run, judged on its clean steps."""
    import numpy as np

    from autoscale.report.replay import RecordReplay

    skip = tskip = prec = tprec = 0.0
    n = 0
    for rec in records:
        rp = RecordReplay(rec)
        # clean: a finite loss, and a threshold the record knows (not every gradient zero)
        clean = ~rp.inst.nonfinite & np.isfinite(rp.inst.threshold)
        mine = rp.replay(c.rule, **c.params)
        ref = rp.replay("torch")
        k = int(clean.sum())
        if k == 0:
            continue
        n += k
        skip += float(mine.skipped[clean].sum())
        tskip += float(ref.skipped[clean].sum())
        prec += _mean_precision(mine, clean) * k
        tprec += _mean_precision(ref, clean) * k
    if n == 0:
        return {"passed": False, "why": "the runs have no clean step"}
    res = {
        "clean_steps": n,
        "skip_rate": skip / n,
        "torch_skip_rate": tskip / n,
        "precision_loss": prec / n,
        "torch_precision_loss": tprec / n,
    }
    why = []
    if res["skip_rate"] > res["torch_skip_rate"] + NO_HARM_SKIP:
        why.append(
            f"skips {100 * res['skip_rate']:.2f}% of the clean steps, torch {100 * res['torch_skip_rate']:.2f}%"
        )
    if res["precision_loss"] > res["torch_precision_loss"] + NO_HARM_PRECISION:
        why.append(
            f"loses {100 * res['precision_loss']:.2f}% of gradient elements below fp16's range, "
            f"torch {100 * res['torch_precision_loss']:.2f}%"
        )
    res["passed"] = not why
    res["why"] = "; ".join(why)
    return res


def _mean_precision(outcome, clean) -> float:
    """Mean share of gradient elements below fp16's range over the clean steps it applied (0
    when it applied none with a histogram)."""
    import numpy as np

    p = outcome.precision[clean & ~outcome.skipped]
    p = p[np.isfinite(p)]
    return float(p.mean()) if p.size else 0.0


def _records_id(records: list[Any]) -> list[list[Any]]:
    """What a study of records is made from: each record's folder and its number of steps."""
    return [[str(Path(r.path).resolve()), len(r.steps)] for r in records]


def _check_same_records(study: Any, name: str, records: list[Any], suite: Any) -> None:
    """A study of records resumes only from the records it was made from (its trials and their
    test-replay scores were measured on them); else one line says how to start another."""

    attrs = study.user_attrs
    now = _records_id(records)
    stored = attrs.get("records")
    same = attrs.get("suite") == suite.to_dict() and (
        stored == now if stored is not None else attrs.get("traces") == [p for p, _ in now]
    )
    if not same:
        made = ", ".join(attrs.get("traces") or []) or "other records"
        raise ConfigError(
            f"study '{name}' was made from other records ({made}, or the same folders holding "
            f"other steps): pass --study NEW_NAME to search these, or the same records to resume it"
        )
