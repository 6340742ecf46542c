"""A user's record (``autoscale wrap --record``, ``get_scaler(..., record=DIR)``) as traces: the
format the replay env and the search read, so that ``autoscale search --traces`` searches on a
run autoscale never saw."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from autoscale.envs.traces import InstanceTrace, Trace
from autoscale.errors import ConfigError
from autoscale.scalers.controller import FP16_MAX

__all__ = ["records_horizon", "suite_from_records", "trace_from_record"]


def trace_from_record(record, name: str = "run") -> Trace:
    """A user's recorded run (:class:`~autoscale.observe.RunRecord`, or its folder) as a
    :class:`Trace` of one instance, the replay environments' and the search's format.

    Steps without a gradient histogram (``hist_every`` > 1) take the nearest earlier one (the
    first steps, the first one); the eval loss is unknown (NaN). The spec records the folder and
    what ran instead of a workload.
    """
    from autoscale.observe import RunRecord, read_record
    from autoscale.observe.record import HIST_EDGES
    from autoscale.scalers.features import FEATURE_VERSION

    if not isinstance(record, RunRecord):
        record = read_record(record)
    steps = record.steps
    if not steps:
        if record.damaged is not None:
            why = f"has no step that reads: {record.damaged}; record the run again"
        elif record.meta.get("finished"):
            why = "holds no step: the run ended before its first optimizer step; record a run that trains"
        else:
            why = "holds no whole chunk of steps yet; let the run go on longer"
        raise ConfigError(f"record '{record.path}' {why}")
    bins = len(HIST_EDGES) - 1
    hist = np.zeros((len(steps), bins), dtype=np.float32)
    last = next((s["hist"] for s in steps if s.get("hist") is not None), None)
    if last is None:
        raise ConfigError(
            f"record '{record.path}' has no gradient histogram (recorded with --hist-every 0); "
            "record the run again with histograms"
        )
    for i, s in enumerate(steps):
        if s.get("hist") is not None:
            last = s["hist"]
        hist[i] = last
    nan = math.nan
    col = record.column
    inst = InstanceTrace(
        name,
        int(record.meta.get("rank", 0)),
        0,
        threshold=np.asarray(col("threshold"), dtype=np.float64),
        nonfinite=np.asarray(col("loss_nonfinite", False), dtype=bool),
        loss=np.asarray(col("loss"), dtype=np.float64),
        amax=np.asarray([_amax(s) for s in steps], dtype=np.float64),
        rms=np.asarray([nan if s["found_inf"] else s["rms"] for s in steps], dtype=np.float64),
        scale=np.asarray(col("scale"), dtype=np.float64),
        hist=hist,
        eval_loss=nan,
        start_scale=float(steps[0]["scale"]),
        start_features=None,
    )
    spec = {
        "record": str(record.path),
        "argv": record.meta.get("argv"),
        "scaler": record.meta.get("scaler"),
    }
    return Trace(spec, {name: inst}, np.asarray(HIST_EDGES, dtype=np.float64), FEATURE_VERSION)


def _amax(step: dict[str, Any]) -> float:
    """A recorded step's gradient amax as replay gives it to a rule. A step that overflowed in the
    run has no amax of its own; where its threshold is known (``log2(65504 / amax)``), the amax
    it implies, so that a replay at a scale that clears the threshold shows the rule a clean step
    (a NaN would read as an overflow). A step whose loss was non-finite keeps NaN: it fails at
    every scale."""
    if not step["found_inf"]:
        return step["amax"]
    t = step.get("threshold")
    if step.get("loss_nonfinite") or t is None or not math.isfinite(t):
        return math.nan
    return FP16_MAX * 2.0**-t


def records_horizon(shortest: int) -> int:
    """The windows' length for records of at least ``shortest`` steps: the largest power of two
    up to 2048 that gives at least four windows, so that two are held out (the search's bar
    against ``auto`` needs two held-out episodes of a record to measure its noise; three windows
    hold one out), and 64 at least (three windows of it are the least a record may have)."""
    horizon = 64
    while horizon * 2 <= 2048 and 4 * horizon * 2 <= shortest:
        horizon *= 2
    return horizon


def suite_from_records(records: list, horizon: int | None = None) -> tuple[Any, dict[str, Trace]]:
    """Recorded runs as the instances of a search: windows of each run, train and test disjoint.

    Each record is one member. Its steps are cut into consecutive windows of ``horizon`` steps
    (default: :func:`records_horizon`); the first two thirds of the windows (in time) are train
    instances, the rest test ones.
    Each window starts at the scale the run had there, and the features' state the run had
    there. A record has no held-out loss: a window's eval loss is the mean of its finite recorded
    training losses, the same for every policy (replay does not change the loss), so that no
    scorecard reads as diverged for want of one. A record whose gradient histograms are missing, or that is shorter than three windows
    of 64 steps, is refused.

    Returns:
        ``(suite, traces)``: a :class:`~autoscale.envs.suite.SuiteSpec` and member -> trace.

    Raises:
        ConfigError: as above, or one record given twice.
    """
    from autoscale.envs.spec import EnvSpec, EpisodeSpec
    from autoscale.envs.suite import SuiteSpec
    from autoscale.observe import RunRecord, read_record
    from autoscale.training import WorkloadSpec

    loaded = [r if isinstance(r, RunRecord) else read_record(r) for r in records]
    shortest = min(len(r.steps) for r in loaded)
    if horizon is None:
        horizon = records_horizon(shortest)
    members, traces = [], {}
    names: set[str] = set()
    seen: dict[Path, str] = {}
    for rec in loaded:
        here = Path(rec.path).resolve()
        if here in seen:  # the same steps twice would count as two runs' held-out windows
            also = f" (also as '{seen[here]}')" if seen[here] != str(rec.path) else ""
            raise ConfigError(f"record '{rec.path}' is given twice{also}; pass each record once")
        seen[here] = str(rec.path)
        n = len(rec.steps)
        windows = n // horizon
        if windows < 3:
            raise ConfigError(
                f"record '{rec.path}' has {n} whole steps, fewer than three windows of {horizon} "
                f"(a search reads {3 * horizon} at least; a lead over auto needs two windows held "
                f"out, {4 * horizon} steps); record a longer run"
            )
        whole = trace_from_record(rec)
        inst = next(iter(whole.instances.values()))
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(rec.path).name).strip("-.") or "run"
        while name in names:
            name += "-2"
        names.add(name)
        workload = WorkloadSpec(model=str(Path(rec.path).resolve()), scenario="clean")
        sets, instances = _windows(inst, windows, horizon, _window_states(rec, horizon))
        episode = EpisodeSpec(
            steps=horizon,
            init_scale=float(inst.scale[0]),
            min_scale=float(rec.meta.get("min_scale") or 2.0**-24),
            max_scale=float(rec.meta.get("max_scale") or 2.0**48),
            horizon=horizon,
        )
        spec = EnvSpec(
            name,
            workload,
            episode=episode,
            instances={k: tuple(v) for k, v in sets.items()},
            source=str(rec.path),
        )
        members.append(spec)
        traces[name] = Trace(spec.to_dict(), instances, whole.hist_edges, whole.feature_version)
    suite = SuiteSpec("traces", tuple(members), (), None)
    return suite, traces


def _window_states(rec: Any, horizon: int) -> dict[int, dict[str, Any]]:
    """The features' state at each window's start (step -> state), carried through the run's
    recorded steps."""
    from autoscale.scalers.controller import StepStats
    from autoscale.scalers.features import FeatureExtractor

    fx = FeatureExtractor()
    states = {}
    for i, s in enumerate(rec.steps):
        if i % horizon == 0:
            states[i] = fx.state_dict()
        loss = s.get("loss")
        fx.update(
            StepStats(
                i,
                float(s["scale"]),
                bool(s["found_inf"]),
                float(s["amax"]),
                float(s["rms"]),
                math.nan if loss is None else float(loss),
                loss is not None,
                bool(s.get("guarded", False)),
            )
        )
    return states


def _windows(
    inst: InstanceTrace, windows: int, horizon: int, states: dict[int, dict[str, Any]]
) -> tuple[dict[str, list], dict[str, InstanceTrace]]:
    """The run ``inst`` cut into ``windows`` windows of ``horizon`` steps: (set -> instance
    specs, name -> window trace); the first two thirds in time train, the rest test."""
    from autoscale.envs.spec import InstanceSpec

    n_train = max(1, (2 * windows) // 3)
    sets: dict[str, list] = {"train": [], "test": []}
    instances: dict[str, InstanceTrace] = {}
    for w in range(windows):
        lo, hi = w * horizon, (w + 1) * horizon
        which = "train" if w < n_train else "test"
        iname = f"{which}-w{w}"
        sets[which].append(InstanceSpec(iname, w, lo))
        instances[iname] = InstanceTrace(
            iname,
            w,
            lo,
            threshold=inst.threshold[lo:hi],
            nonfinite=inst.nonfinite[lo:hi],
            loss=inst.loss[lo:hi],
            amax=inst.amax[lo:hi],
            rms=inst.rms[lo:hi],
            scale=inst.scale[lo:hi],
            hist=inst.hist[lo:hi],
            eval_loss=_window_loss(inst.loss[lo:hi]),
            start_scale=float(inst.scale[lo]),
            start_features=states[lo],
        )
    return sets, instances


def _window_loss(loss: np.ndarray) -> float:
    finite = loss[np.isfinite(loss)]
    return float(finite.mean()) if finite.size else 0.0
