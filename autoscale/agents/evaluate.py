"""Evaluate scalers (rules and exported policies) on an env spec's instances.

Every scaler is driven through the same environment (:meth:`ScaleEnvBase.step_at`), so rules,
policies and agents are scored by one code path and one scorecard, on real steps
(:class:`LossScaleEnv`) or on a trace (:class:`ReplayEnv`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from autoscale.envs.episodes import (
    drive_episode,
    expand_all_seeds,
    instance_names,
    make_env,
    scaler_for,
)
from autoscale.envs.spec import EnvSpec
from autoscale.envs.suite import load_spec
from autoscale.scalers.scaler import LossScaler

__all__ = ["evaluate_scalers"]


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
    spec = expand_all_seeds(load_spec(spec), seeds, instances)
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
        from autoscale.progress import progress_bar

        bar = progress_bar(len(factories) * len(names), desc="evaluating", unit="episode")
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
