"""Trials on replay: :class:`ParametricObjective` (RL: :mod:`~autoscale.search.agent_trials`),
scored on the train replay, and what each trial leaves in the study (:class:`TrialRecorder`).
Every trial leaves a summary per member; only the best :data:`DETAILED_TOP` also leave a plot and a
note, which cost more storage time than a replayed trial. A trial that diverges is pruned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from autoscale.search.bench import Episode, ReplayBench
from autoscale.search.budget import Ledger, percent
from autoscale.search.candidates import TORCH
from autoscale.search.objective import mean_cost, objective_terms
from autoscale.search.plots import trajectory_svg
from autoscale.search.space import suggest_parametric
from autoscale.training.bar import mean
from autoscale.training.scorecard import Scorecard, json_safe

__all__ = [
    "best_line",
    "store_artifact",
    "write_note",
    "TrialRecorder",
    "ParametricObjective",
    "trial_note",
    "member_summary",
]

DETAILED_TOP = 10  # complete trials ranking among this many best get a note and a plot


def member_summary(
    cards: dict[str, list[Scorecard]], reference: dict[str, list[Scorecard]], weights: Any
) -> dict[str, dict[str, float]]:
    """Member -> mean skip rate, precision loss and cost of ``cards``, torch's, and the regret."""
    out = {}
    for m, cs in cards.items():
        ref = reference[m][: len(cs)]
        n = len(cs)
        out[m] = {
            "episodes": n,
            "skip_rate": mean(cs, "skip_rate"),
            "precision_loss": mean(cs, "precision_loss"),
            "torch_skip_rate": mean(ref, "skip_rate"),
            "torch_precision_loss": mean(ref, "precision_loss"),
            "regret": mean_cost(cs, weights) - mean_cost(ref, weights),
        }
    return out


def trial_note(
    title: str,
    policy: str,
    cards: dict[str, list[Scorecard]],
    reference: dict[str, list[Scorecard]],
    weights: Any,
    *,
    total: int,
    test_objective: float | None = None,
) -> str:
    """Markdown: the objective, its terms, and a row per member next to ``torch``."""
    ref = {m: reference[m][: len(c)] for m, c in cards.items()}
    t = objective_terms(cards, ref, weights)
    done = sum(len(c) for c in cards.values())
    where = f"{done} of {total} train episodes" if done < total else f"{total} train episodes"
    lines = [f"### {title}", f"`{policy}`", ""]
    lines.append(
        f"**objective {t['objective']:+.4f}** on {where} (replay; 0 = `{TORCH.name}`, lower is "
        f"better): mean regret {t['mean_regret']:+.4f}, worst {t['worst_regret']:+.4f} on "
        f"`{t['worst_member']}`."
    )
    lines.append(
        f"It skipped {percent(t['skip_rate'])} of steps ({TORCH.name}: {percent(t['reference_skip_rate'])}) and "
        f"lost precision on {percent(t['precision_loss'])} of gradient elements ({TORCH.name}: "
        f"{percent(t['reference_precision_loss'])})."
    )
    diverged = [m for m, cs in cards.items() if any(c.diverged for c in cs)]
    if diverged:
        lines.append(f"Training diverged on {', '.join(diverged)}: the trial was stopped there.")
    elif done < total:
        lines.append(
            f"Pruned after {done} of {total} episodes: its running objective was worse than "
            "the median of earlier trials at that point."
        )
    lines += [
        "",
        f"| member | skip rate | precision loss | {TORCH.name} skip rate | "
        f"{TORCH.name} precision loss | regret |",
        "|---|---|---|---|---|---|",
    ]
    for m, row in member_summary(cards, ref, weights).items():
        lines.append(
            f"| {m} | {percent(row['skip_rate'])} | {percent(row['precision_loss'])} | "
            f"{percent(row['torch_skip_rate'])} | {percent(row['torch_precision_loss'])} | "
            f"{row['regret']:+.4f} |"
        )
    if test_objective is not None:
        lines += [
            "",
            f"Test episodes (replay; never used for tuning): objective {test_objective:+.4f}.",
        ]
    return "\n".join(lines) + "\n"


class TrialRecorder:
    """Writes a trial's scorecards, plot and note into the study; failures only warn."""

    def __init__(
        self,
        bench: ReplayBench,
        store: Any,
        ledger: Ledger,
        workdir: Path,
        warn: Callable[[str], None],
    ) -> None:
        self.bench, self.store, self.ledger, self.workdir = bench, store, ledger, workdir
        self.warn = warn
        self._warned: set[str] = set()

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:
            if what not in self._warned:
                self._warned.add(what)
                self.warn(f"could not store a trial's {what}: {exc} (the search goes on)")
            return None

    def record(
        self,
        trial: Any,
        *,
        policy: dict[str, Any],
        policy_text: str,
        cards: dict[str, list[Scorecard]],
        records: dict[str, list],
        test_cards: dict[str, list[Scorecard]] | None = None,
        detailed: bool = True,
    ) -> None:
        """Store the trial's summary; with ``detailed``, its plot and note too."""
        bench, weights = self.bench, self.bench.suite.reward
        test_obj = bench.objective("test", test_cards) if test_cards else None
        ref = bench.reference_for("train", cards)
        terms = objective_terms(cards, ref, weights)
        scores: dict[str, Any] = {
            "objective_terms": {k: v for k, v in terms.items() if k != "regrets"},
            "members": member_summary(cards, ref, weights),
        }
        if test_cards:
            scores["test_replay"] = {
                "objective": test_obj,
                "members": member_summary(test_cards, bench.reference["test"], weights),
            }
        # two writes (the storage's cost is per call): the policy, which export reads, and scores
        with self.ledger.track("bk:attrs"):
            for key, value in (("policy", policy), ("scores", scores)):
                self._guard("scores", lambda k=key, v=value: trial.set_user_attr(k, json_safe(v)))
        if not detailed:
            return
        kind = policy.get("rule") or f"{policy.get('algo')} agent"
        title = f"Trial {trial.number}: {kind}"
        with self.ledger.track("bk:plots"):
            panels = []
            for member in cards:  # the first episode of each member
                ep = bench.member_episodes("train", member)[0]
                if ep.key in records:
                    panels.append((member, records[ep.key], bench.thresholds(ep)))
            svg = trajectory_svg(panels, f"trial {trial.number}: {policy_text}")
            path = self.workdir / f"trial-{trial.number}-scale.svg"
            path.write_text(svg)
        with self.ledger.track("bk:artifacts"):
            self._guard("plot", lambda: store_artifact(self.store, path, trial, "image/svg+xml"))
        path.unlink(missing_ok=True)
        note = trial_note(
            title,
            policy_text,
            cards,
            bench.reference["train"],
            weights,
            total=len(bench.episodes["train"]),
            test_objective=test_obj,
        )
        with self.ledger.track("bk:notes"):
            self._guard("note", lambda: write_note(trial, note))


def store_artifact(store: Any, path: Path, study_or_trial: Any, mimetype: str) -> str:
    """Upload ``path`` to the artifact store, attached to a study or a trial; its id."""
    import warnings

    from optuna.artifacts import upload_artifact

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return upload_artifact(
            artifact_store=store,
            file_path=str(path),
            study_or_trial=study_or_trial,
            mimetype=mimetype,
        )


def best_line(study: Any) -> str:
    """The study's best trial on the train replay, in words."""
    try:
        best = study.best_trial
    except ValueError:
        return "no completed trial yet"
    p = best.user_attrs.get("policy", {})
    what = p.get("rule") or f"{p.get('algo')} agent"
    if best.user_attrs.get("baseline"):
        what = f"{what} defaults, validated as the rule {what}"
    return f"best: trial {best.number} ({what}), objective {best.value:+.4f} on the train replay"


def write_note(trial_or_study: Any, body: str) -> None:
    """The markdown note optuna-dashboard shows for a study or a trial."""
    from optuna_dashboard import save_note

    save_note(trial_or_study, body)


def describe_params(rule: str, params: dict[str, Any]) -> str:
    """``deepspeed(scale_factor=2.3, hysteresis=1)``."""

    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    return f"{rule}(" + ", ".join(f"{k}={fmt(v)}" for k, v in params.items()) + ")"


def report_points(n: int) -> set[int]:
    """After how many of ``n`` train episodes a trial reports to the pruner: a third and two
    thirds (each report is a storage write and a pruner decision that reads every trial)."""
    return {max(1, round(n * f)) for f in (1 / 3, 2 / 3)} - {n}


class Objective:
    """Shared by both spaces: score a policy on the train replay, reporting for the pruner."""

    def __init__(self, bench: ReplayBench, recorder: TrialRecorder, ledger: Ledger) -> None:
        self.bench, self.recorder, self.ledger = bench, recorder, ledger
        self.values: list[float] = []  # objectives of the complete trials seen here

    def _ranks_high(self, value: float) -> bool:
        better = sum(1 for v in self.values if v < value)
        self.values.append(value)
        return better < DETAILED_TOP

    def score(
        self,
        trial: Any,
        factory: Callable[[], Any],
        policy: dict,
        text: str,
        cards_of: Callable[[str], dict[str, list[Scorecard]] | None] | None = None,
        prune: bool = True,
    ) -> float:
        """Score ``factory``'s scalers on the train replay, reporting as it goes. ``cards_of``
        gives the same cards at once where it can (the vectorised replay). ``prune=False``: never
        pruned (a trained agent: pruning would save only its replay and lose the agent)."""
        import optuna

        bench = self.bench
        cards: dict[str, list[Scorecard]] = {}
        records: dict[str, list] | _ReplayedRecords
        with self.ledger.track("work:replay"):
            given = cards_of("train") if cards_of is not None else None
        if given is not None:
            records = _ReplayedRecords(bench, factory)
            ahead = {member: iter(c) for member, c in given.items()}
        else:
            records = {}
        episodes: list[Episode] = bench.episodes["train"]
        checkpoints = report_points(len(episodes))
        for i, ep in enumerate(episodes, 1):
            if given is not None:
                card = next(ahead[ep.member])
                if ep.offset == 0:
                    records.add(ep)
            else:
                with self.ledger.track("work:replay"):
                    card, recs = bench.episode("train", factory, ep)
                if ep.offset == 0:
                    records[ep.key] = recs
            cards.setdefault(ep.member, []).append(card)
            if i not in checkpoints and not card.diverged:
                continue
            trial.report(bench.objective("train", cards), i)
            if card.diverged or (prune and trial.should_prune()):  # diverged: not run further
                self.recorder.record(
                    trial,
                    policy=policy,
                    policy_text=text,
                    cards=cards,
                    records=records,
                    detailed=card.diverged,
                )
                why = f"diverged on {ep.instance}" if card.diverged else "pruned"
                raise optuna.TrialPruned(f"{why} after {i} of {len(episodes)} episodes")
        with self.ledger.track("work:replay"):
            test_cards = cards_of("test") if cards_of is not None else None
            if test_cards is None:
                test_cards, _ = bench.run("test", factory)
        value = bench.objective("train", cards)
        self.recorder.record(
            trial,
            policy=policy,
            policy_text=text,
            cards=cards,
            records=records,
            test_cards=test_cards,
            detailed=self._ranks_high(value),
        )
        return value


class _ReplayedRecords(Mapping):
    """Episode key -> step records, replayed only when first read (by a detailed trial's plot)."""

    def __init__(self, bench: ReplayBench, factory: Callable[[], Any]) -> None:
        self.bench, self.factory = bench, factory
        self.episodes: dict[str, Episode] = {}
        self.done: dict[str, list] = {}

    def add(self, ep: Episode) -> None:
        self.episodes[ep.key] = ep

    def __getitem__(self, key: str) -> list:
        if key not in self.done:
            self.done[key] = self.bench.episode("train", self.factory, self.episodes[key])[1]
        return self.done[key]

    def __contains__(self, key: object) -> bool:
        return key in self.episodes  # without replaying it

    def __iter__(self):
        return iter(self.episodes)

    def __len__(self) -> int:
        return len(self.episodes)


class ParametricObjective(Objective):
    """A rule family and its knobs (:func:`~autoscale.search.space.suggest_parametric`)."""

    def __init__(
        self, bench, recorder, ledger, families: dict[str, dict[str, Any]], vectorised: bool = True
    ) -> None:
        super().__init__(bench, recorder, ledger)
        self.families = families
        self.vectorised = vectorised  # replay vectorised rules in numpy (the same scorecards)

    def __call__(self, trial: Any) -> float:
        rule, params = suggest_parametric(trial, self.families)
        policy = {"kind": "parametric", "rule": rule, "params": params}
        return self.score(
            trial,
            lambda: self.bench.scaler(rule, **params),
            policy,
            describe_params(rule, params),
            (lambda which: self.bench.vector_cards(which, rule, params))
            if self.vectorised
            else None,
        )
