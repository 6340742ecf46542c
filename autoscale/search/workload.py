"""The env spec a search starts from: ``--env``, or ``--model``/``--scenario`` on the defaults of
the matching ``envs/*.yaml`` (or a built-in default spec), and the names derived from it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from autoscale.envs.spec import EnvSpec, InstanceSpec, load_env_spec

__all__ = ["DEFAULT_MODEL", "DEFAULT_SCENARIO", "base_spec", "default_study_name"]

DEFAULT_MODEL = "gpt2-tiny"
DEFAULT_SCENARIO = "bad-batches"


def _spec_dirs() -> list[Path]:
    return [Path.cwd() / "envs", Path(__file__).resolve().parents[2] / "envs"]


def _template(scenario: str) -> EnvSpec | None:
    """The ``envs/*.yaml`` spec of ``scenario``: the file named after it, else the first whose
    workload has that scenario."""
    files = [f for d in _spec_dirs() if d.is_dir() for f in sorted(d.glob("*.yaml"))]
    files.sort(key=lambda f: f.stem != scenario)
    for f in files:
        spec = load_env_spec(f)
        if spec.workload.scenario == scenario:
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
) -> EnvSpec:
    """The spec to search: ``env`` with any workload field given here replacing its own; else the
    spec of ``scenario`` (default bad-batches) from ``envs/`` with ``model`` (default gpt2-tiny),
    or a default spec (episodes of 32 steps, 3 train and 3 test instances) where none matches."""
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
        spec = load_env_spec(env)
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


def default_study_name(spec: EnvSpec, space: str) -> str:
    """``MODEL-SCENARIO-SPACE``, usable as a policy name too."""
    wl = spec.workload
    name = f"{Path(wl.model).name if '/' not in wl.model else wl.model}-{wl.scenario}-{space}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.") or "search"
