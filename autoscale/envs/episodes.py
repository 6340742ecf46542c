"""Episodes of an env with a scaler choosing every scale: the tools the evaluation, the search and
the agents share (a real-step or replay env for a spec, a spec's extra seeds, the scaler with the
episode's scale bounds, one driven episode)."""

from __future__ import annotations

import dataclasses
from typing import Any

from autoscale.envs.base import ScaleEnvBase
from autoscale.envs.spec import EnvSpec, InstanceSpec
from autoscale.envs.suite import SuiteSpec
from autoscale.scalers.catalog import make_scaler
from autoscale.scalers.scaler import LossScaler

__all__ = [
    "SEED_STRIDE",
    "drive_episode",
    "expand_all_seeds",
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


def expand_all_seeds(spec: Any, seeds: int, which: str) -> Any:
    """:func:`expand_seeds` of an env spec, or of every member of a suite."""
    if isinstance(spec, SuiteSpec):
        return spec.replace_members(lambda m: expand_seeds(m, seeds, which))
    return expand_seeds(spec, seeds, which)


def scaler_for(name: str, spec: Any, **overrides: Any) -> LossScaler:
    """The scaler ``name`` with the episode's initial scale and bounds (an env or suite spec)."""
    return make_scaler(name, device="cpu", **{**spec.episode.scale_kwargs(), **overrides})


def drive_episode(
    env: ScaleEnvBase,
    scaler: LossScaler,
    instance: str,
    offset: int | None = None,
    knobs: Any = None,
):
    """Run one episode of ``instance`` with ``scaler`` choosing every scale.

    Args:
        offset: Replay: start this many steps into the instance's trace (a later point of the
            same run).
        knobs: Replay: this knobs draw (another episode's ``episode_knobs``) on the steps.

    Returns:
        (scorecard, step records) of the episode.
    """
    options: dict[str, Any] = {"instance": instance}
    if offset is not None:
        options["offset"] = offset
    if knobs is not None:
        options["knobs"] = knobs
    _, info = env.reset(options=options)
    controller = scaler.controller
    env.set_guard(controller.rule)  # a rule that guards each step does so here too
    scale = controller.start(info["scale"], env.features.state_dict())
    advance, step = env.advance_at, controller.step  # step_at's bookkeeping, without observations
    while not advance(scale):
        scale = step(env.last_stats)
    return env.scorecard(), env.episode_records()
