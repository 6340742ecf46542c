"""The rounds of a search: search on replay, validate on real steps, pick, check and export;
again while a round fits in the time left (see :mod:`~autoscale.search.runner`).

:class:`Rounds` holds what the rounds share (the study, the plan, the replay bench, the
validator, the artifact store) and their typed :class:`RoundState`; candidates and built-in rules
are keyed ``rule:NAME`` and ``trial:NUMBER`` in :attr:`Rounds.validated`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoscale.search.agent_trials import RLObjective
from autoscale.search.budget import format_duration
from autoscale.search.candidates import AUTO, TORCH, Candidate
from autoscale.search.choose import choose, refusal
from autoscale.search.export import (
    card_summary,
    export_policy,
    export_rule,
    export_trial,
    policy_label,
    rank,
    top_candidates,
)
from autoscale.search.loop import TrialLoop
from autoscale.search.plan import CHECKED_CANDIDATES, Plan
from autoscale.search.report import comparison_table, draw_comparison, limit_block, member_table
from autoscale.search.session import Session
from autoscale.search.space import parametric_families
from autoscale.search.storage import file_lock, mask_url
from autoscale.search.study import study_note
from autoscale.search.trials import (
    ParametricObjective,
    store_artifact,
    write_note,
)
from autoscale.search.validate import Validated

__all__ = ["RoundState", "Rounds", "search_stop", "CANDIDATES_PER_ROUND", "MAX_ROUNDS"]

CANDIDATES_PER_ROUND = 3  # candidates validated per round (the best first)
MAX_ROUNDS = 12
MIN_ROUND_SHARE = 0.05  # a round needs at least this share of the budget to start
RL_SHARE_OF_BOTH = 0.7  # with --space both, RL gets this share of the search time


@dataclass
class RoundState:
    """What the rounds said and exported so far (each is said once).

    Attributes:
        exported: Key of the candidate or rule exported last (None: nothing yet).
        said_unchecked: Lines said about candidates the no-harm check could not run.
        said_none: "nothing exported" was said.
    """

    exported: str | None = None
    said_unchecked: set[str] = field(default_factory=set)
    said_none: bool = False


class Rounds:
    """One worker's rounds after recording (see the module docstring)."""

    def __init__(
        self,
        session: Session,
        study: Any,
        plan: Plan,
        bench: Any,
        recorder: Any,
        validator: Any,
        store: Any,
        workdir: Path,
    ) -> None:
        self.session = session
        self.cfg, self.budget, self.ledger = session.cfg, session.budget, session.ledger
        self.result, self.counts, self.no_harm = session.result, session.counts, session.no_harm
        self.folder, self.worker = session.folder, session.worker
        self.min_search_s = session.min_search_s
        self.study, self.plan, self.bench, self.recorder = study, plan, bench, recorder
        self.validator, self.store, self.workdir = validator, store, workdir
        self.validated: dict[str, Validated] = {}
        self.factories: dict[str, Callable[[], Any]] = {
            Candidate.rule(r): (lambda r=r: bench.scaler(r)) for r in plan.rules
        }
        self.factories[AUTO] = lambda: bench.scaler(AUTO.name)
        self.families = {r: parametric_families()[r] for r in plan.rules}
        self.state = RoundState()
        self.choice: Any = None  # the last pick (autoscale.search.choose.Choice)
        self.auto_replays: dict[Any, Any] = {}  # auto's horizon replay, once a bench

    def say(self, phase: str, text: str) -> None:
        self.session.say(phase, text)

    def warn(self, text: str) -> None:
        self.session.warn(text)

    @property
    def out(self) -> Callable[[str], None]:
        return self.session.out

    def run(self) -> None:
        """Search, validate, pick and export; then again while a round fits in the time left,
        and the last slack goes to validating more candidates (see the module docstring)."""
        plan, validator = self.plan, self.validator
        min_search = self.min_search_s
        for round_no in range(1, MAX_ROUNDS + 1):
            self.result.rounds = round_no
            first = round_no == 1
            # what this round leaves time for after its search: validating candidates (the best
            # few and the rules in the first round, the new best in later ones) and checking
            # its pick
            rules_left = [r for r in plan.rules if Candidate.rule(r) not in self.validated]
            n_rules = len(rules_left) if plan.all_rules_real else min(1, len(rules_left))
            n_rules += not self._bar_real()  # the bar
            k = CANDIDATES_PER_ROUND if first else 1
            after = validator.cost(k + (n_rules if first else 0)) + 1.2 * self.no_harm.cost(
                plan.timings, CHECKED_CANDIDATES if first else 1
            )
            if not first and self.budget.left() < after + min_search:
                self._tail()
                break
            least = validator.cost(2) + 1.2 * self.no_harm.cost(plan.timings, 1)
            stop = search_stop(time.monotonic(), self.budget.end, after, least, min_search, first)
            self._search(stop, first)
            new = self._validate(first, k)
            if not self._pick():
                return
            if not new and self._exhausted():
                self.result.stopped_early = (
                    "every candidate of the study is validated and checked: nothing left to learn"
                )
                self.say(
                    "export",
                    f"stopping with {format_duration(self.budget.left())} left: "
                    f"{self.result.stopped_early}",
                )
                return

    def _tail(self) -> None:
        """Less than a round is left: validate more of the best candidates in it and pick again;
        what is still left (the reserve a new pick's check would have needed) goes to parametric
        replay trials, which stay in the study for a resumed search or another worker. (Not RL
        trials: one trains up to its deadline and then exports and scores its agent, past it.)"""
        if self._validate(False, CANDIDATES_PER_ROUND):
            self._pick()
        left = self.budget.left()
        if left <= MIN_ROUND_SHARE * self.budget.seconds:
            return
        why = "less than a round is left (searching, then validating and checking candidates)"
        before = dict(self.counts)
        t0 = time.monotonic()
        if self.plan.space in ("parametric", "both"):
            objective_fn = ParametricObjective(
                self.bench, self.recorder, self.ledger, self.families
            )
            self._trials(objective_fn, self.budget.end)
        c = {k: self.counts[k] - before[k] for k in self.counts}
        if not sum(c.values()):  # an RL space, the trial limit (--n-trials) reached, no trial fit
            self.result.stopped_early = why
            self.say("export", f"stopping with {format_duration(self.budget.left())} left: {why}")
            return
        self.result.stopped_early = (
            f"{why}; its last {format_duration(time.monotonic() - t0)} went to the replay search: "
            f"{c['complete']} complete trials ({c['pruned']} pruned, {c['failed']} failed) kept "
            "in the study for a resumed search, not validated in this run"
        )
        self.say("export", f"{format_duration(left)} left: {self.result.stopped_early}")

    def _pick(self) -> bool:
        """Rank, check, export what changed, report; False when torch has no validation."""
        validated, state = self.validated, self.state
        if TORCH not in validated:
            self.say(
                "export",
                "nothing exported: torch could not be validated on real steps in the budget",
            )
            return False
        reference = validated[TORCH]
        ranked = rank(validated, reference, self.plan.suite.reward)
        chosen = self._choose(ranked)
        key = AUTO if chosen is None else chosen.key
        if key != state.exported:  # None only where auto had no real validation: auto itself
            self._export(chosen, reference)
            state.exported = key
        self._report(ranked, reference, state.exported)
        return True

    def _exhausted(self) -> bool:
        """No trial to run (``--n-trials`` reached) and none left to validate."""
        return self.cfg.n_trials is not None and sum(self.counts.values()) >= self.cfg.n_trials

    # ------------------------------------------------------------------ search
    def _search(self, stop: float, first: bool) -> None:
        study, plan, bench, recorder = self.study, self.plan, self.bench, self.recorder
        t0 = time.monotonic()
        before = dict(self.counts)
        rl = plan.space in ("rl", "both") and RLObjective.fits(
            bench.suite, self.warn if first else None, self.cfg.warm_start
        )
        if rl and first:  # the agent that starts at auto, whatever the time: it reaches validation
            self._warm_trial(stop)
        if stop - time.monotonic() < 1.0:
            if first and self.counts == before:
                self.say(
                    "search",
                    "no time left to search after validation's share; validating what the study has",
                )
            if self.counts == before:
                return
        elif plan.space in ("parametric", "both"):
            objective_fn = ParametricObjective(bench, recorder, self.ledger, self.families)
            until = stop if not rl else t0 + (1 - RL_SHARE_OF_BOTH) * (stop - t0)
            self._trials(objective_fn, until)
        if rl and stop - time.monotonic() >= 1.0:
            objective_fn = RLObjective(
                bench, recorder, self.ledger, stop_at=stop, seed=self.cfg.seed,
                workdir=self.workdir, warm_start=self.cfg.warm_start, warn=self.warn,
            )  # fmt: skip
            self._trials(objective_fn, stop - RLObjective.MIN_TRIAL_S / 2)
        c = {k: self.counts[k] - before[k] for k in self.counts}
        self.say(
            "search",
            f"{sum(c.values())} trials in {format_duration(time.monotonic() - t0)} ({c['complete']} complete, "
            f"{c['pruned']} pruned, {c['failed']} failed); {_best_line(study)}",
        )

    def _warm_trial(self, stop: float) -> None:
        """The study's first RL trial, the shipped residual agent fine-tuned on the replay
        (:class:`~autoscale.search.agent_trials.RLObjective`), run first and even where no time
        is left to search: then it is the shipped agent as it came, scored on the replay alone
        (seconds), so an agent that starts at ``auto`` always reaches validation."""
        objective_fn = RLObjective(
            self.bench, self.recorder, self.ledger, stop_at=stop, seed=self.cfg.seed,
            workdir=self.workdir, warm_start=self.cfg.warm_start, warn=self.warn,
        )  # fmt: skip
        if objective_fn.warm is None or any(
            t.user_attrs.get("warm_start") for t in self.study.get_trials(deepcopy=False)
        ):
            return
        n = sum(self.counts.values()) + 1
        n = n if self.cfg.n_trials is None else min(n, self.cfg.n_trials)
        TrialLoop(
            self.study, self.ledger, worker=self.worker, warn=self.warn, counts=self.counts,
            n_trials=n, progress=False,
        ).run(objective_fn, max(stop, time.monotonic() + RLObjective.MIN_TRIAL_S))  # fmt: skip

    def _trials(self, objective_fn, stop_at: float) -> None:
        TrialLoop(
            self.study,
            self.ledger,
            worker=self.worker,
            warn=self.warn,
            counts=self.counts,
            n_trials=self.cfg.n_trials,
            progress=self.cfg.progress,
        ).run(objective_fn, stop_at)

    # ------------------------------------------------------------------ validation
    def _validate(self, first: bool, k: int) -> bool:
        """Validate torch, auto, the ``k`` best candidates not validated yet and the rules (first
        round); True if anything new was."""
        import optuna

        study, plan, bench, validator = self.study, self.plan, self.bench, self.validator
        validated, factories = self.validated, self.factories

        with self.ledger.track("bk:optuna"):
            complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        done = {c.number for c in map(Candidate.parse, validated) if c.is_trial}
        # an agent in the race reaches validation: the best one, where none has yet
        kinds = {study.trials[n].user_attrs.get("policy", {}).get("kind") for n in done}
        agent = "residual" if plan.space != "parametric" and "residual" not in kinds else None
        candidates = top_candidates(
            complete, plan.suite, self.store, self.workdir, k, self.warn, skip=done, one_of=agent
        )
        trials = {t.number: t for t, _ in candidates}
        order = []
        for t, factory in candidates:
            factories[Candidate.trial(t.number)] = factory
            order.append((Candidate.trial(t.number), policy_label(t), factory))
        kinds = [t.user_attrs.get("policy", {}).get("kind") for t, _ in candidates]
        if agent and "residual" in kinds[1:] and kinds[0] != "residual":  # the agent after the best
            order.insert(1, order.pop(kinds.index("residual")))
        rules = [
            (Candidate.rule(r), r, factories[Candidate.rule(r)])
            for r in plan.rules
            if Candidate.rule(r) not in validated
        ]
        bar = [] if self._bar_real() else [(AUTO, AUTO.name, factories[AUTO])]
        # torch first (every objective is measured against it), auto (the bar a candidate must
        # clear), the best candidate (and the best agent), the other rules, the other candidates
        rules = rules[:1] + bar + rules[1:]
        n = 2 if agent and "residual" in kinds else 1  # the best agent beside the best
        order = rules[:2] + order[:n] + rules[2:] + order[n:]
        if not order:
            return False
        t0 = time.monotonic()

        def note(v: Validated) -> None:
            self._note_validated(trials.get(v.key.number) if v.key.is_trial else None, v)

        # torch and auto in any time left (no answer without them; exporting auto needs no
        # check), the rest where a pick's check still fits after them, with a margin over the
        # check's own 1.2 (a machine busier now would leave the check a few seconds short).
        # Where no check fits any more, the rest in any time left too: a candidate that leads
        # auto on the user's held-out steps cannot be exported unchecked, but the user learns
        # of it (the answer names it), and an agent in the race reaches real steps
        first_two = [o for o in order if o[0] in (TORCH, AUTO)]
        results = validator.run(first_two, self.budget.end, on_done=note) if first_two else {}
        rest = [o for o in order if o[0] not in (TORCH, AUTO)]
        check_at = self.budget.end - 1.4 * self.no_harm.cost(plan.timings, 1)
        if check_at <= time.monotonic():
            check_at = self.budget.end
        results.update(validator.run(rest, check_at, on_done=note) if rest else {})
        validated.update(results)
        if not results and not first:  # a later round that fitted nothing says nothing new
            validator.skipped.clear()
            return False
        n_cand = sum(1 for k in results if Candidate.parse(k).is_trial)
        n_rules = sum(1 for k in validated if Candidate.parse(k).is_rule)
        msg = (
            f"{n_cand} candidate(s); auto{'' if self._bar_real() else ' not yet'}; "
            f"{n_rules} of {len(plan.rules)} built-in rules so far; on "
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

    def _bar_real(self) -> bool:
        """Whether ``auto`` (the bar) is validated on real steps (replay does not count)."""
        v = self.validated.get(AUTO)
        return v is not None and v.real

    def _note_validated(self, trial, v: Validated) -> None:
        if trial is None:
            return
        study, plan = self.study, self.plan
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
    def _choose(self, ranked: list[Validated]) -> Validated | None:
        study, plan, state = self.study, self.plan, self.state
        choice = choose(
            study,
            ranked,
            self.factories,
            self.no_harm,
            plan.timings,
            self.ledger,
            weights=plan.suite.reward,
            stop_at=self.budget.end,
            say=lambda text: self.say("export", text),
            refuse=lambda v: refusal(
                v, self.study, self.cfg.families, self.bench, self.factories, self.auto_replays
            ),
        )
        self.choice = choice
        for key, why in choice.refused.items():
            text = f"{self.validated[key].label} leads auto beyond the seed noise, but {why}"
            if text not in state.said_unchecked:
                state.said_unchecked.add(text)
                self.say("export", text)
        for text in choice.unchecked:
            if text not in state.said_unchecked:
                state.said_unchecked.add(text)
                self.say("export", f"not checked: {text}")
        if choice.winner is None and choice.bar is None and not state.said_none:
            state.said_none = True
            self.say(
                "export",
                f"{choice.why}: exporting auto, the shipped general policy, unmeasured here",
            )
        return choice.winner

    def _export(self, chosen: Validated | None, reference: Validated) -> None:
        study, plan, store = self.study, self.plan, self.store
        from autoscale.scalers import make_scaler
        from autoscale.search.answer import answer_lines, evidence

        cfg, choice = self.cfg, self.choice
        provenance = {
            "storage": mask_url(cfg.storage),
            "searched_on": "replay of recorded real steps",
        }
        if chosen is not None:
            where = f"real steps: {sum(len(c) for c in chosen.cards.values())} test episodes of {plan.steps} steps"
            summary = card_summary(chosen.cards, reference.cards, plan.suite.reward, where)
            summary["evidence"] = evidence(choice, chosen, reference, plan.suite.reward)
        else:
            summary = {"evidence": {"why": choice.why, "bar": AUTO.name}}
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
            if key.is_policy:
                path = export_policy(study, key.name, cfg.export, suite=plan.suite, **kw)
                how = f"{key.name}, the shipped general policy, unchanged"
            elif key.is_rule:
                rule = key.name
                path = export_rule(study, rule, cfg.export, suite=plan.suite, **kw)
                how = f"the built-in rule {rule} with its defaults"
            else:
                trial = study.trials[key.number]
                path = export_trial(study, trial, cfg.export, suite=plan.suite, store=store, **kw)
                how = policy_label(trial)
            make_scaler(str(path), device="cpu")  # it loads
        self.result.exported, self.result.winner = path, f"{cfg.export} ({how})"
        self.result.builtin = key.is_named
        self.say("export", f"{path} ({how}); use it with autoscale.get_scaler('{cfg.export}')")
        if chosen is None:
            self.result.answer = [f"answer: exported '{cfg.export}' = {how}", f"why: {choice.why}"]
        else:
            self.result.answer = answer_lines(
                cfg.export, how, choice, chosen, reference, plan.suite.reward, plan.steps
            )

    def _report(self, ranked, reference, winner) -> None:
        study, plan = self.study, self.plan
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
                write_note(study, study_note(self.cfg.study, plan, table))
            except Exception as exc:
                self.warn(f"could not update the study note: {exc}")
        self._comparison_plot(real[:4])

    def _comparison_plot(self, rows: list[Validated]) -> None:
        """A PNG of the real-step trajectories, kept as a study artifact, where time and the
        bookkeeping share allow (a matplotlib figure costs far more than a trial's SVG)."""
        if self.budget.left() + 0.5 * self.budget.reserve < 1.0:
            return
        from matplotlib.figure import Figure  # noqa: F401  (import outside the timed drawing)

        path = self.workdir / "comparison.png"
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
                    store_artifact(self.store, path, self.study, "image/png")
                except Exception as exc:
                    self.warn(f"could not store the comparison plot: {exc}")


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


def _best_line(study: Any) -> str:
    try:
        best = study.best_trial
    except ValueError:
        return "no completed trial yet"
    p = best.user_attrs.get("policy", {})
    what = p.get("rule") or f"{p.get('algo')} agent"
    return f"best: trial {best.number} ({what}), objective {best.value:+.4f} on the train replay"
