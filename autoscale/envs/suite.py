"""Suites: several workloads crossed with several scenarios, searched and judged together.

A policy meant for everyone must hold on every member of a suite, not on one scenario (a winner of
one scenario can fail the next: a static scale found on ``bad-batches`` skips most ``preference``
steps). A suite spec names workloads and scenarios; each pair is a *member*, an ordinary
:class:`~autoscale.envs.spec.EnvSpec` with the suite's episode, instances and reward. Members whose
workload or scenario is *left out* are never searched or trained on: they are the zero-shot checks
(CARL/DACBench style)::

    name: suite
    workload: {dtype: fp16, lr: 0.001}          # defaults of every workload below
    suite:
      workloads:
        gpt2-tiny: {model: gpt2-tiny, batch_size: 4, seq_len: 64}
        mlp: {model: mlp, batch_size: 32}
        autoencoder: {model: autoencoder, batch_size: 32}
      scenarios:
        clean: {}
        bad-batches: {every: 8}
        moving: {at: 200, width: 40, period: 600}
      left_out: {workloads: [autoencoder], scenarios: [moving]}
      exclude: [gpt2-tiny/moving]                # pairs not run at all (optional)
    episode: {...}
    instances: {train: [...], test: [...]}
    reward: {...}

A plain spec is a suite of one member (:func:`as_suite`), so everything that takes a suite takes a
spec too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autoscale.envs.spec import EnvSpec, find_env_spec, load_env_spec, near_spec, read_spec_yaml
from autoscale.errors import ConfigError, UnknownNameError, check_keys, unknown_name

__all__ = ["SuiteSpec", "as_suite", "load_spec", "member_name", "SEP"]

SEP = "/"  # between a member's workload and scenario keys: "gpt2-tiny/bad-batches"


def member_name(workload: str, scenario: str) -> str:
    return f"{workload}{SEP}{scenario}"


@dataclass(frozen=True)
class SuiteSpec:
    """Members searched together, and left-out members for zero-shot checks.

    Attributes:
        name: The suite's name.
        members: The env specs searched and trained on (each has train and test instances).
        left_out: Env specs never searched on; evaluated zero-shot.
        source: The file it came from.
    """

    name: str
    members: tuple[EnvSpec, ...]
    left_out: tuple[EnvSpec, ...] = ()
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.members:
            raise ConfigError(
                f"suite '{self.name}' has no member to search on (every workload or scenario is "
                "left out or excluded); keep at least one pair"
            )
        names = [m.name for m in self.members + self.left_out]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"suite '{self.name}' names members {dupes} twice")
        first = self.members[0]
        for m in self.members[1:] + self.left_out:
            if m.episode != first.episode or m.reward != first.reward:
                raise ConfigError(
                    f"suite '{self.name}': member '{m.name}' has another episode or reward than "
                    f"'{first.name}'; a suite's members share them"
                )

    @property
    def episode(self):
        return self.members[0].episode

    @property
    def reward(self):
        return self.members[0].reward

    @property
    def is_single(self) -> bool:
        """One member and nothing left out: a plain env spec."""
        return len(self.members) == 1 and not self.left_out

    def member(self, name: str) -> EnvSpec:
        for m in self.members + self.left_out:
            if m.name == name:
                return m
        raise unknown_name(
            "suite member", name, [m.name for m in self.members + self.left_out], f"'{self.name}'"
        )

    def replace_members(self, fn) -> SuiteSpec:
        """The suite with ``fn(member)`` applied to every member, left-out ones too."""
        return replace(
            self,
            members=tuple(fn(m) for m in self.members),
            left_out=tuple(fn(m) for m in self.left_out),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain primitives; ``SuiteSpec.from_dict(s.to_dict()) == s`` (members in full)."""
        return {
            "name": self.name,
            "members": [m.to_dict() for m in self.members],
            "left_out": [m.to_dict() for m in self.left_out],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> SuiteSpec:
        """From :meth:`to_dict` output (members in full) or a suite YAML mapping."""
        where = source or "suite spec"
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
        if "members" in data:  # the stored form
            check_keys(where, data, ["name", "members", "left_out"])
            return cls(
                str(data["name"]),
                tuple(EnvSpec.from_dict(m, source) for m in data["members"]),
                tuple(EnvSpec.from_dict(m, source) for m in data.get("left_out") or ()),
                source,
            )
        return _from_yaml(data, where, source)


def _from_yaml(data: dict[str, Any], where: str, source: str | None) -> SuiteSpec:
    check_keys(where, data, ["name", "suite", "workload", "episode", "instances", "reward"])
    suite = data.get("suite")
    if not isinstance(suite, dict):
        raise ConfigError(f"{where}: 'suite' must be a mapping of workloads and scenarios")
    check_keys(f"{where}: suite", suite, ["workloads", "scenarios", "left_out", "exclude"])
    workloads = _mapping(where, "suite.workloads", suite.get("workloads"))
    scenarios = _mapping(where, "suite.scenarios", suite.get("scenarios"))
    shared = data.get("workload") or {}
    if not isinstance(shared, dict):
        raise ConfigError(f"{where}: 'workload' (the defaults of every workload) must be a mapping")
    left = suite.get("left_out") or {}
    if not isinstance(left, dict):
        raise ConfigError(
            f"{where}: suite.left_out must map 'workloads'/'scenarios'/'members' to lists"
        )
    check_keys(f"{where}: suite.left_out", left, ["workloads", "scenarios", "members"])
    left_w = _names(where, "suite.left_out.workloads", left.get("workloads"), workloads)
    left_s = _names(where, "suite.left_out.scenarios", left.get("scenarios"), scenarios)
    pairs = [member_name(w, s) for w in workloads for s in scenarios]
    left_m = _names(where, "suite.left_out.members", left.get("members"), pairs)
    exclude = _names(where, "suite.exclude", suite.get("exclude"), pairs)
    name = str(data.get("name") or (Path(source).stem if source else "suite"))
    common = {k: data[k] for k in ("episode", "instances", "reward") if k in data}
    folder = Path(source).parent if source else Path.cwd()
    members, left_out = [], []
    for w, wl in workloads.items():
        if not isinstance(wl, dict):
            raise ConfigError(
                f"{where}: suite.workloads.{w} must be a mapping (model, batch_size, ...)"
            )
        for s, params in scenarios.items():
            pair = member_name(w, s)
            if pair in exclude:
                continue
            if params is not None and not isinstance(params, dict):
                raise ConfigError(
                    f"{where}: suite.scenarios.{s} must be a mapping of its parameters"
                )
            scenario_name = (params or {}).get("scenario", s)
            scenario_params = {k: v for k, v in (params or {}).items() if k != "scenario"}
            workload = {
                **near_spec({**shared, **wl}, folder),
                "scenario": scenario_name,
                "scenario_params": scenario_params,
            }
            try:
                spec = EnvSpec.from_dict(
                    {"name": pair, "workload": workload, **common}, source=f"{where}: member {pair}"
                )
            except (ConfigError, UnknownNameError) as exc:  # say which member is wrong
                raise type(exc)(f"{where}: member '{pair}': {exc}") from None
            (left_out if (w in left_w or s in left_s or pair in left_m) else members).append(spec)
    return SuiteSpec(name, tuple(members), tuple(left_out), source)


def _mapping(where: str, key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where}: {key} must be a non-empty mapping")
    return {str(k): v for k, v in value.items()}


def _names(where: str, key: str, value: Any, known) -> set[str]:
    if value is None:
        return set()
    if not isinstance(value, list):
        raise ConfigError(f"{where}: {key} must be a list")
    for item in value:
        if item not in known:
            kind = {"workloads": "workload", "scenarios": "scenario"}.get(
                key.rsplit(".", 1)[-1], "member"
            )
            raise unknown_name(kind, str(item), list(known), where)
    return set(value)


def as_suite(spec: EnvSpec | SuiteSpec) -> SuiteSpec:
    """A suite as it is, or a plain spec as a suite of one member."""
    if isinstance(spec, SuiteSpec):
        return spec
    return SuiteSpec(spec.name, (spec,), (), spec.source)


def load_spec(
    spec: str | os.PathLike | dict[str, Any] | EnvSpec | SuiteSpec,
) -> EnvSpec | SuiteSpec:
    """An env spec or a suite spec from a path, a name in ``envs/``, a dict, or an object.

    A mapping with a top-level ``suite`` key (or stored ``members``) is a suite.
    """
    if isinstance(spec, (EnvSpec, SuiteSpec)):
        return spec
    if isinstance(spec, dict):
        return SuiteSpec.from_dict(spec) if _is_suite(spec) else EnvSpec.from_dict(spec)
    path = find_env_spec(spec)
    data = read_spec_yaml(path)
    if isinstance(data, dict) and _is_suite(data):
        return SuiteSpec.from_dict(data, source=str(path))
    return load_env_spec(path)


def _is_suite(data: dict[str, Any]) -> bool:
    return "suite" in data or "members" in data
