"""Inside a program run by ``autoscale wrap``: every GradScaler it builds is an autoscale scaler.

``autoscale wrap`` puts :mod:`autoscale.observe.boot` on the program's ``PYTHONPATH``; its
``sitecustomize`` waits for ``import torch`` and then calls :func:`install`, which replaces
``torch.amp.GradScaler`` and the deprecated ``torch.cuda.amp.GradScaler`` and
``torch.cpu.amp.GradScaler`` (in ``torch.amp``, ``torch.amp.grad_scaler``, ``torch.DEVICE.amp``
and ``torch.DEVICE.amp.grad_scaler``) by classes whose construction returns
``autoscale.get_scaler(NAME, ...)`` (the deprecated ones warn as torch's do). ``isinstance(x, torch.amp.GradScaler)``
still answers for the original class, and a program's own subclass of GradScaler is kept as it is
(and said at exit). The configuration comes from the ``AUTOSCALE_WRAP`` environment variable
(JSON, written by :mod:`autoscale.observe.launch`). Each process leaves a summary for the
launcher to print, from the moment torch is imported to its exit, signals included
(:mod:`autoscale.observe.lifecycle`). A checkpoint that GradScaler would load loads here too
(:func:`autoscale.scalers.checkpoint.load_as_gradscaler`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from autoscale.observe import lifecycle, watch_scaler
from autoscale.observe.on_import import when_imported
from autoscale.scalers import LossScaler, make_scaler
from autoscale.scalers import scaler as scaler_module
from autoscale.scalers.checkpoint import load_as_gradscaler

__all__ = ["ENV", "install", "installed"]

ENV = "AUTOSCALE_WRAP"
_DEFAULT = object()  # an argument the program did not pass
_KNOBS = ("growth_factor", "backoff_factor", "growth_interval")
SHARDED_MODULE = "torch.distributed.fsdp.sharded_grad_scaler"  # FSDP1's ShardedGradScaler
_state: dict[str, Any] = {"installed": False, "built": [], "kept": []}


def installed() -> bool:
    """Whether this process's GradScaler is replaced."""
    return _state["installed"]


def install(config: dict[str, Any] | None = None) -> None:
    """Replace torch's GradScaler classes by autoscale's (once per process)."""
    if _state["installed"]:
        return
    config = config if config is not None else json.loads(os.environ.get(ENV) or "{}")
    _state.update(installed=True, config=config)
    amp_original = torch.amp.GradScaler
    amp_cls = _replacement(amp_original)
    for mod in (torch.amp, torch.amp.grad_scaler):
        mod.GradScaler = amp_cls
    for device in ("cuda", "cpu"):  # the deprecated torch.DEVICE.amp.GradScaler, warning as torch's
        package = importlib.import_module(f"torch.{device}.amp")
        module = importlib.import_module(f"torch.{device}.amp.grad_scaler")
        cls = _replacement(module.GradScaler, device=device, deprecated=_deprecation(device))
        for mod in (package, module):
            mod.GradScaler = cls
    # FSDP1's ShardedGradScaler, when the program imports it (its package takes seconds)
    _state["amp_original"] = amp_original
    scaler_module.BUILT_HOOKS.append(_adopt)
    when_imported(SHARDED_MODULE, _replace_sharded, during=_torch_grad_scaler)
    load_as_gradscaler(True)
    lifecycle.start(config.get("summary_dir"), _state["built"], _state["kept"])


@contextlib.contextmanager
def _torch_grad_scaler() -> Iterator[None]:
    """torch's own GradScaler in ``torch.amp.grad_scaler`` while a module of torch's that
    subclasses it runs: its class is then torch's, as without the wrap."""
    module = torch.amp.grad_scaler
    replaced, module.GradScaler = module.GradScaler, _state["amp_original"]
    try:
        yield
    finally:
        module.GradScaler = replaced


def _replace_sharded(module: Any) -> None:
    """``ShardedGradScaler`` builds a :class:`~autoscale.scalers.sharded.ShardedLossScaler`."""
    importlib.import_module("autoscale.scalers.sharded")  # subclasses torch's class: first
    module.ShardedGradScaler = _replacement(module.ShardedGradScaler, sharded=True)


def _deprecation(device: str) -> str:
    """torch's FutureWarning for ``torch.DEVICE.amp.GradScaler(...)``, word for word."""
    return (
        f"`torch.{device}.amp.GradScaler(args...)` is deprecated. "
        f"Please use `torch.amp.GradScaler('{device}', args...)` instead."
    )


def _replacement(
    original: type,
    device: str | None = None,
    deprecated: str | None = None,
    sharded: bool = False,
) -> type:
    """A class in place of ``original`` whose construction builds autoscale's scaler: on
    ``device`` when the class fixes it (the deprecated per-device classes, which also warn
    ``deprecated`` as torch's do), else on the device given as torch's first argument."""
    built: weakref.WeakSet = weakref.WeakSet()  # answer isinstance for what this class built

    class _Meta(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            try:
                return isinstance(obj, original) or obj in built
            except TypeError:  # not weak-referenceable: not built here
                return False

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, original)

        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            if cls is not replacement:  # the program's own subclass: kept as it is
                _state["kept"].append(cls.__name__)
                return super().__call__(*args, **kwargs)
            if deprecated is not None:
                warnings.warn(deprecated, FutureWarning, stacklevel=2)
            scaler = _build(device, *args, sharded=sharded, **kwargs)
            built.add(scaler)
            return scaler

    what = original.__name__
    replacement = _Meta(what, (original,), {"__module__": original.__module__})
    replacement.__doc__ = (
        f"autoscale wrap: builds autoscale's scaler in place of {original.__module__}.{what}"
    )
    return replacement


def _build(
    fixed_device: str | None,
    *args: Any,
    sharded: bool = False,
    **kwargs: Any,
) -> LossScaler:
    names = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")
    if sharded:  # ShardedGradScaler's order, and its group
        names = ("init_scale", "backoff_factor", "growth_factor", "growth_interval", "enabled")
        names = (*names, "process_group")
    if fixed_device is None:
        names = ("device", *names)
    given = dict(zip(names, args))
    given.update(kwargs)
    device = fixed_device or given.pop("device", "cuda")
    config = _state["config"]
    name = config.get("scaler") or "torch"
    build: dict[str, Any] = {"enabled": given.pop("enabled", True)}
    # the settings given on the command line (--scaler-param) over an exported policy's own
    # (what it was searched and validated with), over the program's
    params = config.get("scaler_params") or {}
    for key in params:
        given.pop(key, None)
    own = {k: v for k, v in _policy_parameters(name).items() if k not in params}
    replaced = []  # the program's arguments a policy's own values replace
    for key in [k for k in ("init_scale", *_KNOBS) if k in given and k in own]:
        mine, theirs = _number(own[key]), _number(given[key])
        if mine is None or theirs is None:  # (not a number: building the scaler says what is)
            continue
        given.pop(key)
        if theirs != mine:
            replaced.append((f"{key}={mine:g}", f"{key}={theirs:g}"))
    if "init_scale" in given:
        build["init_scale"] = float(given.pop("init_scale"))
    build.update(params)
    _state["building"] = True  # (not a scaler the program built itself: see _adopt)
    try:
        if sharded:
            from autoscale.scalers.sharded import sharded_scaler

            group = given.pop("process_group", None)
            scaler = sharded_scaler(name, device=device, process_group=group, **build)
        else:
            scaler = make_scaler(name, device=device, **build)
    finally:
        _state["building"] = False
    ignored, kept = [], []
    for knob in _KNOBS:
        if knob not in given:
            continue
        value = given.pop(knob)
        if knob in scaler.rule.params():
            getattr(scaler, f"set_{knob}")(value)
            kept.append(f"{knob}={value}")
        else:
            ignored.append(f"{knob}={value}")
    if given:
        ignored.extend(f"{k}={v!r}" for k, v in given.items())
    if ignored and not _state["built"]:
        keeps = f"keeps {', '.join(kept)} and " if kept else ""
        print(
            f"autoscale wrap: '{name}' {keeps}ignores the program's GradScaler arguments "
            f"{', '.join(ignored)} (its rule has no such parameter)",
            file=sys.stderr,
        )
    if replaced and not _state["built"]:
        print(
            f"autoscale wrap: '{name}' runs with its own {', '.join(o for o, _ in replaced)}, "
            f"not the program's GradScaler arguments {', '.join(p for _, p in replaced)} (an "
            "exported policy runs as it was searched; --scaler-param KEY=VALUE sets one)",
            file=sys.stderr,
        )
    _register(scaler, name, ignored + [p for _, p in replaced])
    return scaler


def _policy_parameters(name: str) -> dict[str, Any]:
    """The parameters the exported policy ``name`` carries, which win over the program's
    GradScaler arguments; none for a rule, a plugin, or a policy that does not read (building it
    says why)."""
    from autoscale.errors import PolicyError
    from autoscale.scalers.policies import find_policy, read_manifest
    from autoscale.scalers.registry import rule_class

    path = None if rule_class(name) is not None else find_policy(name)
    if path is None:
        return {}
    try:
        manifest = read_manifest(path)
    except PolicyError:
        return {}
    own = dict(manifest.parameters)
    if (manifest.kind, manifest.family) != ("parametric", "static"):
        own.pop("init_scale", None)  # where it starts, not what was searched (but a fixed scale)
    return own


def _number(value: Any) -> float | None:
    """``value`` as a float (a YAML string such as ``1e3`` too), or None where it is none."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _adopt(scaler: LossScaler) -> None:
    """A scaler the program built itself (``autoscale.get_scaler``, an integration given a
    name): observed and recorded as the GradScalers the wrap builds, and kept as the program
    chose it (``--scaler`` replaces torch's GradScaler only, and the first one says so)."""
    if _state.get("building"):
        return
    asked = _state["config"].get("scaler")
    if asked and asked != scaler.name and not _state.get("told_adopted"):
        _state["told_adopted"] = True
        print(
            f"autoscale wrap: the program built its own scaler '{scaler.name}' "
            f"(autoscale.get_scaler): observed as it is; --scaler {asked} replaces torch's "
            "GradScaler only",
            file=sys.stderr,
        )
    _register(scaler, scaler.name, [])


def _register(scaler: LossScaler, name: str, ignored: list[str]) -> None:
    """Watch ``scaler`` (record and live logs as configured) and add it to this process's
    summary."""
    config = _state["config"]
    index = len(_state["built"])
    entry: dict[str, Any] = {"scaler": scaler, "name": name, "index": index, "ignored": ignored}
    rank, label = lifecycle.process_rank()
    entry.update(rank=rank, label=label)
    if scaler.is_enabled():
        record = config.get("record")
        who = f"rank{rank}" if rank is not None else f"pid{os.getpid()}"
        if record and (rank == 0 or config.get("all_ranks")):
            sub = "" if (rank, index) == (0, 0) else f"{who}-scaler{index}"
            record = str(Path(record) / sub) if sub else record
        else:
            record = None
        logs = (config.get("log") or []) if rank == 0 else []
        try:
            entry["watch"] = watch_scaler(
                scaler,
                record=record,
                log=logs,
                hist_every=int(config.get("hist_every", 8)),
                measure_threshold=bool(config.get("measure_threshold", False)),
                meta={"argv": config.get("argv") or sys.argv, "rank": rank, "index": index},
                log_tag=f"scaler{index}" if index else "",
            )
            entry["record"] = record
            entry["logs"] = [s.where for s in entry["watch"].sinks if hasattr(s, "where")]
        except Exception as exc:  # never break the program's run for the record's sake
            print(
                f"autoscale wrap: not recording or logging scaler {index}: {exc}", file=sys.stderr
            )
            entry["watch"] = watch_scaler(scaler)
            entry["record"] = None
        entry["watch"].sinks.append(lifecycle.ProgressSink())
    _state["built"].append(entry)
    lifecycle.write_summary()  # the launcher knows of this scaler now, whatever ends the process
