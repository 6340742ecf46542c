"""The RL candidates of the ``auto`` build: agents trained on the replay of the suite's train
instances, kept in a cache with a ledger of the settings each was trained with, so that a later
build can reuse them instead of training again."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (algorithm, stacked feature vectors or None for the build's ``history``): the agents trained,
# each also acting at scale time (named ``...-now``) where the build's ``scale_time`` asks
RUNS: tuple[tuple[str, int | None], ...] = (("ppo", None), ("dqn", None), ("ppo", 1))
# the residual agents (an offset on auto's scale, once a window, trained to the bar:
# autoscale.agents.residual), trained where the build's ``residual`` asks
RESIDUAL_RUNS: tuple[str, ...] = ("ppo", "dqn")


def rl_suite(suite, horizon: int, history: int):
    """The train members with ``horizon``-step episodes of ``history`` stacked vectors; one
    train instance per member held out to select the agent on (SB3's EvalCallback). Validation
    and test members are dropped: an agent never learns where the build chooses or reports."""

    def shape(m):
        train = m.instances["train"]
        ep = dataclasses.replace(
            m.episode, steps=horizon, horizon=max(horizon, m.episode.horizon), history=history
        )
        return dataclasses.replace(
            m, episode=ep, instances={"train": train[:-1], "test": train[-1:]}
        )

    return dataclasses.replace(suite, members=tuple(shape(m) for m in suite.members), left_out=())


def with_scale_time(suite):
    """The suite's agents acting when the loss is scaled (``episode.scale_time``: they see this
    step's loss); discrete ones may also drop one step's scale by 4, 8, 12 or 16 bits."""
    return suite.replace_members(
        lambda m: dataclasses.replace(m, episode=m.episode.at_scale_time())
    )


def agent_name(algo: str, history: int, now: bool, knobs: bool) -> str:
    """``rl-ALGO-hHISTORY``, ``-now`` acting at scale time, ``-knobs`` trained under drawn knobs."""
    return f"rl-{algo}-h{history}" + ("-now" if now else "") + ("-knobs" if knobs else "")


def train_agents(
    suite,
    traces,
    settings,
    folder: Path,
    timings: dict[str, float],
    log: Callable[[str], Any] = print,
    runs: list[tuple[str, int | None, bool]] | None = None,
) -> tuple[dict[str, Path], dict[str, dict]]:
    """The agents (name -> exported folder under ``folder``) and what each training run was
    (steps, seconds, best eval reward, and whether this build reused it). ``settings`` is a
    :class:`~autoscale.selection.auto.BuildSettings`; with ``reuse_agents`` an agent that
    ``folder/agents.json`` lists with the same settings is taken as it is. ``runs``: (algorithm,
    history or None for the settings', acting at scale time) to train (default: :data:`RUNS`,
    each also at scale time where ``settings.scale_time``); with ``settings.knobs`` each trains
    under the scenario knobs drawn per episode (:class:`~autoscale.envs.knobs.Knobs`)."""
    from autoscale.agents.train import train_agent
    from autoscale.envs.knobs import Knobs

    folder.mkdir(parents=True, exist_ok=True)
    out, info = {}, {}
    if getattr(settings, "residual", False):
        residual(suite, traces, settings, folder, timings, log, out, info)
    ledger = folder / "agents.json"
    known = json.loads(ledger.read_text()) if ledger.is_file() else {}
    common = {"timesteps": settings.timesteps, "horizon": settings.horizon, "seed": settings.seed}
    knobs = Knobs() if settings.knobs else None
    if runs is None:
        runs = [(a, h, False) for a, h in RUNS]
        runs += [(a, h, True) for a, h in RUNS] if settings.scale_time else []
    for algo, history, now in runs:
        history = settings.history if history is None else history
        name = agent_name(algo, history, now, knobs is not None)
        mine = {**common, "history": history, **({"scale_time": True} if now else {})}
        if knobs is not None:
            mine["knobs"] = knobs.to_dict()
        entry = known.get(name)
        if _reusable(settings, entry, mine, folder, name):
            out[name], info[name] = folder / name, {**entry, "reused": True}
            log(f"{name}: reused from {folder / name} (trained by an earlier run: "
                f"{entry['timesteps']} steps in {entry['wall_s']:.0f} s)")  # fmt: skip
            continue
        t0 = time.monotonic()
        spec = rl_suite(suite, settings.horizon, history)
        result = train_agent(
            with_scale_time(spec) if now else spec,
            algo,
            settings.timesteps,
            replay=traces,
            seed=settings.seed,
            progress=True,
            export_name=name,
            export_dir=str(folder),
            force=True,
            eval_freq=max(settings.horizon * 8, settings.timesteps // 10),
            knobs=knobs,
        )
        timings[f"train {name}"] = time.monotonic() - t0
        log(f"{name}: {result.timesteps} steps in {result.wall_s:.0f} s, best eval reward "
            f"{result.best_eval_reward:.3f}")  # fmt: skip
        _keep(folder, name, result, mine, known, out, info)
    return out, info


def residual_name(algo: str, window: int, knobs: bool = False) -> str:
    """``rl-res-ALGO-kWINDOW``: a residual agent on ``auto`` whose offsets hold ``window`` steps
    (``-knobs``: trained under scenario knobs drawn per episode)."""
    return f"rl-res-{algo}-k{window}" + ("-knobs" if knobs else "")


def residual(suite, traces, settings, folder: Path, timings, log, out, info) -> None:
    """Train (or reuse) the residual agents of :data:`RESIDUAL_RUNS` into ``out`` and ``info``
    (as :func:`train_agents` does its own): ``settings.residual_timesteps`` decisions each, of
    ``settings.window`` steps, on the replay of the train members (under the scenario knobs drawn
    per episode where ``settings.residual_knobs``: the train members have no spiky scenario, so
    without them the skip constraint never binds), selected on one held-out train instance per
    member."""
    from autoscale.agents.residual import train_residual
    from autoscale.envs.knobs import Knobs

    ledger = folder / "agents.json"
    knobs = Knobs() if getattr(settings, "residual_knobs", True) else None
    for algo in RESIDUAL_RUNS:
        known = json.loads(ledger.read_text()) if ledger.is_file() else {}
        name = residual_name(algo, settings.window, knobs is not None)
        mine = {"timesteps": settings.residual_timesteps, "horizon": settings.horizon,
                "seed": settings.seed, "window": settings.window, "base": "auto",
                "residual": True}  # fmt: skip
        if knobs is not None:
            mine["knobs"] = knobs.to_dict()
        entry = known.get(name)
        if _reusable(settings, entry, mine, folder, name):
            out[name], info[name] = folder / name, {**entry, "reused": True}
            log(f"{name}: reused from {folder / name} (trained by an earlier run: "
                f"{entry['timesteps']} decisions in {entry['wall_s']:.0f} s)")  # fmt: skip
            continue
        t0 = time.monotonic()
        result = train_residual(
            rl_suite(suite, settings.horizon, 1), algo, settings.residual_timesteps,
            replay=traces, select_on="test", window=settings.window, seed=settings.seed, knobs=knobs,
            progress=True, export_name=name, export_dir=str(folder), force=True,
        )  # fmt: skip
        timings[f"train {name}"] = time.monotonic() - t0
        last = result.multipliers[-20:]
        log(f"{name}: {result.timesteps} decisions in {result.wall_s:.0f} s, best held-out reward "
            f"{result.best_eval_reward:.3f}, skip violation of the last {len(last)} episodes "
            f"{sum(v[0] for v in last) / max(1, len(last)):+.4f}")  # fmt: skip
        _keep(folder, name, result, mine, known, out, info,
              skip_violation_last=[v[0] for v in last])  # fmt: skip


def _keep(folder: Path, name: str, result, mine: dict, known: dict, out, info, **extra) -> None:
    """Keep a trained agent: its export in ``out``, its SB3 model beside it (to go on training:
    the shipped agent), and what its training was in ``info`` and the ledger (with ``mine``, the
    settings a later build compares to reuse it)."""
    out[name] = result.policy_dir
    result.model.save(folder / f"{name}.sb3.zip")
    known[name] = {
        "settings": mine,
        "timesteps": result.timesteps,
        "wall_s": result.wall_s,
        "best_eval_reward": result.best_eval_reward,
        **extra,
    }
    info[name] = {**known[name], "reused": False}
    (folder / "agents.json").write_text(json.dumps(known, indent=1, default=float) + "\n")


def _reusable(settings, entry: dict | None, mine: dict, folder: Path, name: str) -> bool:
    """Whether the ledger's ``entry`` for ``name`` may stand in for training it with ``mine``:
    reuse asked for, the same settings, its export and SB3 model still there."""
    return bool(
        settings.reuse_agents
        and entry is not None
        and entry["settings"] == mine
        and (folder / name / "policy.yaml").is_file()
        and (folder / f"{name}.sb3.zip").is_file()
    )
