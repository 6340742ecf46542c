"""RL trials on replay: a residual agent on ``auto`` trained to the bar within a per-trial deadline,
exported and scored like any candidate (:class:`~autoscale.search.trials.Objective`); the study's
first one fine-tunes the residual agent shipped with autoscale (:mod:`autoscale.agents.warm`)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoscale.search.space import suggest_residual
from autoscale.search.trials import Objective, describe_params, store_artifact

__all__ = ["RLObjective"]


class RLObjective(Objective):
    """A residual agent on ``auto`` (:mod:`autoscale.agents.residual`) trained on the train
    replay to the bar under a per-trial deadline; its exported policy is kept as an artifact.
    With ``warm_start``, the study's first RL trial fine-tunes the shipped agent instead
    (``warm_before``: its objective before) and stays the shipped agent where fine-tuning does not
    beat it (``warm_kept``). See docs/search.md, "Agents start warm"."""

    MIN_TRIAL_S, MAX_TRIAL_S = 10.0, 300.0
    WARM_LEAST_S = 2.0  # less time than this: the warm trial is the shipped agent, untrained
    WINDOW = 16  # steps a cold agent's offset holds (the warm one keeps its own)

    def __init__(
        self, bench, recorder, ledger, *, stop_at: float, seed: int, workdir: Path,
        warm_start: bool = False, warn: Callable[[str], Any] | None = None,
    ):  # fmt: skip
        super().__init__(bench, recorder, ledger)
        self.stop_at, self.seed, self.workdir = stop_at, seed, workdir
        self.rate = 500.0  # decisions per second; updated from each trial
        # seconds the last trial took past its training (export, judging, scoring): the next
        # trial's training stops that much early, so the trial ends by its deadline
        self.after_s = 0.0
        from autoscale.agents.warm import RESIDUAL, shipped_agent

        self.warm = shipped_agent(which=RESIDUAL) if warm_start else None
        self.warn = warn or (lambda text: None)

    @staticmethod
    def warm_ships() -> bool:
        """Whether the residual agent a study's first RL trial starts from ships here."""
        from autoscale.agents.warm import RESIDUAL, shipped_agent

        return shipped_agent(which=RESIDUAL) is not None

    @staticmethod
    def fits(suite: Any, warn: Callable[[str], Any] | None = None, warm_start: bool = True) -> bool:
        """Whether agents can train on ``suite``'s recorded train instances: with two per member
        one selects the agent; with one, only where a shipped residual agent starts them (it is
        judged by the real-step validation alone); ``warn`` says why not."""
        if min(len(m.instances["train"]) for m in suite.members) >= 2:
            return True
        if warm_start and RLObjective.warm_ships():
            return True
        if warn is not None:
            warn(
                "no RL trials: an agent needs two recorded train instances per member (one "
                "selects it), or the shipped residual agent to start from, and the plan kept one; "
                "the parametric search takes their time"
            )
        return False

    def trial_seconds(self) -> float:
        left = self.stop_at - time.monotonic()
        return min(max(left / 3, self.MIN_TRIAL_S), self.MAX_TRIAL_S, left)

    def _warm_for(self, trial: Any):
        """The shipped residual agent for the study's first RL trial, else None."""
        if self.warm is None:
            return None
        earlier = trial.study.get_trials(deepcopy=False)
        if any(t.user_attrs.get("warm_start") for t in earlier if t.number != trial.number):
            return None
        from autoscale.scalers.actions import ActionMap
        from autoscale.scalers.residual import default_offsets

        mine = ActionMap(deltas=default_offsets()).to_dict()
        if self.warm.window is None or self.warm.action != mine:
            self.warn(
                f"agents start from nothing: the shipped agent '{self.warm.name}' is not a "
                f"residual agent of offsets {mine['deltas']} (it has {self.warm.action})"
            )
            self.warm = None
        return self.warm

    def __call__(self, trial: Any) -> float:
        from autoscale.agents.residual import train_residual

        suite, traces = self.bench.suite, self.bench.traces
        warm = self._warm_for(trial)
        if warm is not None:
            trial.set_user_attr("warm_start", warm.name)
            cfg = {"algo": warm.algo, "hyperparams": {}, "precision_x": 1.0}
        else:
            cfg = suggest_residual(trial)
        window = warm.window if warm is not None else self.WINDOW
        select = min(len(m.instances["train"]) for m in suite.members) >= 2
        rl_spec = self._rl_spec(cfg["precision_x"], select)
        seconds = self.trial_seconds()
        folder = Path(tempfile.mkdtemp(dir=self.workdir, prefix=f"trial-{trial.number}-"))
        trained = None  # when training ended, or its deadline if that came first
        try:
            with self.ledger.track("work:rl"):
                t0 = time.monotonic()
                after = self.after_s
                if warm is not None:  # the shipped agent as it is, on the same replay
                    before, shipped = self._objective_of_shipped(rl_spec, folder, window)
                    trial.set_user_attr("warm_before", before)
                    judged_s = time.monotonic() - t0
                    seconds = max(0.0, seconds - judged_s)
                    # judged again after training, then exported and scored: about thrice
                    after = max(after, 3 * judged_s)
                seconds = max(0.0, seconds - after)
                t1 = time.monotonic()
                if warm is not None and seconds < self.WARM_LEAST_S:  # no time: as it came
                    path, done = shipped, 0
                else:
                    result = train_residual(
                        rl_spec, cfg["algo"], max(64, int(self.rate * seconds)), replay=traces,
                        select_on="test" if select else None, window=window,
                        seed=self.seed + trial.number, hyperparams=cfg["hyperparams"],
                        deadline=t1 + seconds, init=warm.model if warm is not None else None,
                        export_name="policy", export_dir=str(folder), force=True,
                    )  # fmt: skip
                    done = int(getattr(result.model, "num_timesteps", 0))
                    self.rate = max(50.0, done / max(1e-3, time.monotonic() - t1))
                    path = result.policy_dir
                trained = min(time.monotonic(), t1 + seconds)
                if warm is not None and (done == 0 or not self._train_objective(path) < before):
                    # the fine-tuning did not beat where it started: the trial is the start
                    path, done = shipped, 0
                    trial.set_user_attr("warm_kept", True)
            with self.ledger.track("bk:artifacts"):
                archive = shutil.make_archive(str(folder / "policy"), "zip", path)
                artifact = store_artifact(
                    self.recorder.store, Path(archive), trial, "application/zip"
                )
            policy = {
                "kind": "residual",
                "base": "auto",
                "window": window,
                "algo": cfg["algo"],
                "hyperparams": cfg["hyperparams"],
                "reward_precision_x": cfg["precision_x"],
                "timesteps": done,
                "artifact_id": artifact,
            }
            shown = {"on": "auto", **cfg["hyperparams"], "decisions": done}
            if warm is not None:
                policy["warm_start"] = warm.name
                shown = {"from": warm.name, **shown}
            text = describe_params(f"residual-{cfg['algo']}", shown)
            factory = lambda: self.bench.scaler(str(path))  # noqa: E731
            return self.score(trial, factory, policy, text, prune=False)
        finally:
            if trained is not None:  # (a trial that diverged in its scoring too)
                self.after_s = time.monotonic() - trained
            shutil.rmtree(folder, ignore_errors=True)

    def _rl_spec(self, precision_x: float, select: bool) -> Any:
        """The searched suite as the agent trains on it (``select``: on the last train instance)."""

        def shaped(member):
            train = member.instances["train"]
            reward = dataclasses.replace(
                member.reward, precision=member.reward.precision * precision_x
            )
            if not select:
                return dataclasses.replace(member, reward=reward)
            instances = {"train": train[:-1], "test": train[-1:]}
            return dataclasses.replace(member, instances=instances, reward=reward)

        suite = self.bench.suite
        return dataclasses.replace(
            suite, members=tuple(shaped(m) for m in suite.members), left_out=()
        )

    def _train_objective(self, path: Path) -> float:
        """The train-replay objective of the policy exported at ``path``."""
        cards, _ = self.bench.run("train", lambda: self.bench.scaler(str(path)))
        return float(self.bench.objective("train", cards))

    def _objective_of_shipped(self, rl_spec, folder: Path, window: int) -> tuple[float, Path]:
        """The shipped agent's train-replay objective before fine-tuning, and its export."""
        from autoscale.agents.residual import export_residual
        from autoscale.agents.train import saved_agent
        from autoscale.envs.residual_env import ResidualEnv

        model = saved_agent(self.warm.algo, self.warm.model)
        env = ResidualEnv(rl_spec, "train", self.bench.traces, window=window, constrained=False)
        path = export_residual(model, "shipped", env, out_dir=str(folder))
        return self._train_objective(path), path
