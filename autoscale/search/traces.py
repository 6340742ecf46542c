"""Recorded traces of a search's instances (every member of its suite), cached next to the storage
so a resume (or a second worker on the same host) does not record them again.

Each instance is recorded and cached on its own, under a hash of everything the recording depends
on (workload, episode, the instance's seed and start, the trace length, trace and feature
versions, torch version), so an interrupted recording keeps the instances it finished. A lock per instance makes a second
local worker wait for the first one's recording and then read it, instead of recording it too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

from autoscale.envs.spec import EnvSpec, InstanceSpec
from autoscale.envs.suite import SuiteSpec
from autoscale.envs.traces import TRACE_VERSION, Trace, record_trace
from autoscale.errors import BudgetError, ConfigError
from autoscale.search.budget import format_duration
from autoscale.search.storage import file_lock

__all__ = ["instance_key", "cached_share", "load_traces"]


def instance_key(spec: EnvSpec, inst: InstanceSpec, steps: int) -> str:
    """The cache key of ``inst``'s trace of ``steps`` steps under ``spec`` (a suite member)."""
    import torch

    from autoscale.scalers.features import FEATURE_VERSION

    data = {
        "workload": spec.workload.to_dict(),
        "episode": spec.to_dict()["episode"],
        "seed": inst.seed,
        "start": inst.start,
        "steps": steps,
        "trace": TRACE_VERSION,
        "features": FEATURE_VERSION,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:20]


def _jobs(suite: SuiteSpec) -> list[tuple[EnvSpec, InstanceSpec]]:
    return [(m, i) for m in suite.members for i in m.instances["train"] + m.instances["test"]]


def cached_share(
    suite: SuiteSpec, folder: Path, steps: int, cost: Callable[[EnvSpec, int], float]
) -> float:
    """Share (0..1) of the recording cost of ``steps``-step traces of ``suite`` already in the
    cache ``folder/traces``; ``cost(member, steps)`` is a recording's cost."""
    jobs = _jobs(suite)
    total = sum(cost(m, i.start + steps) for m, i in jobs)
    hit = sum(
        cost(m, i.start + steps)
        for m, i in jobs
        if (folder / "traces" / f"{instance_key(m, i, steps)}.npz").is_file()
    )
    return hit / total if total else 0.0


def load_traces(
    suite: SuiteSpec,
    folder: Path,
    steps: int,
    *,
    cost: Callable[[EnvSpec, int], float],
    stop_at: float,
    progress: bool = False,
    warn: Callable[[str], None] | None = None,
) -> tuple[dict[str, Trace], dict[str, float]]:
    """Traces of ``steps`` steps of every train and test instance of every member of ``suite``,
    recording those not cached.

    Args:
        folder: The artifacts folder (traces go to ``folder/traces``).
        cost: Seconds to record ``n`` steps of a member (build and evaluation included), to check
            that a recording fits before starting it.
        stop_at: ``time.monotonic()`` value past which no recording may start.
        warn: Told, in one line, of each cached trace that does not read back (truncated,
            overwritten, of another version); it is recorded again.

    Returns:
        (member -> trace, stats): stats holds ``recorded`` and ``cached`` instance counts, real
        ``steps`` recorded and ``wall_s`` spent recording.

    Raises:
        BudgetError: the budget ran out before every instance was recorded (those recorded stay
            cached: a rerun continues).
    """
    cache = folder / "traces"
    cache.mkdir(parents=True, exist_ok=True)
    jobs = _jobs(suite)
    stats = {"recorded": 0, "cached": 0, "steps": 0, "wall_s": 0.0, "planned_s": 0.0}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(i.start + steps for _, i in jobs), desc="record", unit="step")
    traced: dict[str, dict] = {m.name: {} for m in suite.members}
    edges = version = None
    try:
        for member, inst in jobs:
            key = instance_key(member, inst, steps)
            path = cache / f"{key}.npz"
            with file_lock(folder / "locks" / f"trace-{key}.lock"):
                trace = _read(path, warn)
                if trace is None:
                    need = cost(member, inst.start + steps)
                    if time.monotonic() + need > stop_at:
                        slower = ""
                        if stats["recorded"] and stats["planned_s"] > 0:
                            ratio = stats["wall_s"] / stats["planned_s"]
                            if ratio > 1.2:
                                slower = (
                                    f"; steps ran {ratio:.1f}x slower than measured at the start "
                                    "(other jobs on the cores? OMP_NUM_THREADS=1 helps there)"
                                )
                        raise BudgetError(
                            f"the budget ran out while recording traces ({stats['recorded']} recorded, "
                            f"'{member.name}' instance '{inst.name}' needs ~{format_duration(need)} more"
                            f"{slower}); they stay cached: rerun with a larger --budget and the same "
                            "--study to continue"
                        )
                    t0 = time.monotonic()
                    trace = record_trace(member, steps, instances=(inst.name,))
                    trace.save(path)
                    stats["wall_s"] += time.monotonic() - t0
                    stats["planned_s"] += need
                    stats["recorded"] += 1
                    stats["steps"] += inst.start + steps
                else:
                    stats["cached"] += 1
            (only,) = trace.instances.values()
            traced[member.name][inst.name] = dataclasses.replace(only, name=inst.name)
            edges, version = trace.hist_edges, trace.feature_version
            if bar is not None:
                bar.update(inst.start + steps)
    finally:
        if bar is not None:
            bar.close()
    out = {m.name: Trace(m.to_dict(), traced[m.name], edges, version) for m in suite.members}
    return out, stats


def _read(path: Path, warn: Callable[[str], None] | None) -> Trace | None:
    if not path.is_file():
        return None
    try:
        return Trace.load(path)
    except ConfigError as exc:  # stale or damaged: record it again
        if warn is not None:
            warn(f"cached {str(exc).removesuffix('; record it again')}; recording it again")
        path.unlink(missing_ok=True)
        return None
