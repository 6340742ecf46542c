"""Trials on replay: the parametric and the RL objective, and what each trial leaves in the study.

A trial is tuned on the train instances' replay: it reports its running objective to the pruner
as it goes (:func:`report_points`), and is also scored on the test instances' replay, for the
record only.
Every trial, pruned ones included, leaves its scorecards as user attributes, an SVG of its scale
trajectories as an artifact, and a markdown note saying why it scored as it did, next to the
``torch`` rule on the same instances. A trial whose training diverges is stopped and recorded as
pruned (worse than any complete trial for the sampler); one that raises is failed by the loop.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoscale.agents.evaluate import drive_episode, scaler_for
from autoscale.envs.spec import EnvSpec
from autoscale.envs.traces import Trace
from autoscale.search.budget import Ledger
from autoscale.search.objective import objective, objective_terms
from autoscale.search.plots import trajectory_svg
from autoscale.search.space import suggest_parametric, suggest_rl
from autoscale.training.scorecard import Scorecard, json_safe

__all__ = [
    "store_artifact",
    "write_note",
    "ReplayBench",
    "TrialRecorder",
    "ParametricObjective",
    "RLObjective",
    "trial_note",
    "worker_id",
    "REFERENCE_RULE",
]

REFERENCE_RULE = "torch"
POLICY_ARTIFACT = "policy.zip"


def worker_id() -> str:
    """``host:pid``, naming the worker that ran a trial or a validation."""
    return f"{socket.gethostname()}:{os.getpid()}"


class ReplayBench:
    """Replay envs over the train and test instances of a trace, and the reference rule on them."""

    def __init__(self, spec: EnvSpec, trace: Trace) -> None:
        from autoscale.envs.replay_env import ReplayEnv

        self.spec, self.trace = spec, trace
        self.envs = {which: ReplayEnv(spec, trace, instances=which) for which in ("train", "test")}
        self.reference = {
            which: self.run(which, lambda: scaler_for(REFERENCE_RULE, spec))[0]
            for which in self.envs
        }

    def instances(self, which: str) -> list[str]:
        return [i.name for i in self.spec.instances[which]]

    def episode(self, which: str, factory: Callable[[], Any], instance: str):
        """(scorecard, records) of one replayed episode."""
        return drive_episode(self.envs[which], factory(), instance)

    def run(self, which: str, factory: Callable[[], Any]):
        """({instance: scorecard}, {instance: records}) over a whole set."""
        cards, records = {}, {}
        for name in self.instances(which):
            cards[name], records[name] = self.episode(which, factory, name)
        return cards, records

    def thresholds(self, instance: str) -> list[float]:
        return self.trace.instance(instance).threshold[: self.spec.episode.steps].tolist()


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%" if math.isfinite(x) else "n/a"


def trial_note(
    title: str,
    policy: str,
    cards: dict[str, Scorecard],
    reference: dict[str, Scorecard],
    weights: Any,
    *,
    total: int,
    test_objective: float | None = None,
    test_reference: float | None = None,
) -> str:
    """Markdown: the objective, its terms next to the reference rule's on the same instances, and
    a table per instance. ``total``: train instances a complete trial is scored on."""
    t = objective_terms(cards.values(), weights)
    ref = objective_terms([reference[k] for k in cards], weights)
    lines = [f"### {title}", f"`{policy}`", ""]
    where = (
        f"{len(cards)} of {total} train instances"
        if len(cards) < total
        else f"{total} train instances"
    )
    lines.append(
        f"**objective {t['objective']:.4f}** on {where} (replay); "
        f"`{REFERENCE_RULE}` on the same: {ref['objective']:.4f} (lower is better)."
    )
    terms = {"skipped steps": t["skip_term"], "precision loss": t["precision_term"]}
    if t["divergence_term"]:
        terms["divergence"] = t["divergence_term"]
    main = max(terms, key=terms.get)
    lines.append(
        f"It skipped {_pct(t['skip_rate'])} of steps ({REFERENCE_RULE}: {_pct(ref['skip_rate'])}) and lost "
        f"precision on {_pct(t['precision_loss'])} of gradient elements ({REFERENCE_RULE}: "
        f"{_pct(ref['precision_loss'])}); most of its cost comes from {main}."
    )
    diverged = [k for k, c in cards.items() if c.diverged]
    if diverged:
        lines.append(f"Training diverged on {', '.join(diverged)}: the trial was stopped there.")
    elif len(cards) < total:
        lines.append(
            f"Pruned after {len(cards)} of {total} instances: its running objective was worse than "
            "the median of earlier trials at that point."
        )
    lines += [
        "",
        f"| instance | skip rate | precision loss | {REFERENCE_RULE} skip rate | {REFERENCE_RULE} precision loss |",
        "|---|---|---|---|---|",
    ]
    for name, c in cards.items():
        r = reference[name]
        lines.append(
            f"| {name} | {_pct(c.skip_rate)} | {_pct(c.precision_loss)} | {_pct(r.skip_rate)} | "
            f"{_pct(r.precision_loss)} |"
        )
    if test_objective is not None:
        lines += [
            "",
            f"Test instances (replay; never used for tuning): objective {test_objective:.4f} "
            f"({REFERENCE_RULE}: {test_reference:.4f}).",
        ]
    return "\n".join(lines) + "\n"


class TrialRecorder:
    """Writes a trial's scorecards, plot and note into the study; failures only warn.

    Every write is timed into the ledger under ``bk:*`` (bookkeeping).
    """

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
        cards: dict[str, Scorecard],
        records: dict[str, list],
        test_cards: dict[str, Scorecard] | None = None,
    ) -> None:
        bench, weights = self.bench, self.bench.spec.reward
        test_obj = objective(test_cards.values(), weights) if test_cards else None
        attrs = {
            "policy": policy,
            "scorecards": {k: c.to_dict() for k, c in cards.items()},
            "objective_terms": objective_terms(cards.values(), weights),
        }
        if test_cards:
            attrs["test_replay"] = {
                "objective": test_obj,
                "scorecards": {k: c.to_dict() for k, c in test_cards.items()},
            }
        with self.ledger.track("bk:attrs"):
            for key, value in attrs.items():
                self._guard(
                    "scorecards", lambda k=key, v=value: trial.set_user_attr(k, json_safe(v))
                )
        kind = policy.get("rule") or f"{policy.get('algo')} agent"
        title = f"Trial {trial.number}: {kind}"
        with self.ledger.track("bk:plots"):
            svg = trajectory_svg(
                [(name, records[name], bench.thresholds(name)) for name in cards],
                f"trial {trial.number}: {policy_text}",
            )
            path = self.workdir / f"trial-{trial.number}-scale.svg"
            path.write_text(svg)
        with self.ledger.track("bk:artifacts"):
            self._guard("plot", lambda: store_artifact(self.store, path, trial, "image/svg+xml"))
        path.unlink(missing_ok=True)
        ref_test = bench.reference["test"]
        note = trial_note(
            title,
            policy_text,
            cards,
            bench.reference["train"],
            weights,
            total=len(bench.instances("train")),
            test_objective=test_obj,
            test_reference=objective([ref_test[k] for k in test_cards], weights)
            if test_cards
            else None,
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
    """After how many of ``n`` train instances a trial reports its running objective to the
    pruner: after each one up to 4 instances, else after a quarter, half and three quarters (each
    report is a storage write and a pruner decision)."""
    if n <= 4:
        return set(range(1, n))
    return {max(1, round(n * f)) for f in (0.25, 0.5, 0.75)} - {n}


class _Objective:
    """Shared by both spaces: score a policy on the train replay, reporting for the pruner."""

    def __init__(self, bench: ReplayBench, recorder: TrialRecorder, ledger: Ledger) -> None:
        self.bench, self.recorder, self.ledger = bench, recorder, ledger

    def score(self, trial: Any, factory: Callable[[], Any], policy: dict, text: str) -> float:
        import optuna

        weights = self.bench.spec.reward
        cards, records = {}, {}
        names = self.bench.instances("train")
        checkpoints = report_points(len(names))
        for i, name in enumerate(names, 1):
            with self.ledger.track("work:replay"):
                cards[name], records[name] = self.bench.episode("train", factory, name)
            diverged = cards[name].diverged
            if i not in checkpoints and not diverged:
                continue
            trial.report(objective(cards.values(), weights), i)
            if diverged or trial.should_prune():  # a diverging policy is not run further
                self.recorder.record(
                    trial, policy=policy, policy_text=text, cards=cards, records=records
                )
                why = f"diverged on {name}" if diverged else "pruned"
                raise optuna.TrialPruned(f"{why} after {i} of {len(names)} instances")
        with self.ledger.track("work:replay"):
            test_cards, _ = self.bench.run("test", factory)
        self.recorder.record(
            trial,
            policy=policy,
            policy_text=text,
            cards=cards,
            records=records,
            test_cards=test_cards,
        )
        return objective(cards.values(), weights)


class ParametricObjective(_Objective):
    """A rule family and its knobs (:func:`~autoscale.search.space.suggest_parametric`)."""

    def __init__(self, bench, recorder, ledger, families: dict[str, dict[str, Any]]) -> None:
        super().__init__(bench, recorder, ledger)
        self.families = families

    def __call__(self, trial: Any) -> float:
        rule, params = suggest_parametric(trial, self.families)
        spec = self.bench.spec
        policy = {"kind": "parametric", "rule": rule, "params": params}
        return self.score(
            trial, lambda: scaler_for(rule, spec, **params), policy, describe_params(rule, params)
        )


class RLObjective(_Objective):
    """An SB3 agent trained on the train replay (one train instance held out to select the
    agent on), under a per-trial deadline; its exported policy is kept as an artifact."""

    MIN_TRIAL_S, MAX_TRIAL_S = 10.0, 300.0

    def __init__(self, bench, recorder, ledger, *, stop_at: float, seed: int, workdir: Path):
        super().__init__(bench, recorder, ledger)
        self.stop_at, self.seed, self.workdir = stop_at, seed, workdir
        self.rate = 800.0  # environment steps per second; updated from each trial

    def trial_seconds(self) -> float:
        left = self.stop_at - time.monotonic()
        return min(max(left / 3, self.MIN_TRIAL_S), self.MAX_TRIAL_S, left)

    def __call__(self, trial: Any) -> float:
        from autoscale.agents.train import export_agent, train_agent

        spec, trace = self.bench.spec, self.bench.trace
        cfg = suggest_rl(trial, spec.episode.action.mode)
        train = spec.instances["train"]
        rl_spec = dataclasses.replace(
            spec,
            instances={"train": train[:-1], "test": train[-1:]},
            reward=dataclasses.replace(
                spec.reward, precision=spec.reward.precision * cfg["precision_x"]
            ),
        )
        seconds = self.trial_seconds()
        timesteps = max(4 * spec.episode.steps, int(self.rate * seconds))
        folder = Path(tempfile.mkdtemp(dir=self.workdir, prefix=f"trial-{trial.number}-"))
        try:
            with self.ledger.track("work:rl"):
                t0 = time.monotonic()
                result = train_agent(
                    rl_spec,
                    cfg["algo"],
                    timesteps,
                    replay=trace,
                    seed=self.seed + trial.number,
                    hyperparams=cfg["hyperparams"],
                    deadline=t0 + seconds,
                )
                done = int(getattr(result.model, "num_timesteps", timesteps))
                self.rate = max(50.0, done / max(1e-3, time.monotonic() - t0))
                path = export_agent(
                    result.model, rl_spec, "policy", export_dir=folder, replay=trace
                )
            with self.ledger.track("bk:artifacts"):
                archive = shutil.make_archive(str(folder / "policy"), "zip", path)
                artifact = store_artifact(
                    self.recorder.store, Path(archive), trial, "application/zip"
                )
            policy = {
                "kind": "neural",
                "algo": cfg["algo"],
                "hyperparams": cfg["hyperparams"],
                "reward_precision_x": cfg["precision_x"],
                "timesteps": done,
                "artifact_id": artifact,
            }
            text = describe_params(cfg["algo"], {**cfg["hyperparams"], "steps": done})
            return self.score(trial, lambda: scaler_for(str(path), spec), policy, text)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
