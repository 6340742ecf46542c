"""Evaluate scalers (rules and exported policies) on an env spec's instances.

Every scaler is driven through the same environment (:meth:`ScaleEnvBase.step_at`), so rules,
policies and agents are scored by one code path and one scorecard, on real steps
(:class:`LossScaleEnv`) or on a trace (:class:`ReplayEnv`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from autoscale.envs.base import ScaleEnvBase
from autoscale.envs.spec import EnvSpec, InstanceSpec
from autoscale.envs.suite import SuiteSpec, load_spec
from autoscale.scalers.base import LossScaler
from autoscale.scalers.registry import get_scaler

__all__ = [
    "drive_episode",
    "evaluate_scalers",
    "expand_seeds",
    "instance_names",
    "make_env",
    "scaler_for",
]

SEED_STRIDE = 1000


def expand_seeds(spec: EnvSpec, seeds: int, which: str = "test") -> EnvSpec:
    """The spec with ``seeds`` instances per ``which`` instance: the original and seeds+1000k.

    The extra seeds are disjoint from the train set's (checked by EnvSpec).
    """
    if seeds <= 1:
        return spec
    extra = []
    for inst in spec.instances[which]:
        extra.append(inst)
        extra.extend(
            InstanceSpec(f"{inst.name}+{k}", inst.seed + SEED_STRIDE * k, inst.start)
            for k in range(1, seeds)
        )
    return dataclasses.replace(spec, instances={**spec.instances, which: tuple(extra)})


def make_env(spec: Any, instances: str = "test", trace: Any = None) -> Any:
    """A real-step env, or a replay env over ``trace`` (a path or Trace). A suite of several
    members gets a :class:`~autoscale.envs.suite_env.SuiteEnv` (``trace``: member -> Trace, or
    the folder ``autoscale record`` wrote)."""
    from autoscale.envs.suite import SuiteSpec

    if isinstance(spec, SuiteSpec):
        if not spec.is_single:
            from autoscale.envs.suite_env import SuiteEnv
            from autoscale.envs.traces import load_suite_traces

            if trace is not None and not isinstance(trace, dict):
                trace = load_suite_traces(spec, trace)
            return SuiteEnv(spec, instances, traces=trace)
        spec = spec.members[0]
        if isinstance(trace, dict):
            trace = trace[spec.name]
    if trace is None:
        from autoscale.envs.loss_scale_env import LossScaleEnv

        return LossScaleEnv(spec, instances=instances)
    from autoscale.envs.replay_env import ReplayEnv

    return ReplayEnv(spec, trace, instances=instances)


def instance_names(env: Any) -> list[str]:
    """The names ``env.reset(options={"instance": ...})`` takes, in order."""
    names = getattr(env, "instance_names", None)
    return list(names) if names is not None else [i.name for i in env.instances]


def _expand(spec: Any, seeds: int, which: str) -> Any:
    if isinstance(spec, SuiteSpec):
        return spec.replace_members(lambda m: expand_seeds(m, seeds, which))
    return expand_seeds(spec, seeds, which)


def scaler_for(name: str, spec: Any, **overrides: Any) -> LossScaler:
    """The scaler ``name`` with the episode's initial scale and bounds (an env or suite spec)."""
    ep = spec.episode
    kw = {
        "init_scale": ep.init_scale,
        "min_scale": ep.min_scale,
        "max_scale": ep.max_scale,
        **overrides,
    }
    return get_scaler(name, device="cpu", **kw)


def drive_episode(env: ScaleEnvBase, scaler: LossScaler, instance: str, offset: int | None = None):
    """Run one episode of ``instance`` with ``scaler`` choosing every scale.

    Args:
        offset: Replay: start this many steps into the instance's trace (a later point of the
            same run).

    Returns:
        (scorecard, step records) of the episode.
    """
    options: dict[str, Any] = {"instance": instance}
    if offset is not None:
        options["offset"] = offset
    _, info = env.reset(options=options)
    controller = scaler.controller
    env.set_guard(controller.rule)  # a rule that guards each step does so here too
    scale = controller.start(info["scale"], env.features.state_dict())
    advance, step = env.advance_at, controller.step  # step_at's bookkeeping, without observations
    while not advance(scale):
        scale = step(env.last_stats)
    return env.scorecard(), env.episode_records()


def evaluate_scalers(
    spec: str | EnvSpec,
    scalers: Sequence[str] | dict[str, Callable[[], LossScaler]],
    *,
    instances: str = "test",
    seeds: int = 1,
    trace: Any = None,
    progress: bool = False,
    keep_records: bool = False,
) -> dict[str, list] | tuple[dict[str, list], dict[str, list]]:
    """Scorecards of each scaler on each instance of the set (``seeds`` per instance).

    Args:
        spec: Env spec (path, name or EnvSpec).
        scalers: Names for ``get_scaler``, or name -> factory of a fresh scaler.
        instances: Instance set to evaluate on (``test`` by default: never trained on).
        seeds: Seeds per instance (see :func:`expand_seeds`).
        trace: Evaluate on this trace's replay instead of real steps.
        progress: Show a progress bar.
        keep_records: Also return name -> list of each episode's step records (for plots).
    Returns:
        name -> list of Scorecards (one per instance, in the set's order).
    """
    spec = _expand(load_spec(spec), seeds, instances)
    env = make_env(spec, instances, trace)
    names = instance_names(env)
    factories = (
        scalers
        if isinstance(scalers, dict)
        else {n: (lambda n=n: scaler_for(n, spec)) for n in scalers}
    )
    for factory in factories.values():
        factory()  # fail early on unknown names or bad policies
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(factories) * len(names), desc="evaluating", unit="episode")
    out: dict[str, list] = {}
    records: dict[str, list] = {}
    for name, factory in factories.items():
        out[name], records[name] = [], []
        for inst in names:
            card, recs = drive_episode(env, factory(), inst)
            out[name].append(card)
            records[name].append(recs)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return (out, records) if keep_records else out
