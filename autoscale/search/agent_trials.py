"""RL trials on replay: an SB3 agent trained within a per-trial deadline, exported and scored like
any candidate (:class:`~autoscale.search.trials.Objective`); the study's first one fine-tunes the
general agent shipped with autoscale (:mod:`autoscale.agents.warm`)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError
from autoscale.search.space import suggest_rl
from autoscale.search.trials import Objective, describe_params, store_artifact

__all__ = ["RLObjective"]


class RLObjective(Objective):
    """An SB3 agent trained on the train replay (one train instance held out to select the
    agent on), under a per-trial deadline; its exported policy is kept as an artifact.

    With ``warm_start`` (and a general agent shipped, :mod:`autoscale.agents.warm`), the study's first RL
    trial fine-tunes it on the replay instead of training one from nothing, and records its
    objective before (``warm_before``) beside the one after (the trial's value); where its
    actions or observations cannot be this search's, ``warn`` says why and agents start cold."""

    MIN_TRIAL_S, MAX_TRIAL_S = 10.0, 300.0

    def __init__(
        self, bench, recorder, ledger, *, stop_at: float, seed: int, workdir: Path,
        warm_start: bool = False, warn: Callable[[str], Any] | None = None,
    ):  # fmt: skip
        super().__init__(bench, recorder, ledger)
        self.stop_at, self.seed, self.workdir = stop_at, seed, workdir
        self.rate = 800.0  # environment steps per second; updated from each trial
        from autoscale.agents.warm import shipped_agent

        self.warm = shipped_agent() if warm_start else None
        self.warn = warn or (lambda text: None)

    @staticmethod
    def fits(suite: Any, warn: Callable[[str], Any] | None = None) -> bool:
        """Whether agents can train on ``suite``'s recorded train instances: one of them selects
        the agent, so every member needs two (a re-plan under load may have kept one); ``warn``
        says why not."""
        if min(len(m.instances["train"]) for m in suite.members) >= 2:
            return True
        if warn is not None:
            warn(
                "no RL trials: an agent needs two recorded train instances per member (one "
                "selects it), and the plan kept one; the parametric search takes their time"
            )
        return False

    def trial_seconds(self) -> float:
        left = self.stop_at - time.monotonic()
        return min(max(left / 3, self.MIN_TRIAL_S), self.MAX_TRIAL_S, left)

    def _warm_episodes(self, trial: Any) -> dict[str, Any] | None:
        """Member -> episode as the shipped agent sees it, for the study's first RL trial where
        the agent fits; else None."""
        if self.warm is None:
            return None
        earlier = trial.study.get_trials(deepcopy=False)
        if any(t.user_attrs.get("warm_start") for t in earlier if t.number != trial.number):
            return None
        try:
            return {m.name: self.warm.episode_for(m.episode) for m in self.bench.suite.members}
        except ConfigError as exc:
            self.warn(f"agents start from nothing: {exc}")
            self.warm = None
            return None

    def __call__(self, trial: Any) -> float:
        from autoscale.agents.train import export_agent, train_agent

        suite, traces = self.bench.suite, self.bench.traces
        warm_episodes = self._warm_episodes(trial)
        if warm_episodes is not None:
            trial.set_user_attr("warm_start", self.warm.name)
            cfg = {
                "algo": self.warm.algo,
                "hyperparams": {},
                "precision_x": 1.0,
                "scale_time": self.warm.scale_time,
            }
        else:
            guarded = any(m.episode.guard is not None for m in suite.members)
            cfg = suggest_rl(trial, suite.episode.action.mode, scale_time=not guarded)

        def held_out(member):  # one train instance selects the agent; the test set stays unseen
            train = member.instances["train"]
            if warm_episodes is not None:
                episode = warm_episodes[member.name]
            else:
                episode = member.episode.at_scale_time() if cfg["scale_time"] else member.episode
            return dataclasses.replace(
                member,
                instances={"train": train[:-1], "test": train[-1:]},
                reward=dataclasses.replace(
                    member.reward, precision=member.reward.precision * cfg["precision_x"]
                ),
                episode=episode,
            )

        rl_spec = dataclasses.replace(
            suite, members=tuple(held_out(m) for m in suite.members), left_out=()
        )
        seconds = self.trial_seconds()
        timesteps = max(4 * suite.episode.steps, int(self.rate * seconds))
        folder = Path(tempfile.mkdtemp(dir=self.workdir, prefix=f"trial-{trial.number}-"))
        try:
            with self.ledger.track("work:rl"):
                t0 = time.monotonic()
                if warm_episodes is not None:  # the shipped agent as it is, on the same replay
                    trial.set_user_attr("warm_before", self._objective_of_shipped(rl_spec, folder))
                    seconds = max(0.0, seconds - (time.monotonic() - t0))
                result = train_agent(
                    rl_spec,
                    cfg["algo"],
                    timesteps,
                    replay=traces,
                    seed=self.seed + trial.number,
                    hyperparams=cfg["hyperparams"],
                    deadline=t0 + seconds,
                    init=self.warm.model if warm_episodes is not None else None,
                )
                done = int(getattr(result.model, "num_timesteps", timesteps))
                self.rate = max(50.0, done / max(1e-3, time.monotonic() - t0))
                path = export_agent(
                    result.model, rl_spec, "policy", export_dir=folder, replay=traces
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
                "scale_time": cfg["scale_time"],
                "timesteps": done,
                "artifact_id": artifact,
            }
            shown = {**cfg["hyperparams"], "steps": done}
            if warm_episodes is not None:
                policy["warm_start"] = self.warm.name
                shown = {"from": self.warm.name, **shown}
            if cfg["scale_time"]:
                shown["scale_time"] = True
            text = describe_params(cfg["algo"], shown)
            factory = lambda: self.bench.scaler(str(path))  # noqa: E731
            return self.score(trial, factory, policy, text, prune=False)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _objective_of_shipped(self, rl_spec, folder: Path) -> float:
        """The train-replay objective of the shipped agent before any fine-tuning."""
        from autoscale.agents.train import export_agent, saved_agent

        model = saved_agent(self.warm.algo, self.warm.model)
        path = export_agent(model, rl_spec, "shipped", export_dir=folder, replay=self.bench.traces)
        cards, _ = self.bench.run("train", lambda: self.bench.scaler(str(path)))
        return float(self.bench.objective("train", cards))
