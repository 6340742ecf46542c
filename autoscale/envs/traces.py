"""Per-step traces of real training, recorded so that the replay env can answer "what would have
happened at scale S" without training.

For each step a trace keeps: the overflow threshold in log2(scale) (from the largest magnitude of
every fp16 tensor the backward pass produced, intermediate gradients included, since backward is
linear in the scale), whether the loss itself was non-finite (fails at any scale), a histogram of
log2|g| of the unscaled gradients (precision loss at any scale), the loss, the gradient amax and RMS,
and the scale the recording used. One compressed ``.npz`` file, versioned.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autoscale.errors import ConfigError, unknown_name

__all__ = [
    "TRACE_VERSION",
    "missing_trace",
    "InstanceTrace",
    "Trace",
    "instance_trace",
    "record_trace",
    "record_suite",
    "load_suite_traces",
    "member_file",
    "RECORD_RULE",
]

TRACE_VERSION = 2  # 2: instances carry their start scale and features
RECORD_RULE = {"name": "amax-history", "margin": 2.0}
_ARRAYS = ("threshold", "nonfinite", "loss", "amax", "rms", "scale", "hist")
_OPTIONAL = ("step_loss",)  # traces recorded before it have none (their loss stands in)


@dataclass
class InstanceTrace:
    """The recorded steps of one instance (arrays of length ``steps``)."""

    name: str
    seed: int
    start: int
    threshold: np.ndarray  # log2 scale above which the step overflows
    nonfinite: np.ndarray  # the loss itself was non-finite
    loss: np.ndarray
    amax: np.ndarray  # unscaled gradient amax
    rms: np.ndarray
    scale: np.ndarray  # scale used while recording
    hist: np.ndarray  # (steps, bins): fractions of non-zero grad elements per 1-bit log2 bin
    eval_loss: float
    start_scale: float = 0.0  # scale at the instance's start point (after its warm-up)
    start_features: dict[str, Any] | None = None  # FeatureExtractor state at that point
    # the loss the scaler saw (StepStats.loss: the objective times the scenario's loss weight,
    # over the micro-batches), which rules and policies read; ``loss`` is the training loss
    step_loss: np.ndarray | None = None

    @property
    def scaler_loss(self) -> np.ndarray:
        """The loss as the scaler saw it (``step_loss``; ``loss`` in older traces)."""
        return self.loss if self.step_loss is None else self.step_loss

    @property
    def steps(self) -> int:
        return int(self.threshold.shape[0])

    def head(self, steps: int) -> InstanceTrace:
        """The first ``steps`` steps, as :func:`record_trace` keeps a recording cut at its
        deadline (a trace of that length, as if it had been planned so)."""
        if steps >= self.steps:
            return self
        cut = {
            k: getattr(self, k)[:steps] for k in _ARRAYS + _OPTIONAL if getattr(self, k) is not None
        }
        return dataclasses.replace(self, **cut)


def missing_trace(path: str | os.PathLike, env: str = "SPEC") -> ConfigError:
    """The error for a trace file that is not there: how to record it (for ``env`` if known)."""
    return ConfigError(
        f"no trace file '{path}'; record one with: autoscale record --env {env} --steps N "
        f"--out {path}"
    )


@dataclass
class Trace:
    """Traces of several instances of one env spec."""

    spec: dict[str, Any]
    instances: dict[str, InstanceTrace]
    hist_edges: np.ndarray
    feature_version: int
    version: int = TRACE_VERSION

    def instance(self, name: str) -> InstanceTrace:
        if name not in self.instances:
            raise unknown_name(
                "traced instance",
                name,
                list(self.instances),
                "the trace (record it with autoscale record)",
            )
        return self.instances[name]

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "version": self.version,
            "feature_version": self.feature_version,
            "spec": self.spec,
            "instances": [
                {
                    "name": t.name,
                    "seed": t.seed,
                    "start": t.start,
                    "eval_loss": t.eval_loss,
                    "start_scale": t.start_scale,
                    "start_features": t.start_features,
                }
                for t in self.instances.values()
            ],
        }
        arrays = {"meta": np.array(json.dumps(meta)), "hist_edges": self.hist_edges}
        for i, t in enumerate(self.instances.values()):
            for key in _ARRAYS + _OPTIONAL:
                if getattr(t, key) is not None:
                    arrays[f"{i}.{key}"] = getattr(t, key)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        """Read a trace :meth:`save` wrote.

        Raises:
            ConfigError: a missing file, one of another version or feature spec, or a damaged one
                (truncated, overwritten, half-written: any part that does not read back), in one
                line that says to record it again.
        """
        path = Path(path)
        if not path.is_file():
            raise missing_trace(path)
        with open(path, "rb") as fh:
            head = fh.read(4)
        if head != b"PK\x03\x04":  # every .npz is a zip archive
            raise ConfigError(
                f"'{path}' is not an autoscale trace (not an .npz archive: "
                f"{'empty' if not head else 'it starts with ' + repr(head)}); record it again"
            )
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                _check_versions(path, meta)
                instances = {}
                for i, info in enumerate(meta["instances"]):
                    arrays = {key: data[f"{i}.{key}"] for key in _ARRAYS}
                    arrays.update(
                        {k: data[f"{i}.{k}"] for k in _OPTIONAL if f"{i}.{k}" in data.files}
                    )
                    instances[info["name"]] = InstanceTrace(
                        info["name"],
                        info["seed"],
                        info["start"],
                        eval_loss=info["eval_loss"],
                        start_scale=info["start_scale"],
                        start_features=info["start_features"],
                        **arrays,
                    )
                edges = data["hist_edges"]
            trace = cls(meta["spec"], instances, edges, meta["feature_version"], meta["version"])
            _check_shapes(trace)
        except ConfigError:
            raise
        except Exception as exc:  # zip, zlib, npy header, JSON or key errors: all damage
            reason = str(exc).splitlines()[0] if str(exc) else ""
            reason = reason if len(reason) <= 100 else reason[:97] + "..."
            raise ConfigError(
                f"'{path}' is not a readable autoscale trace ({type(exc).__name__}"
                f"{': ' + reason if reason else ''}); record it again"
            ) from exc
        return trace


def _check_versions(path: Path, meta: dict[str, Any]) -> None:
    from autoscale.scalers.features import FEATURE_VERSION

    if meta.get("version") != TRACE_VERSION:
        raise ConfigError(
            f"trace '{path}' has version {meta.get('version')}, this autoscale reads version {TRACE_VERSION}; record it again"
        )
    if meta.get("feature_version") != FEATURE_VERSION:
        raise ConfigError(
            f"trace '{path}' was recorded with feature spec {meta.get('feature_version')}, this autoscale uses "
            f"{FEATURE_VERSION}; record it again"
        )


def _check_shapes(trace: Trace) -> None:
    """Every array of an instance has one row per step (a file overwritten in part may not)."""
    bins = len(trace.hist_edges) - 1
    for t in trace.instances.values():
        n = t.steps
        keys = [k for k in _ARRAYS + _OPTIONAL if getattr(t, k) is not None]
        rows = {key: getattr(t, key).shape[:1] for key in keys}
        if any(r != (n,) for r in rows.values()) or t.hist.shape[1:] != (bins,):
            raise ValueError(f"instance '{t.name}' has arrays of unequal lengths {rows}")


def instance_trace(
    name: str,
    seed: int,
    start: int,
    records: list,
    *,
    eval_loss: float,
    start_scale: float,
    start_features: dict[str, Any] | None,
) -> InstanceTrace:
    """The trace of recorded steps (:class:`~autoscale.training.StepRecord` of a run with
    ``record=True``), whatever scaler drove them.

    A step that overflowed only says its threshold lies below the scale it used: it is stored as
    that scale minus one bit.
    """
    from autoscale.training import HIST_EDGES

    cols: dict[str, list] = {k: [] for k in _ARRAYS + _OPTIONAL}
    empty = np.zeros(len(HIST_EDGES) - 1)
    for rec in records:
        thr = rec.overflow_threshold_log2
        if thr is None or not math.isfinite(thr):
            thr = math.log2(rec.scale) - 1.0
        cols["threshold"].append(thr)
        cols["nonfinite"].append(bool(rec.loss_nonfinite))
        cols["loss"].append(rec.loss)
        stats = getattr(rec, "stats", None)
        cols["step_loss"].append(stats.loss if stats is not None and stats.loss_seen else rec.loss)
        cols["amax"].append(rec.grad_amax if not rec.found_inf else math.nan)
        cols["rms"].append(rec.grad_rms if not rec.found_inf else math.nan)
        cols["scale"].append(rec.scale)
        hist = rec.grad_log2_hist
        cols["hist"].append(empty if hist is None else np.asarray(hist))
    return InstanceTrace(
        name,
        seed,
        start,
        start_scale=start_scale,
        start_features=start_features,
        threshold=np.asarray(cols["threshold"], dtype=np.float64),
        nonfinite=np.asarray(cols["nonfinite"], dtype=bool),
        loss=np.asarray(cols["loss"], dtype=np.float64),
        amax=np.asarray(cols["amax"], dtype=np.float64),
        rms=np.asarray(cols["rms"], dtype=np.float64),
        scale=np.asarray(cols["scale"], dtype=np.float64),
        hist=np.asarray(cols["hist"], dtype=np.float32),
        eval_loss=eval_loss,
        step_loss=np.asarray(cols["step_loss"], dtype=np.float64),
    )


def record_trace(
    spec,
    steps: int,
    out: str | os.PathLike | None = None,
    instances=("train", "test"),
    progress: bool = False,
    stop_at: float | None = None,
    least: int = 1,
) -> Trace:
    """Record ``steps`` real steps of each instance of ``spec`` (both sets by default).

    With ``stop_at`` (a ``time.monotonic()`` value), an instance still recording then, once it
    has ``least`` steps, is cut to the longest of ``steps``, ``steps // 2``, ``steps // 4``, ...
    that it reached (a trace of that length, as if it had been planned so).

    The recording is driven by the ``amax-history`` rule (2 bits of margin): it stays close below
    the overflow threshold, so few steps overflow (their threshold is then only known to lie below
    the scale used: it is stored as that scale minus one bit) and few gradients underflow.
    """
    from autoscale.envs.loss_scale_env import LossScaleEnv
    from autoscale.scalers.features import FEATURE_VERSION
    from autoscale.training import HIST_EDGES

    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise ConfigError(f"--steps must be a positive integer, got {steps!r}")
    names: list[str] = []
    env = LossScaleEnv(spec, instances="train", record=True)
    for group in instances:
        names.extend(i.name for i in env.env_spec.instance_set(group))
    chosen = env.env_spec.instance_set(names)
    total = steps * len(chosen)
    bar = None
    if progress:
        from autoscale.progress import progress_bar

        bar = progress_bar(total, desc="recording", unit="step")
    traced = {inst.name: _record_instance(env, inst, steps, stop_at, least, bar) for inst in chosen}
    if bar is not None:
        bar.close()
    trace = Trace(
        env.env_spec.to_dict(), traced, np.asarray(HIST_EDGES, dtype=np.float64), FEATURE_VERSION
    )
    if out is not None:
        trace.save(out)
    return trace


def _record_instance(
    env: Any, inst: Any, steps: int, stop_at: float | None, least: int, bar: Any
) -> InstanceTrace:
    """One instance's trace for :func:`record_trace`: its steps under the recording rule, cut
    to a power-of-two share of ``steps`` at ``stop_at``."""
    from autoscale.scalers.catalog import make_scaler

    ep = env.env_spec.episode
    run, snap, start_features, scale = env.prepare(inst)
    start_scale = scale
    run.restore(snap)
    rule = make_scaler(
        RECORD_RULE["name"],
        device="cpu",
        margin=RECORD_RULE["margin"],
        init_scale=scale,
        min_scale=ep.min_scale,
        max_scale=ep.max_scale,
    )
    records = []
    for i in range(steps):
        if stop_at is not None and i >= least and time.monotonic() > stop_at:
            break
        run.scaler.set_scale(scale)
        rec = run.step()
        records.append(rec)
        scale = rule.controller.step(rec.stats)
        if bar is not None:
            bar.update(1)
    if len(records) < steps:  # cut at the deadline
        n = steps
        while n > len(records):
            n //= 2
        records = records[:n]
    return instance_trace(
        inst.name,
        inst.seed,
        inst.start,
        records,
        eval_loss=float(run.eval_loss()),
        start_scale=start_scale,
        start_features=start_features,
    )


def member_file(member: str) -> str:
    """The file name of a suite member's trace in a suite's trace folder."""

    return re.sub(r"[^A-Za-z0-9_.-]+", "__", member) + ".npz"


def record_suite(
    suite, steps: int, out: str | os.PathLike | None = None, progress: bool = False
) -> dict[str, Trace]:
    """:func:`record_trace` of every member of a suite (left-out ones too); with ``out``, one file
    per member in that folder (:func:`member_file`)."""
    from autoscale.envs.suite import as_suite

    suite = as_suite(suite)
    out_dir = Path(out) if out is not None else None
    traces = {}
    for member in suite.members + suite.left_out:
        path = out_dir / member_file(member.name) if out_dir is not None else None
        traces[member.name] = record_trace(member, steps, path, progress=progress)
    return traces


def load_suite_traces(suite, folder: str | os.PathLike) -> dict[str, Trace]:
    """The traces :func:`record_suite` wrote for ``suite``'s members (those present).

    Raises:
        ConfigError: the folder is missing, or holds no trace of a searched member.
    """
    from autoscale.envs.suite import as_suite

    suite = as_suite(suite)
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(
            f"no trace folder '{folder}'; record one with: autoscale record --env SUITE --steps N --out {folder}"
        )
    out = {}
    for member in suite.members + suite.left_out:
        path = folder / member_file(member.name)
        if path.is_file():
            out[member.name] = Trace.load(path)
        elif member in suite.members:
            raise ConfigError(
                f"trace folder '{folder}' has no trace of member '{member.name}' ({path.name}); "
                "record the suite again"
            )
    return out
