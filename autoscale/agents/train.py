"""Train Stable-Baselines3 agents on the loss-scale environments and export the best one."""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoscale.envs.spec import EnvSpec
from autoscale.envs.suite import SuiteSpec, load_spec
from autoscale.errors import ConfigError, unknown_name

__all__ = [
    "ALGOS",
    "AgentResult",
    "train_agent",
    "deadline_callback",
    "default_hyperparams",
    "held_out",
    "saved_agent",
    "sb3_class",
]

# algorithm -> action modes it supports
ALGOS: dict[str, tuple[str, ...]] = {
    "ppo": ("discrete", "continuous"),
    "a2c": ("discrete", "continuous"),
    "dqn": ("discrete",),
    "sac": ("continuous",),
}


def default_hyperparams(algo: str, episode_steps: int) -> dict[str, Any]:
    """Defaults sized for short episodes and budgets of 10^4 - 10^5 steps."""
    if algo == "ppo":
        return {
            "n_steps": max(64, 4 * episode_steps),
            "batch_size": 64,
            "learning_rate": 3e-4,
            "ent_coef": 0.01,
            "gamma": 0.98,
        }
    if algo == "a2c":
        return {"n_steps": 16, "learning_rate": 7e-4, "ent_coef": 0.01, "gamma": 0.98}
    if algo == "dqn":
        return {
            "learning_starts": 256,
            "buffer_size": 20000,
            "exploration_fraction": 0.3,
            "target_update_interval": 250,
            "train_freq": 4,
            "gamma": 0.98,
        }
    if algo == "sac":
        return {"learning_starts": 256, "buffer_size": 20000, "gamma": 0.98}
    raise unknown_name("algorithm", algo, ALGOS, "autoscale train-agent --help")


@dataclass
class AgentResult:
    """What :func:`train_agent` produced.

    Attributes:
        best_eval_reward: The selected checkpoint's mean reward where it was selected (NaN: no
            checkpoint was selected, the last model is kept).
        selected_on: The instances the checkpoint was selected on (empty: none was).
    """

    model: Any
    algo: str
    timesteps: int
    wall_s: float
    best_eval_reward: float
    policy_dir: Path | None = None
    eval_history: list[tuple[int, float]] = field(default_factory=list)
    selected_on: tuple[str, ...] = ()


def held_out(spec: EnvSpec | SuiteSpec) -> EnvSpec | SuiteSpec | None:
    """``spec`` with each member's last train instance moved into its test set, to select an
    agent's checkpoint on while the test instances stay unseen; None where a member has a
    single train instance (nothing to hold out)."""

    def shape(m: EnvSpec) -> EnvSpec:
        train = m.instances["train"]
        return dataclasses.replace(m, instances={"train": train[:-1], "test": train[-1:]})

    members = spec.members if isinstance(spec, SuiteSpec) else (spec,)
    if min(len(m.instances["train"]) for m in members) < 2:
        return None
    if isinstance(spec, SuiteSpec):
        return dataclasses.replace(spec, members=tuple(shape(m) for m in spec.members))
    return shape(spec)


def sb3_class(algo: str):
    import stable_baselines3 as sb3

    return {"ppo": sb3.PPO, "a2c": sb3.A2C, "dqn": sb3.DQN, "sac": sb3.SAC}[algo]


def progress_callback(total: int):
    from stable_baselines3.common.callbacks import BaseCallback

    from autoscale.progress import progress_bar

    class TqdmCallback(BaseCallback):
        """A tqdm bar over the training timesteps."""

        def _on_training_start(self) -> None:
            self.bar = progress_bar(total, desc="training", unit="step")

        def _on_step(self) -> bool:
            self.bar.update(self.training_env.num_envs)
            return True

        def _on_training_end(self) -> None:
            self.bar.close()

    return TqdmCallback()


def deadline_callback(deadline: float | None):
    from stable_baselines3.common.callbacks import BaseCallback

    class DeadlineCallback(BaseCallback):
        """Stops training at a wall-clock deadline (budgeted searches)."""

        def _on_step(self) -> bool:
            return deadline is None or time.monotonic() < deadline

    return DeadlineCallback()


def train_agent(
    spec: str | EnvSpec | SuiteSpec,
    algo: str = "ppo",
    timesteps: int = 10_000,
    *,
    replay: Any = None,
    seed: int = 0,
    hyperparams: dict[str, Any] | None = None,
    eval_freq: int | None = None,
    tensorboard: str | None = None,
    progress: bool = False,
    deadline: float | None = None,
    export_name: str | None = None,
    export_dir: str | None = None,
    force: bool = False,
    knobs: Any = None,
    init: str | Path | None = None,
    hold_out: bool = False,
) -> AgentResult:
    """Train an SB3 agent; evaluate it during training and keep the best checkpoint; export it.

    Args:
        spec: Env spec or suite spec (path, name or object). On a suite, episodes are drawn over
            every member that is not left out.
        algo: ``ppo``, ``a2c``, ``dqn`` or ``sac``.
        timesteps: Environment steps to train for.
        replay: Train and evaluate on replay instead of real steps: a trace (path or Trace) for
            an env spec; for a suite, member -> Trace or the folder ``autoscale record`` wrote.
        seed: Seed of the agent and the environment.
        hyperparams: Overrides of :func:`default_hyperparams`.
        eval_freq: Evaluate the checkpoint every this many steps (default: 10 per run).
        tensorboard: Folder for TensorBoard logs (needs the ``tensorboard`` package).
        progress: Show a progress bar.
        deadline: ``time.monotonic()`` value at which training stops early.
        export_name: Export the best model as ``NAME`` in ``export_dir`` (nothing is overwritten
            without ``force``; the name is checked before training starts).
        export_dir: Folder to export into (default: ``scalers.policies.default_policy_dir()``).
        force: Replace an existing export of that name.
        knobs: Replay only: scenario knobs drawn per training episode
            (:class:`~autoscale.envs.knobs.Knobs`); the episodes that select the best model
            are replayed as recorded.
        init: A saved SB3 model (zip) of ``algo`` to go on training (fine-tuning) instead of a
            new one; its observation and action spaces must be the spec's episodes'. Its own
            hyperparameters are kept unless ``hyperparams`` names them.
        hold_out: Select the checkpoint on each member's last train instance, held out of
            training (:func:`held_out`), so that the test instances, which ``autoscale eval``
            reports on, stay unseen; where a member has a single train instance, no checkpoint
            is selected and the last model is kept. False: select on the spec's test instances
            (a spec whose test set is already held out of the train instances, as the search's
            and the build's are).
    """
    from autoscale.envs.episodes import instance_names

    algo, spec, replay = _checked(spec, algo, timesteps, replay, export_name, export_dir, force,
                                  tensorboard)  # fmt: skip
    fit = held_out(spec) if hold_out else spec  # None: nothing to select on, the last model
    train_env, eval_env = _envs(spec, fit, replay, knobs)
    selected_on = tuple(instance_names(eval_env.unwrapped)) if eval_env is not None else ()
    model = _new_model(algo, spec, train_env, seed, tensorboard, hyperparams, init)
    eval_freq = eval_freq or max(spec.episode.steps, timesteps // 10)
    t0 = time.monotonic()
    model, history, best_reward = _learn(
        model, algo, train_env, eval_env, len(selected_on), timesteps, eval_freq, deadline,
        progress,
    )  # fmt: skip
    result = AgentResult(
        model,
        algo,
        timesteps,
        time.monotonic() - t0,
        best_reward,
        eval_history=history,
        selected_on=selected_on,
    )
    if export_name:
        result.policy_dir = export_agent(
            model, spec, export_name, export_dir=export_dir, force=force, replay=replay,
            knobs=knobs,
        )  # fmt: skip
    return result


def _checked(spec, algo, timesteps, replay, export_name, export_dir, force, tensorboard):
    """:func:`train_agent`'s arguments checked before any work, each bad one in one line:
    ``(algo, spec, replay)`` as it trains on them (a one-member suite as its member, a suite's
    records folder read into traces)."""
    algo = algo.lower()
    if algo not in ALGOS:
        raise unknown_name("algorithm", algo, ALGOS, "autoscale train-agent --help")
    spec = load_spec(spec)
    if isinstance(spec, SuiteSpec) and spec.is_single:
        spec = spec.members[0]
        replay = replay[spec.name] if isinstance(replay, dict) else replay
    if isinstance(spec, SuiteSpec) and replay is not None and not isinstance(replay, dict):
        from autoscale.envs.traces import load_suite_traces

        replay = load_suite_traces(spec, replay)
    mode = spec.episode.action.mode
    if mode not in ALGOS[algo]:
        raise ConfigError(
            f"{algo} cannot use {mode} actions; set episode.action.mode to {' or '.join(ALGOS[algo])} in the spec, "
            f"or pick another --algo"
        )
    if isinstance(timesteps, bool) or not isinstance(timesteps, int) or timesteps <= 0:
        raise ConfigError(f"--timesteps must be a positive integer, got {timesteps!r}")
    if export_name:
        from autoscale.scalers.policies import check_export_dest

        check_export_dest(export_name, export_dir, force, flag="--out")
    if tensorboard:
        try:
            import tensorboard as _tb  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                "--tensorboard needs the 'tensorboard' package: pip install tensorboard"
            ) from exc
    return algo, spec, replay


def _envs(spec, fit, replay, knobs) -> tuple[Any, Any]:
    """(training env, selection env or None): the training env on ``fit``'s train instances
    (``spec``'s where nothing is held out), its replayed episodes starting anywhere in the
    traces, under ``knobs``; the selection env on ``fit``'s test instances."""
    from stable_baselines3.common.monitor import Monitor

    from autoscale.envs.episodes import make_env

    train_env = Monitor(make_env(fit or spec, "train", replay))
    if replay is not None:  # episodes start anywhere in longer traces: the whole life of a run
        _set_replay(train_env.unwrapped, random_offset=True, knobs=knobs)
    elif knobs is not None:
        raise ConfigError(
            "knobs apply to replayed episodes: give the traces to train on (--replay)"
        )
    return train_env, Monitor(make_env(fit, "test", replay)) if fit is not None else None


def _new_model(algo, spec, train_env, seed, tensorboard, hyperparams, init) -> Any:
    """A new SB3 model of ``algo`` on ``train_env`` (the defaults, ``hyperparams`` over them),
    or the saved one ``init`` to go on training; logging only to ``tensorboard``."""
    params = {**default_hyperparams(algo, spec.episode.steps), **(hyperparams or {})}
    if init is not None:
        model = load_model(algo, init, train_env, seed, tensorboard, hyperparams or {})
    else:
        model = sb3_class(algo)(
            "MlpPolicy", train_env, seed=seed, verbose=0, tensorboard_log=tensorboard, **params
        )
    if tensorboard is None:  # SB3's default logger makes an empty SB3-<time> folder in /tmp
        from stable_baselines3.common.logger import Logger

        model.set_logger(Logger(folder=None, output_formats=[]))
    return model


def _learn(model, algo, train_env, eval_env, n_eval, timesteps, eval_freq, deadline, progress):
    """Train ``model`` until ``timesteps`` or ``deadline``, evaluating it every ``eval_freq``
    steps on ``n_eval`` episodes of ``eval_env`` (where there is one) and keeping the best
    checkpoint; (the model kept, the evaluations as (timestep, mean reward), the best mean)."""
    from stable_baselines3.common.callbacks import CallbackList, EvalCallback

    with tempfile.TemporaryDirectory(prefix="autoscale-agent-") as tmp:
        callbacks = [deadline_callback(deadline)]
        evaluator = None
        if eval_env is not None:
            evaluator = EvalCallback(
                eval_env,
                best_model_save_path=tmp,
                log_path=tmp,
                eval_freq=eval_freq,
                n_eval_episodes=n_eval,
                deterministic=True,
                verbose=0,
            )
            callbacks.insert(0, evaluator)
        if progress:
            callbacks.append(progress_callback(timesteps))
        model.learn(total_timesteps=timesteps, callback=CallbackList(callbacks), progress_bar=False)
        best = Path(tmp) / "best_model.zip"
        if best.exists():
            model = sb3_class(algo).load(best, env=train_env)
    if evaluator is None:
        return model, [], math.nan
    history = [
        (int(t), sum(r) / len(r))
        for t, r in zip(evaluator.evaluations_timesteps, evaluator.evaluations_results)
    ]
    return model, history, float(evaluator.best_mean_reward)


def saved_agent(algo: str, path):
    """The SB3 ``algo`` model saved at ``path``, without an environment (to export or predict)."""
    return sb3_class(algo).load(path)


def load_model(algo: str, path, env, seed: int, tensorboard, hyperparams: dict[str, Any]):
    """The SB3 model saved at ``path``, on ``env``, to train further.

    Raises:
        ConfigError: not a saved ``algo`` model, or its spaces are not ``env``'s.
    """
    cls = sb3_class(algo)
    try:
        model = cls.load(path, env=env, tensorboard_log=tensorboard, **hyperparams)
    except (ValueError, KeyError, OSError, RuntimeError, TypeError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot go on training {path} as a {algo} agent here: {first}") from exc
    model.set_random_seed(seed)
    if hasattr(model, "exploration_schedule"):  # DQN: go on exploring as it ended, not from 1.0
        eps = float(model.exploration_final_eps)
        model.exploration_schedule = lambda progress_remaining: eps
    if "learning_rate" in hyperparams:  # load() keeps the saved schedule otherwise
        from stable_baselines3.common.utils import get_schedule_fn

        model.lr_schedule = get_schedule_fn(hyperparams["learning_rate"])
    return model


def _set_replay(env: Any, **options: Any) -> None:
    """Set replay options (``random_offset``, ``knobs``) on ``env`` or every member env of a suite."""
    for member in getattr(env, "envs", {}).values() or [env]:
        for k, v in options.items():
            setattr(member, k, v)


def export_agent(
    model: Any,
    spec: EnvSpec | SuiteSpec,
    name: str,
    *,
    export_dir=None,
    force=False,
    replay=None,
    knobs=None,
) -> Path:
    """Export ``model`` and record its test-set scorecard (mean over instances) in the manifest
    (and, in ``workload.knobs``, the knob ranges it trained under)."""
    from autoscale.agents.export import export_neural

    ep = spec.episode
    if isinstance(spec, SuiteSpec):
        workload = {
            "suite": spec.name,
            "members": [m.name for m in spec.members],
            "left_out": [m.name for m in spec.left_out],
        }
    else:
        workload = {**spec.workload.to_dict(), "env": spec.name}
    workload["trained_on"] = "replay" if replay is not None else "real steps"
    if knobs is not None:
        workload["knobs"] = knobs.to_dict()
    path = export_neural(
        model,
        name,
        ep.action.to_dict(),
        workload=workload,
        scales={
            "init_scale": ep.init_scale,
            "min_scale": ep.min_scale,
            "max_scale": ep.max_scale,
            "history": ep.history,
            **({"guard": ep.guard.to_dict()} if ep.guard else {}),
            **({"scale_time": True} if ep.scale_time else {}),
        },
        out_dir=export_dir,
        force=force,
    )
    try:
        from autoscale.agents.evaluate import evaluate_scalers
        from autoscale.envs.episodes import scaler_for
        from autoscale.scalers.policies import read_manifest, write_manifest
        from autoscale.training import summarize

        cards = evaluate_scalers(spec, {name: lambda: scaler_for(str(path), spec)}, trace=replay)[
            name
        ]
        summary = {k: v["mean"] for k, v in summarize(cards).items()}
        summary = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in summary.items()
        }
        summary["evaluated_on"] = "test instances, " + (
            "replay" if replay is not None else "real steps"
        )
        write_manifest(path, dataclasses.replace(read_manifest(path), scorecard=summary))
    except Exception as exc:  # the export itself succeeded; a failed scoring must not lose it
        print(f"warning: exported {path} but could not score it: {exc}")
    return path
