"""The env spec a search starts from: ``--env``, or ``--model``/``--scenario`` on the defaults of
the matching ``envs/*.yaml`` (or a built-in default spec), and the names derived from it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from autoscale.envs.spec import EnvSpec, InstanceSpec, spec_dirs
from autoscale.envs.suite import SuiteSpec, load_spec
from autoscale.errors import ConfigError

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_SCENARIO",
    "base_spec",
    "check_user_workloads",
    "default_study_name",
]

DEFAULT_MODEL = "gpt2-tiny"
DEFAULT_SCENARIO = "bad-batches"


def _template(scenario: str) -> EnvSpec | None:
    """The ``envs/*.yaml`` spec of ``scenario`` (the file named after it first)."""
    files = [f for d in spec_dirs() if d.is_dir() for f in sorted(d.glob("*.yaml"))]
    files.sort(key=lambda f: f.stem != scenario)
    for f in files:
        spec = load_spec(f)
        if isinstance(spec, EnvSpec) and spec.workload.scenario == scenario:
            return spec
    return None


def base_spec(
    env: str | None = None,
    *,
    model: str | None = None,
    scenario: str | None = None,
    params: dict[str, Any] | None = None,
    dtype: str | None = None,
    fp16: str | None = None,
) -> EnvSpec | SuiteSpec:
    """The spec to search: ``env`` with the workload fields given here replacing its own; else
    the ``envs/`` spec of ``scenario`` with ``model``, or a built-in default spec.

    Raises:
        ConfigError: ``--model``/``--scenario``/``--param`` with a suite (its members name them).
    """
    from autoscale.training import WorkloadSpec

    changes: dict[str, Any] = {}
    if model is not None:
        changes["model"] = model
    if scenario is not None:
        changes["scenario"] = scenario
        changes["scenario_params"] = {}
    if params:
        changes["scenario_params"] = params
    if dtype is not None:
        changes["dtype"] = dtype
    if fp16 is not None:
        changes["fp16"] = fp16
    if env is not None:
        spec = load_spec(env)
        if isinstance(spec, SuiteSpec):
            if set(changes) - {"dtype", "fp16"}:
                raise ConfigError(
                    f"--model, --scenario and --param do not apply to the suite '{spec.name}' "
                    "(its members name their workloads); edit the suite, or search one env spec"
                )
            if not changes:
                return spec
            return spec.replace_members(
                lambda m: dataclasses.replace(m, workload=m.workload.replace(**changes))
            )
        return (
            dataclasses.replace(spec, workload=spec.workload.replace(**changes))
            if changes
            else spec
        )
    scenario = scenario or DEFAULT_SCENARIO
    template = _template(scenario)
    if template is not None:  # keep the template's scenario parameters unless given
        keep = {k: v for k, v in changes.items() if k not in ("scenario", "scenario_params")}
        if params:
            keep["scenario_params"] = params
        workload = template.workload.replace(**{"model": DEFAULT_MODEL, **keep})
        return dataclasses.replace(template, name=scenario, workload=workload, source=None)
    workload = WorkloadSpec(**{"model": DEFAULT_MODEL, **changes, "scenario": scenario})
    instances = {
        "train": tuple(InstanceSpec(f"train-s{s}-t0", s) for s in (0, 1, 2)),
        "test": tuple(InstanceSpec(f"test-s{s}-t0", s) for s in (100, 101, 102)),
    }
    return EnvSpec(scenario, workload, instances=instances)


def default_study_name(spec: EnvSpec | SuiteSpec, space: str) -> str:
    """``MODEL-SCENARIO-SPACE`` (``SUITE-SPACE`` for a suite), usable as a policy name too."""
    if isinstance(spec, SuiteSpec):
        name = f"{spec.name}-{space}"
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.") or "search"
    from autoscale.training.presets import is_user_workload, workload_label

    wl = spec.workload
    model = workload_label(wl.model) if is_user_workload(wl.model) else wl.model
    name = f"{Path(model).name if '/' not in model else model}-{wl.scenario}-{space}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.") or "search"


def check_user_workloads(spec: EnvSpec | SuiteSpec) -> None:
    """One real step of every user workload (``module:factory``) the spec names, so a broken one
    is refused in one line before anything is written."""
    from autoscale.training import TrainingRun
    from autoscale.training.presets import is_user_workload

    members = spec.members + spec.left_out if isinstance(spec, SuiteSpec) else [spec]
    seen = set()
    for m in members:
        wl = m.workload
        if is_user_workload(wl.model) and wl.model not in seen:
            seen.add(wl.model)
            TrainingRun(wl, "torch").step()
