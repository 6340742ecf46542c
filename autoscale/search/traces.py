"""Recorded traces of a search's instances, cached next to the storage so a resume (or a second
worker on the same host) does not record them again.

Each instance is recorded and cached on its own, under a hash of everything the recording depends
on (workload, episode, the instance's seed and start, trace and feature versions, torch version),
so an interrupted recording keeps the instances it finished. A lock per instance makes a second
local worker wait for the first one's recording and then read it, instead of recording it too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

from autoscale.envs.spec import EnvSpec, InstanceSpec
from autoscale.envs.traces import TRACE_VERSION, Trace, record_trace
from autoscale.errors import BudgetError, ConfigError
from autoscale.search.budget import format_duration
from autoscale.search.plan import Timing
from autoscale.search.storage import file_lock

__all__ = ["instance_key", "cached_share", "load_traces"]


def instance_key(spec: EnvSpec, inst: InstanceSpec) -> str:
    """The cache key of ``inst``'s trace under ``spec``."""
    import torch

    from autoscale.scalers.features import FEATURE_VERSION

    data = {
        "workload": spec.workload.to_dict(),
        "episode": spec.to_dict()["episode"],
        "seed": inst.seed,
        "start": inst.start,
        "trace": TRACE_VERSION,
        "features": FEATURE_VERSION,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:20]


def _instances(spec: EnvSpec) -> tuple[InstanceSpec, ...]:
    return spec.instances["train"] + spec.instances["test"]


def cached_share(spec: EnvSpec, folder: Path) -> float:
    """Share (0..1) of ``spec``'s recording cost already in the cache ``folder/traces``."""
    insts = _instances(spec)
    steps = spec.episode.steps
    total = sum(i.start + steps for i in insts)
    hit = sum(
        i.start + steps
        for i in insts
        if (folder / "traces" / f"{instance_key(spec, i)}.npz").is_file()
    )
    return hit / total if total else 0.0


def load_traces(
    spec: EnvSpec,
    folder: Path,
    *,
    timing: Timing,
    stop_at: float,
    progress: bool = False,
) -> tuple[Trace, dict[str, float]]:
    """The trace of every train and test instance of ``spec``, recording those not cached.

    Args:
        folder: The artifacts folder (traces go to ``folder/traces``).
        timing: Measured costs, to check that an instance's recording fits before starting it.
        stop_at: ``time.monotonic()`` value past which no recording may run.

    Returns:
        (trace, stats): stats holds ``recorded`` and ``cached`` instance counts, ``steps``
        recorded and ``wall_s`` spent recording.

    Raises:
        BudgetError: the budget ran out before every instance was recorded (those recorded stay
            cached: a rerun continues).
    """
    cache = folder / "traces"
    cache.mkdir(parents=True, exist_ok=True)
    steps = spec.episode.steps
    insts = _instances(spec)
    stats = {"recorded": 0, "cached": 0, "steps": 0, "wall_s": 0.0}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(i.start + steps for i in insts), desc="record", unit="step")
    traced = {}
    edges = version = None
    try:
        for inst in insts:
            key = instance_key(spec, inst)
            path = cache / f"{key}.npz"
            with file_lock(folder / "locks" / f"trace-{key}.lock"):
                trace = _read(path)
                if trace is None:
                    need = timing.build_s + (inst.start + steps) * timing.step_s + timing.eval_s
                    if time.monotonic() + need > stop_at:
                        raise BudgetError(
                            f"the budget ran out while recording traces ({stats['recorded']} recorded, "
                            f"instance '{inst.name}' needs ~{format_duration(need)} more); they stay "
                            "cached: rerun with a larger --budget and the same --study to continue"
                        )
                    t0 = time.monotonic()
                    trace = record_trace(spec, steps, instances=(inst.name,))
                    trace.save(path)
                    stats["wall_s"] += time.monotonic() - t0
                    stats["recorded"] += 1
                    stats["steps"] += inst.start + steps
                else:
                    stats["cached"] += 1
            (only,) = trace.instances.values()
            traced[inst.name] = dataclasses.replace(only, name=inst.name)
            edges, version = trace.hist_edges, trace.feature_version
            if bar is not None:
                bar.update(inst.start + steps)
    finally:
        if bar is not None:
            bar.close()
    return Trace(spec.to_dict(), traced, edges, version), stats


def _read(path: Path) -> Trace | None:
    if not path.is_file():
        return None
    try:
        return Trace.load(path)
    except ConfigError:  # stale or damaged: record it again
        path.unlink(missing_ok=True)
        return None
