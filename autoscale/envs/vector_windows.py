"""The episodes a vectorised replay steps together: E windows of trace columns, stacked.

:func:`replay_windows` reads them from a :class:`~autoscale.envs.ReplayEnv` (or a
:class:`~autoscale.envs.suite_env.SuiteEnv` over traces) once; :func:`~autoscale.envs.vector_replay.replay_rule`
and the lane rules (:mod:`autoscale.envs.vector_rules`, :mod:`autoscale.envs.vector_amax`) read
each step's columns from them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoscale.envs.replay_env import TABLE_HI, TABLE_LO, precision_table

__all__ = ["NONFINITE_RUN", "ReplayWindows", "replay_windows"]

NONFINITE_RUN = 3  # non-finite losses in a row that end an episode (ScaleEnvBase._take)


@dataclass(frozen=True)
class ReplayWindows:
    """E episodes' trace columns, stacked: what the replay reads of each step.

    Attributes:
        nonfinite, threshold, loss, amax: ``(E, h)`` trace columns of the episodes' steps.
        step_loss: ``(E, h)`` the loss the scaler saw (what a guard reads; ``loss`` is the
            training loss, for the scorecard).
        table: ``(E, h, TABLE_SPAN + 1)`` precision loss at integer log2 scales.
        start_scale: ``(E,)`` the scale each episode starts from (as ``reset`` reports it).
        eval_loss: ``(E,)`` the recording's eval loss of each episode's instance.
        steps: ``(E,)`` each episode's length (shorter than h where it diverged).
        min_scale, max_scale: the env's bounds (its clamp of each step's scale, and ``hit_min``).
    """

    nonfinite: np.ndarray
    threshold: np.ndarray
    loss: np.ndarray
    amax: np.ndarray
    table: np.ndarray
    step_loss: np.ndarray
    start_scale: np.ndarray
    eval_loss: np.ndarray
    steps: np.ndarray
    min_scale: float
    max_scale: float

    @property
    def horizon(self) -> int:
        return int(self.threshold.shape[1])

    def __len__(self) -> int:
        return int(self.threshold.shape[0])


def replay_windows(env: Any, episodes: Sequence[tuple[str, int]]) -> ReplayWindows:
    """The windows of ``episodes`` (``(instance, offset)`` pairs, as ``drive_episode`` takes
    them) of ``env``: a :class:`~autoscale.envs.ReplayEnv`, or a
    :class:`~autoscale.envs.suite_env.SuiteEnv` over traces (``MEMBER:INSTANCE`` names).
    Resets ``env`` once per episode, to read its start scale."""
    h = env.episode_steps
    cols: dict[str, list] = {
        k: [] for k in ("nonfinite", "threshold", "loss", "amax", "table", "step_loss")
    }
    starts, evals, lengths = [], [], []
    tables: dict[tuple[int, str], np.ndarray] = {}
    kept: set[tuple[float, float]] = set()
    bounds = (math.nan, math.nan)
    for instance, offset in episodes:
        _, info = env.reset(options={"instance": instance, "offset": offset})
        replay = getattr(env, "current", env)  # a SuiteEnv's member env
        name = replay.instance.name
        t = replay.trace.instance(name)
        key = (id(replay), name)
        if key not in tables:
            scales = np.arange(TABLE_LO, TABLE_HI + 1, dtype=np.float64)
            tables[key] = precision_table(
                t.hist, replay.trace.hist_edges, scales, replay.log2_min_normal
            )
        window = slice(info["offset"], info["offset"] + h)
        nonfinite = t.nonfinite[window].astype(bool)
        cols["nonfinite"].append(nonfinite)
        cols["threshold"].append(t.threshold[window].astype(np.float64))
        cols["loss"].append(t.loss[window].astype(np.float64))
        cols["step_loss"].append(t.scaler_loss[window].astype(np.float64))
        cols["amax"].append(t.amax[window].astype(np.float64))
        cols["table"].append(tables[key][window])
        starts.append(float(info["scale"]))
        bounds = (replay.min_scale, replay.max_scale)
        if any(b != bounds for b in kept):
            raise ValueError("replay_windows: the episodes' envs have different scale bounds")
        kept.add(bounds)
        evals.append(float(t.eval_loss))
        lengths.append(_length(cols["step_loss"][-1]))  # as the scalar replay's books
    return ReplayWindows(
        **{k: np.stack(v) for k, v in cols.items()},
        start_scale=np.asarray(starts, dtype=np.float64),
        eval_loss=np.asarray(evals, dtype=np.float64),
        steps=np.asarray(lengths, dtype=np.int64),
        min_scale=bounds[0],
        max_scale=bounds[1],
    )


def _length(loss: np.ndarray) -> int:
    """Steps until the episode ends: all, or through the third non-finite loss in a row."""
    run = 0
    for t, bad in enumerate((~np.isfinite(loss)).tolist()):
        run = run + 1 if bad else 0
        if run >= NONFINITE_RUN:
            return t + 1
    return len(loss)
