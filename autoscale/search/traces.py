"""Recorded traces of a search's instances (:func:`load_traces`), cached next to the storage per
instance under :func:`instance_key`, so an interrupted recording, a resume or a second worker
(which waits on the instance's lock) does not record them again. A re-plan caches its traces under
its own keys (:func:`keep_planned`). User-facing detail: docs/search.md, "A budget that bends".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoscale.envs.spec import EnvSpec, InstanceSpec
from autoscale.envs.suite import SuiteSpec
from autoscale.envs.traces import TRACE_VERSION, Trace, record_trace
from autoscale.errors import BudgetError, ConfigError
from autoscale.search.budget import format_duration
from autoscale.search.storage import file_lock

__all__ = ["instance_key", "cached_share", "load_traces", "keep_planned", "pace_of"]


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
    """Share (0..1) of the recording cost of ``steps``-step traces of ``suite`` already cached."""
    jobs = _jobs(suite)
    total = sum(cost(m, i.start + steps) for m, i in jobs)
    hit = sum(
        cost(m, i.start + steps)
        for m, i in jobs
        if (folder / "traces" / f"{instance_key(m, i, steps)}.npz").is_file()
    )
    return hit / total if total else 0.0


def _essential_first(suite: SuiteSpec) -> list[tuple[EnvSpec, InstanceSpec, bool]]:
    """Every job, each member's first train and test instance (marked True) first."""
    jobs = _jobs(suite)
    first = set()
    for m in suite.members:
        for which in ("train", "test"):
            if m.instances[which]:
                first.add((m.name, m.instances[which][0].name))
    head = [(m, i, True) for m, i in jobs if (m.name, i.name) in first]
    return head + [(m, i, False) for m, i in jobs if (m.name, i.name) not in first]


def _deadline(at: float | Callable[[float], float], pace: float) -> float:
    return at(pace) if callable(at) else at


def load_traces(
    suite: SuiteSpec,
    folder: Path,
    steps: int,
    *,
    cost: Callable[[EnvSpec, int], float],
    stop_at: float | Callable[[float], float],
    progress: bool = False,
    warn: Callable[[str], None] | None = None,
    shrink_to: int | None = None,
    floor_at: float | Callable[[float], float] | None = None,
    on_slow: Callable[[float], None] | None = None,
) -> tuple[dict[str, Trace], dict[str, Any]]:
    """Traces of ``steps`` steps of every train and test instance of every member of ``suite``,
    recording those not cached.

    Args:
        folder: The artifacts folder (traces go to ``folder/traces``).
        cost: Seconds to record ``n`` steps of a member (build and evaluation included), to check
            that a recording fits before starting it.
        stop_at: ``time.monotonic()`` value past which no recording may start, or a function of
            the pace so far (recorded seconds over planned ones, 1.0 before the first) giving it.
        warn: Told, in one line, of each cached trace that does not read back (truncated,
            overwritten, of another version); it is recorded again.
        shrink_to: Bend instead of breaking: each member's first train and test instance are
            recorded first; an instance that does not fit ``stop_at`` after them is left out
            (``stats["dropped"]``), and a first one that does not fit ``floor_at`` (default
            ``stop_at``) is recorded shorter, halving down to ``shrink_to`` steps
            (``stats["shortest"]``). None: every instance, whole, or a BudgetError.
        on_slow: Called with the pace after a recording that ran over 1.3x its plan (to look at
            the machine's load again).

    Returns:
        (member -> trace, stats): stats holds ``recorded`` and ``cached`` instance counts, real
        ``steps`` recorded, ``wall_s`` spent recording and the ``planned_s`` of those recordings,
        ``dropped`` (``MEMBER:INSTANCE`` names left out), ``shortened`` (those shorter than
        ``steps``) and ``shortest`` (the shortest trace).

    Raises:
        BudgetError: the budget ran out before every instance (with ``shrink_to``: every member's
            first train and test instance, at ``shrink_to`` steps) was recorded (those recorded
            stay cached: a rerun continues).
    """
    (folder / "traces").mkdir(parents=True, exist_ok=True)
    floor = stop_at if floor_at is None else floor_at
    rec = _Recording(folder, cost, stop_at, floor, shrink_to, warn, on_slow, steps)
    jobs = _essential_first(suite) if rec.bend else [(m, i, True) for m, i in _jobs(suite)]
    bar = None
    if progress:
        from autoscale.progress import progress_bar

        bar = progress_bar(sum(i.start + steps for _, i, _ in jobs), desc="record", unit="step")
    traced: dict[str, dict] = {m.name: {} for m in suite.members}
    edges = version = None
    try:
        for member, inst, essential in jobs:
            trace = rec.instance(member, inst, essential)
            if trace is None:
                rec.stats["dropped"].append(f"{member.name}:{inst.name}")
            else:
                (only,) = trace.instances.values()
                traced[member.name][inst.name] = dataclasses.replace(only, name=inst.name)
                rec.stats["shortest"] = min(rec.stats["shortest"], only.steps)
                if only.steps < steps:
                    rec.stats["shortened"].append(f"{member.name}:{inst.name}")
                edges, version = trace.hist_edges, trace.feature_version
            if bar is not None:
                bar.update(inst.start + steps)
    finally:
        if bar is not None:
            bar.close()
    out = {}
    for m in suite.members:
        order = [i.name for i in m.instances["train"] + m.instances["test"]]
        kept = {k: traced[m.name][k] for k in order if k in traced[m.name]}
        out[m.name] = Trace(m.to_dict(), kept, edges, version)
    return out, rec.stats


@dataclasses.dataclass
class _Recording:
    """One :func:`load_traces` call's state; :meth:`instance` reads or records one instance."""

    folder: Path
    cost: Callable[[EnvSpec, int], float]
    stop_at: float | Callable[[float], float]
    floor: float | Callable[[float], float]
    shrink_to: int | None
    warn: Callable[[str], None] | None
    on_slow: Callable[[float], None] | None
    steps: int
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.bend = self.shrink_to is not None
        self.stats = {
            "recorded": 0, "cached": 0, "steps": 0, "wall_s": 0.0, "planned_s": 0.0,
            "dropped": [], "shortened": [], "shortest": self.steps,
        }  # fmt: skip

    def pace(self) -> float:
        return pace_of(self.stats)

    def instance(self, member: EnvSpec, inst: InstanceSpec, essential: bool) -> Trace | None:
        """``inst``'s trace, cached or recorded where it fits its deadline; bending, a first
        instance is shortened and any other left out (None); else a BudgetError."""
        n = self.steps
        while True:
            key = instance_key(member, inst, n)
            with file_lock(self.folder / "locks" / f"trace-{key}.lock"):
                trace = _read(self.folder / "traces" / f"{key}.npz", self.warn)
                if trace is not None:
                    self.stats["cached"] += 1
                    return trace
                need = self.cost(member, inst.start + n)
                at = _deadline(self.floor if essential else self.stop_at, self.pace())
                if time.monotonic() + need <= at:
                    return self._record(member, inst, n, need, essential)
            if self.bend and not essential:
                return None
            if self.bend and n // 2 >= self.shrink_to:
                n //= 2
                continue
            raise BudgetError(_ran_out(self.stats, member, inst, need))

    def _record(
        self, member: EnvSpec, inst: InstanceSpec, n: int, need: float, essential: bool
    ) -> Trace | None:
        """Record ``n`` steps of ``inst`` and cache them. Bending, a recording cut at its
        deadline leaves a later instance out (None); a first one is cached at its cut length."""
        t0 = time.monotonic()
        trace = record_trace(
            member,
            n,
            instances=(inst.name,),
            stop_at=_deadline(self.stop_at, self.pace()) if self.bend else None,
            least=min(self.shrink_to, n) if self.bend and essential else 1,
        )
        took = time.monotonic() - t0
        self.stats["wall_s"] += took
        self.stats["planned_s"] += need
        if self.on_slow is not None and took > 1.3 * need:
            self.on_slow(self.pace())
        got = next(iter(trace.instances.values())).steps
        if got < n and not essential:
            return None
        trace.save(self.folder / "traces" / f"{instance_key(member, inst, got)}.npz")
        self.stats["recorded"] += 1
        self.stats["steps"] += inst.start + got
        return trace


def pace_of(stats: dict[str, Any]) -> float:
    """Recorded seconds over the seconds planned for them (1.0 when nothing was recorded)."""
    return stats["wall_s"] / stats["planned_s"] if stats.get("planned_s", 0) > 0 else 1.0


def keep_planned(
    suite: SuiteSpec, traces: dict[str, Trace], folder: Path, steps: int
) -> dict[str, Trace]:
    """``traces`` cut to the instances and ``steps`` of a re-planned ``suite``, cached under its
    keys so that every worker of the study replays the same steps."""
    cache = folder / "traces"
    out = {}
    for m in suite.members:
        trace = traces[m.name]
        kept = {}
        for inst in m.instances["train"] + m.instances["test"]:
            kept[inst.name] = trace.instances[inst.name].head(steps)
            key = instance_key(m, inst, steps)
            with file_lock(folder / "locks" / f"trace-{key}.lock"):
                if not (cache / f"{key}.npz").is_file():
                    one = Trace(
                        m.to_dict(),
                        {inst.name: kept[inst.name]},
                        trace.hist_edges,
                        trace.feature_version,
                    )
                    one.save(cache / f"{key}.npz")
        out[m.name] = dataclasses.replace(trace, spec=m.to_dict(), instances=kept)
    return out


def _ran_out(stats: dict[str, Any], member: EnvSpec, inst: InstanceSpec, need: float) -> str:
    slower = ""
    if stats["recorded"] and (ratio := pace_of(stats)) > 1.2:
        slower = (
            f"; steps ran {ratio:.1f}x slower than measured at the start (other jobs on the cores?)"
        )
    return (
        f"the budget ran out while recording traces ({stats['recorded']} recorded, "
        f"'{member.name}' instance '{inst.name}' needs ~{format_duration(need)} more"
        f"{slower}); they stay cached: rerun with a larger --budget and the same "
        "--study to continue"
    )


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
