"""Train residual agents (an offset on ``auto``'s scale, once a window) and export them.

The agent learns on the replay of the train instances under the constraints of the acceptance
check (:class:`~autoscale.envs.residual_env.ResidualEnv`); the model kept is the one that did
best on held-out instances that it never trained on and that no later judgement reads (the
caller says which: the build and the search hold out one train instance per member). Exported
as ``kind: residual``: the base rule's family and parameters, the window, the offsets and the
actor, so that ``get_scaler(NAME)`` runs it with torch alone
(:func:`~autoscale.scalers.residual.load_residual`).
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoscale.agents.train import AgentResult
from autoscale.errors import ConfigError

__all__ = ["ResidualResult", "RESIDUAL_ALGOS", "export_residual", "train_residual"]

RESIDUAL_ALGOS = {"ppo": "discrete", "dqn": "discrete", "a2c": "discrete", "sac": "continuous"}

# the held-out episodes that pick the model pay these for each skip / point of precision loss
# beyond torch's on the same steps (fixed: the selection compares models, not multipliers)
SELECT_MULTIPLIERS = {"skip": 4.0, "precision": 4.0}


@dataclass
class ResidualResult(AgentResult):
    """What :func:`train_residual` produced: an agent's result, and the multipliers' history
    ((skip violation, precision violation, skip multiplier, precision multiplier) per episode)."""

    multipliers: list[tuple[float, float, float, float]] = field(default_factory=list)


def _hyperparams(algo: str, decisions: int) -> dict[str, Any]:
    """Defaults for episodes of ``decisions`` decisions (budgets of 10^4 - 10^5 decisions)."""
    if algo == "ppo":
        return {"n_steps": max(64, 8 * decisions), "batch_size": 64, "learning_rate": 3e-4,
                "ent_coef": 0.01, "gamma": 0.95}  # fmt: skip
    if algo == "a2c":
        return {"n_steps": 16, "learning_rate": 7e-4, "ent_coef": 0.01, "gamma": 0.95}
    if algo == "dqn":
        return {"learning_starts": 256, "buffer_size": 20000, "exploration_fraction": 0.3,
                "exploration_final_eps": 0.02, "target_update_interval": 250, "train_freq": 4,
                "gamma": 0.95}  # fmt: skip
    return {"learning_starts": 256, "buffer_size": 20000, "gamma": 0.95}


def train_residual(
    spec: Any,
    algo: str = "ppo",
    timesteps: int = 20_000,
    *,
    replay: Any,
    select_on: str | list[str] | None = "test",
    base: str = "auto",
    window: int = 16,
    max_offset: int = 4,
    constrained: bool = True,
    knobs: Any = None,
    seed: int = 0,
    hyperparams: dict[str, Any] | None = None,
    eval_freq: int | None = None,
    progress: bool = False,
    deadline: float | None = None,
    init: str | Path | None = None,
    export_name: str | None = None,
    export_dir: str | None = None,
    force: bool = False,
) -> ResidualResult:
    """Train a residual agent on the replay of ``spec``'s train instances (an env or suite
    spec; ``replay``: its traces) for ``timesteps`` decisions of ``window`` steps each, with
    ``algo`` (``ppo``, ``dqn``, ``a2c``: offsets -max_offset..+max_offset bits; ``sac``: a
    continuous offset) on ``base`` (a scaler name), to the bar unless ``constrained`` is False.
    The model kept is the best on ``select_on``, instances held out from training that no later
    judgement reads (the build passes a spec whose ``test`` set is one held-out train instance
    per member; None: no selection, the last model is kept); ``knobs``: scenario knobs
    (:class:`~autoscale.envs.knobs.Knobs`) drawn per training episode, the held-out selection
    replayed as recorded; ``init``: a saved SB3 model of ``algo`` to go on training; ``export_name``:
    export it as a policy (into ``export_dir``; ``force`` replaces one)."""
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.monitor import Monitor

    from autoscale.agents.train import deadline_callback, load_model, progress_callback, sb3_class
    from autoscale.envs.residual_env import Multipliers, ResidualEnv
    from autoscale.envs.suite import load_spec

    algo = _check(algo, timesteps, replay, export_name, export_dir, force)
    spec = load_spec(spec)
    common = {"base": base, "window": window, "mode": RESIDUAL_ALGOS[algo],
              "max_offset": max_offset, "constrained": constrained}  # fmt: skip
    train_env = ResidualEnv(spec, "train", replay, random_offset=True, knobs=knobs, **common)
    multipliers = train_env.multipliers
    eval_env = None if select_on is None else Monitor(
        ResidualEnv(spec, select_on, replay, learn_multipliers=False,
                    multipliers=Multipliers(**SELECT_MULTIPLIERS), **common)
    )  # fmt: skip
    decisions = max(1, spec.episode.horizon // window)
    train_env = Monitor(train_env)
    if init is not None:
        model = load_model(algo, init, train_env, seed, None, hyperparams or {})
    else:
        params = {**_hyperparams(algo, decisions), **(hyperparams or {})}
        model = sb3_class(algo)("MlpPolicy", train_env, seed=seed, verbose=0, **params)
    model.set_logger(Logger(folder=None, output_formats=[]))
    callbacks = [deadline_callback(deadline)] + ([progress_callback(timesteps)] if progress else [])
    t0 = time.monotonic()
    model, best, history = _learn(
        model,
        algo,
        eval_env,
        callbacks,
        timesteps,
        eval_freq or max(decisions * 4, timesteps // 10),
    )
    result = ResidualResult(
        model, algo, timesteps, time.monotonic() - t0, best,
        multipliers=list(multipliers.history), eval_history=history,
    )  # fmt: skip
    if export_name:
        result.policy_dir = export_residual(
            model, export_name, train_env.unwrapped, workload=_workload(spec),
            training={"algo": algo, "timesteps": timesteps, "constrained": constrained,
                      "knobs": knobs.to_dict() if knobs is not None else None,
                      "multipliers": multipliers.to_dict(), "wall_s": round(result.wall_s, 1)},
            out_dir=export_dir, force=force,
        )  # fmt: skip
    return result


def _learn(model, algo: str, eval_env, callbacks: list, timesteps: int, eval_freq: int):
    """Train ``model``, evaluating it on ``eval_env`` every ``eval_freq`` decisions; return the
    best of those evaluations' models, its mean reward, and (decisions, mean reward) of each
    (no ``eval_env``: the last model, NaN, and no evaluation)."""
    from stable_baselines3.common.callbacks import CallbackList

    if eval_env is None:
        model.learn(total_timesteps=timesteps, callback=CallbackList(callbacks))
        return model, math.nan, []
    from stable_baselines3.common.callbacks import EvalCallback

    from autoscale.agents.train import sb3_class
    from autoscale.envs.episodes import instance_names

    with tempfile.TemporaryDirectory(prefix="autoscale-residual-") as tmp:
        evaluator = EvalCallback(
            eval_env, best_model_save_path=tmp, log_path=tmp, eval_freq=eval_freq,
            n_eval_episodes=len(instance_names(eval_env.unwrapped.inner)), deterministic=True,
            verbose=0,
        )  # fmt: skip
        model.learn(total_timesteps=timesteps, callback=CallbackList([evaluator, *callbacks]))
        if (Path(tmp) / "best_model.zip").exists():
            model = sb3_class(algo).load(Path(tmp) / "best_model.zip", env=model.get_env())
        history = [
            (int(t), sum(r) / len(r))
            for t, r in zip(evaluator.evaluations_timesteps, evaluator.evaluations_results)
        ]
    return model, float(evaluator.best_mean_reward), history


def _check(algo: str, timesteps: Any, replay: Any, export_name, export_dir, force: bool) -> str:
    """The algorithm's name, after every argument is checked (before any work)."""
    algo = algo.lower()
    if algo not in RESIDUAL_ALGOS:
        from autoscale.errors import unknown_name

        raise unknown_name(
            "residual algorithm", algo, RESIDUAL_ALGOS, "autoscale train-agent --help"
        )
    if isinstance(timesteps, bool) or not isinstance(timesteps, int) or timesteps <= 0:
        raise ConfigError(f"timesteps must be a positive integer, got {timesteps!r}")
    if replay is None:
        raise ConfigError("a residual agent trains on replay: give the traces (--replay)")
    if export_name:
        from autoscale.scalers.policies import check_export_dest

        check_export_dest(export_name, export_dir, force, flag="--out")
    return algo


def _workload(spec: Any) -> dict[str, Any]:
    """What the manifest says the agent trained on."""
    if hasattr(spec, "members"):
        return {
            "suite": spec.name,
            "members": [m.name for m in spec.members],
            "trained_on": "replay",
        }
    return {**spec.workload.to_dict(), "env": spec.name, "trained_on": "replay"}


def export_residual(
    model: Any,
    name: str,
    env: Any,
    *,
    workload: dict[str, Any] | None = None,
    training: dict[str, Any] | None = None,
    out_dir: str | None = None,
    force: bool = False,
) -> Path:
    """Export ``model`` (trained on ``env``, a :class:`ResidualEnv`) as ``out_dir/NAME``."""
    from autoscale.agents.export import export_neural
    from autoscale.scalers.residual import RESIDUAL_VERSION

    rule, ep = env.new_rule(), env.spec.episode
    parts = {k: v for k, v in rule.params().items() if k != "action"}
    return export_neural(
        model, name, rule.action.to_dict(),
        workload={**(workload or {}), **({"training": training} if training else {})},
        scales={**parts, "residual_version": RESIDUAL_VERSION, "init_scale": ep.init_scale,
                "min_scale": ep.min_scale, "max_scale": ep.max_scale},
        out_dir=out_dir, force=force, kind="residual",
        family=f"residual-{rule.base.name}-{type(model).__name__.lower()}",
    )  # fmt: skip
