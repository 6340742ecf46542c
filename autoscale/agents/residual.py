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

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError

__all__ = ["ResidualResult", "RESIDUAL_ALGOS", "export_residual", "train_residual"]

RESIDUAL_ALGOS = {"ppo": "discrete", "dqn": "discrete", "a2c": "discrete", "sac": "continuous"}

# the held-out episodes that pick the model pay these for each skip / point of precision loss
# beyond torch's on the same steps (fixed: the selection compares models, not multipliers)
SELECT_MULTIPLIERS = {"skip": 4.0, "precision": 4.0}


@dataclass
class ResidualResult:
    """What :func:`train_residual` produced."""

    model: Any
    algo: str
    timesteps: int
    wall_s: float
    best_eval_reward: float
    policy_dir: Path | None = None
    multipliers: list[tuple[float, float, float, float]] = field(default_factory=list)
    eval_history: list[tuple[int, float]] = field(default_factory=list)


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
    select_on: str | list[str] = "test",
    base: str = "auto",
    window: int = 16,
    max_offset: int = 4,
    constrained: bool = True,
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
    """Train a residual agent on the replay of ``spec``'s train instances.

    Args:
        spec: Env or suite spec; its ``train`` instances are trained on.
        algo: ``ppo``, ``dqn`` or ``a2c`` (discrete offsets), ``sac`` (continuous).
        timesteps: Decisions (windows) to train for.
        replay: The traces (a path or Trace; for a suite member -> Trace or a folder).
        select_on: The instance set the model is selected on: held out from training, and read
            by no later judgement (the caller's split: the build passes a spec whose ``test``
            set is one held-out train instance per member).
        base: The rule underneath (a scaler name).
        window: Steps an offset holds.
        max_offset: Offsets span -max_offset..+max_offset bits.
        constrained: Train to the bar (torch's replay and Lagrange multipliers); False: the
            weighted objective alone.
        init: A saved SB3 model of ``algo`` to go on training (fine-tuning).
        export_name, export_dir, force: Export the selected model as a policy.
    """
    import stable_baselines3 as sb3
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList, EvalCallback
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.monitor import Monitor

    from autoscale.envs.episodes import instance_names
    from autoscale.envs.residual_env import Multipliers, ResidualEnv
    from autoscale.envs.suite import load_spec

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
    spec = load_spec(spec)
    if export_name:
        from autoscale.scalers.policies import (
            check_policy_name,
            default_policy_dir,
            existing_policy_error,
        )

        dest = Path(export_dir or default_policy_dir()) / check_policy_name(export_name)
        if dest.exists() and not force:
            raise existing_policy_error(dest)
    mode = RESIDUAL_ALGOS[algo]
    common = {"base": base, "window": window, "mode": mode, "max_offset": max_offset}
    train_env = ResidualEnv(
        spec, "train", replay, constrained=constrained, random_offset=True, **common
    )
    multipliers = train_env.multipliers
    eval_env = Monitor(
        ResidualEnv(
            spec, select_on, replay, constrained=constrained, learn_multipliers=False,
            multipliers=Multipliers(**SELECT_MULTIPLIERS), **common,
        )
    )  # fmt: skip
    n_eval = len(instance_names(eval_env.unwrapped.inner))
    decisions = max(1, spec.episode.horizon // window)
    cls = {"ppo": sb3.PPO, "dqn": sb3.DQN, "a2c": sb3.A2C, "sac": sb3.SAC}[algo]
    train_env = Monitor(train_env)
    if init is not None:
        model = cls.load(init, env=train_env, **(hyperparams or {}))
        model.set_random_seed(seed)
        if hasattr(model, "exploration_schedule"):  # go on exploring as it ended
            eps = float(model.exploration_final_eps)
            model.exploration_schedule = lambda progress_remaining: eps
    else:
        params = {**_hyperparams(algo, decisions), **(hyperparams or {})}
        model = cls("MlpPolicy", train_env, seed=seed, verbose=0, **params)
    model.set_logger(Logger(folder=None, output_formats=[]))

    class Stop(BaseCallback):
        def _on_step(self) -> bool:
            return deadline is None or time.monotonic() < deadline

    callbacks: list[Any] = [Stop()]
    if progress:
        from autoscale.agents.train import _progress_callback

        callbacks.append(_progress_callback(timesteps))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autoscale-residual-") as tmp:
        evaluator = EvalCallback(
            eval_env, best_model_save_path=tmp, log_path=tmp,
            eval_freq=eval_freq or max(decisions * 4, timesteps // 10),
            n_eval_episodes=n_eval, deterministic=True, verbose=0,
        )  # fmt: skip
        callbacks.insert(0, evaluator)
        model.learn(total_timesteps=timesteps, callback=CallbackList(callbacks))
        best = Path(tmp) / "best_model.zip"
        if best.exists():
            model = cls.load(best, env=train_env)
        history = [
            (int(t), sum(r) / len(r))
            for t, r in zip(evaluator.evaluations_timesteps, evaluator.evaluations_results)
        ]
    result = ResidualResult(
        model, algo, timesteps, time.monotonic() - t0, float(evaluator.best_mean_reward),
        multipliers=list(multipliers.history), eval_history=history,
    )  # fmt: skip
    if export_name:
        workload = (
            {"suite": spec.name, "members": [m.name for m in spec.members]}
            if hasattr(spec, "members")
            else {**spec.workload.to_dict(), "env": spec.name}
        )
        workload["trained_on"] = "replay"
        result.policy_dir = export_residual(
            model, export_name, train_env.unwrapped, workload=workload,
            training={"algo": algo, "timesteps": timesteps, "constrained": constrained,
                      "multipliers": multipliers.to_dict(), "wall_s": round(result.wall_s, 1)},
            out_dir=export_dir, force=force,
        )  # fmt: skip
    return result


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
    import torch

    import autoscale
    from autoscale.agents.export import sb3_actor
    from autoscale.scalers.features import FEATURE_VERSION
    from autoscale.scalers.policies import (
        PolicyManifest,
        sha256_file,
        staged_policy,
        write_manifest,
    )
    from autoscale.scalers.residual import RESIDUAL_VERSION

    actor, net = sb3_actor(model)
    rule = env.new_rule()
    ep = env.spec.episode
    params = {
        **net,
        **rule.params(),
        "residual_version": RESIDUAL_VERSION,
        "init_scale": ep.init_scale,
        "min_scale": ep.min_scale,
        "max_scale": ep.max_scale,
    }
    with staged_policy(name, out_dir, force=force) as tmp:
        torch.save(
            {"actor": {k: v.detach().cpu().clone() for k, v in actor.state_dict().items()}},
            tmp / "weights.pt",
        )
        manifest = PolicyManifest(
            name=name,
            kind="residual",
            family=f"residual-{rule.base.name}-{net['algo']}",
            parameters=params,
            feature_version=FEATURE_VERSION,
            autoscale_version=autoscale.__version__,
            torch_version=torch.__version__,
            workload={**(workload or {}), **({"training": training} if training else {})},
            scorecard={},
            weights_sha256=sha256_file(tmp / "weights.pt"),
        )
        write_manifest(tmp, manifest)
    return Path(tmp.parent) / name
