"""Suites: several workloads crossed with several scenarios, searched and judged together.

A policy meant for everyone must hold on every member of a suite, not on one scenario (a winner of
one scenario can fail the next: a static scale found on ``bad-batches`` skips most ``preference``
steps). A suite spec names workloads and scenarios; each pair is a *member*, an ordinary
:class:`~autoscale.envs.spec.EnvSpec` with the suite's episode, instances and reward. Members come
in three kinds, as data do in machine learning (CARL/DACBench style zero-shot checks, with a
validation set between training and the final report):

* *train* members: the search and the agents learn there (every member the split does not name);
* *validation* members: never searched or trained on; the ``auto`` build chooses there, so the
  choice rewards what holds on members a candidate never saw, as a user's workload is;
* *test* members: never searched, trained or chosen on; read once, after the choice, to report.
  Once a member decides, it no longer measures: a member both validation and test is test.

Validation and test members together are the *left-out* ones (:attr:`SuiteSpec.left_out`)::

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
      split:                                     # what is not named here is train
        validation: {workloads: [autoencoder]}
        test: {scenarios: [moving], members: [mlp/bad-batches]}
      exclude: [gpt2-tiny/moving]                # pairs not run at all (optional)
    episode: {...}
    instances: {train: [...], test: [...]}
    reward: {...}

The older form ``left_out: {workloads: [...], scenarios: [...], members: [...]}`` still loads: its
members are test members (nothing chose on them before the split had a validation part).

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
    """Train members searched together, and left-out ones: validation and test members.

    Attributes:
        name: The suite's name.
        members: The train members: env specs searched and trained on (each has train and test
            instances).
        left_out: Env specs never searched or trained on, validation and test members alike.
        source: The file it came from.
        test_names: Which of ``left_out`` are test members (the others are validation members).
            A name no member of ``left_out`` has is dropped, so that a suite narrowed with
            ``dataclasses.replace`` keeps the kinds of the members it keeps.
    """

    name: str
    members: tuple[EnvSpec, ...]
    left_out: tuple[EnvSpec, ...] = ()
    source: str | None = field(default=None, compare=False)
    test_names: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.members:
            raise ConfigError(
                f"suite '{self.name}' has no member to search on (every workload or scenario is "
                "in the split's validation or test, or excluded); keep at least one pair"
            )
        names = [m.name for m in self.members + self.left_out]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"suite '{self.name}' names members {dupes} twice")
        train = sorted(set(self.test_names) & {m.name for m in self.members})
        if train:
            raise ConfigError(
                f"suite '{self.name}': {train} are train members and test members; a member is "
                "one of train, validation or test"
            )
        left = {m.name for m in self.left_out}
        object.__setattr__(self, "test_names", frozenset(n for n in self.test_names if n in left))
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
    def validation(self) -> tuple[EnvSpec, ...]:
        """The validation members: the build chooses there; never searched or trained on."""
        return tuple(m for m in self.left_out if m.name not in self.test_names)

    @property
    def test(self) -> tuple[EnvSpec, ...]:
        """The test members: read once, after every choice, to report."""
        return tuple(m for m in self.left_out if m.name in self.test_names)

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

    def with_episode_steps(self, steps: int) -> SuiteSpec:
        """The suite (left-out members too) with real-step episodes of ``steps`` steps; the
        replay horizon is raised to ``steps`` where it was shorter, never lowered."""

        def shape(m: EnvSpec) -> EnvSpec:
            ep = replace(m.episode, steps=steps, horizon=max(steps, m.episode.horizon))
            return replace(m, episode=ep)

        return self.replace_members(shape)

    def to_dict(self) -> dict[str, Any]:
        """Plain primitives; ``SuiteSpec.from_dict(s.to_dict()) == s`` (members in full)."""
        return {
            "name": self.name,
            "members": [m.to_dict() for m in self.members],
            "left_out": [m.to_dict() for m in self.left_out],
            "test": [m.name for m in self.test],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> SuiteSpec:
        """From :meth:`to_dict` output (members in full) or a suite YAML mapping.

        A stored suite from before the split (no ``test`` list) reads its left-out members as
        test members, as the YAML's older ``left_out`` form does."""
        where = source or "suite spec"
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
        if "members" in data:  # the stored form
            check_keys(where, data, ["name", "members", "left_out", "test"])
            left = tuple(EnvSpec.from_dict(m, source) for m in data.get("left_out") or ())
            test = data["test"] if "test" in data else [m.name for m in left]
            return cls(
                str(data["name"]),
                tuple(EnvSpec.from_dict(m, source) for m in data["members"]),
                left,
                source,
                frozenset(test),
            )
        return _from_yaml(data, where, source)


def _from_yaml(data: dict[str, Any], where: str, source: str | None) -> SuiteSpec:
    check_keys(where, data, ["name", "suite", "workload", "episode", "instances", "reward"])
    suite = data.get("suite")
    if not isinstance(suite, dict):
        raise ConfigError(f"{where}: 'suite' must be a mapping of workloads and scenarios")
    check_keys(f"{where}: suite", suite, ["workloads", "scenarios", "split", "left_out", "exclude"])
    workloads = _mapping(where, "suite.workloads", suite.get("workloads"))
    scenarios = _mapping(where, "suite.scenarios", suite.get("scenarios"))
    shared = data.get("workload") or {}
    if not isinstance(shared, dict):
        raise ConfigError(f"{where}: 'workload' (the defaults of every workload) must be a mapping")
    pairs = [member_name(w, s) for w in workloads for s in scenarios]
    in_test = _split(where, suite, workloads, scenarios, pairs)
    exclude = _names(where, "suite.exclude", suite.get("exclude"), pairs)
    name = str(data.get("name") or (Path(source).stem if source else "suite"))
    common = {k: data[k] for k in ("episode", "instances", "reward") if k in data}
    folder = Path(source).parent if source else Path.cwd()
    members, left_out, test = [], [], set()
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
            kind = in_test(w, s, pair)
            (members if kind == "train" else left_out).append(spec)
            if kind == "test":
                test.add(pair)
    return SuiteSpec(name, tuple(members), tuple(left_out), source, frozenset(test))


def _split(where: str, suite: dict[str, Any], workloads, scenarios, pairs):
    """``(workload, scenario, pair) -> "train" | "validation" | "test"`` from ``suite.split``, or
    from the older ``suite.left_out`` (all test). Test wins over validation: a member that
    touches a test workload or scenario must not decide anything."""
    if "split" in suite and "left_out" in suite:
        raise ConfigError(
            f"{where}: suite.left_out is the older form of suite.split.test; give one of them"
        )
    if "left_out" in suite:
        parts = {"test": suite.get("left_out")}
        keys = {"test": "suite.left_out"}
    else:
        split = suite.get("split") or {}
        if not isinstance(split, dict):
            raise ConfigError(f"{where}: suite.split must map 'validation'/'test' to mappings")
        check_keys(f"{where}: suite.split", split, ["validation", "test"])
        parts = split
        keys = {k: f"suite.split.{k}" for k in ("validation", "test")}
    chosen: dict[str, tuple[set[str], set[str], set[str]]] = {}
    for kind, part in parts.items():
        key = keys[kind]
        part = part or {}
        if not isinstance(part, dict):
            raise ConfigError(f"{where}: {key} must map 'workloads'/'scenarios'/'members' to lists")
        check_keys(f"{where}: {key}", part, ["workloads", "scenarios", "members"])
        chosen[kind] = (
            _names(where, f"{key}.workloads", part.get("workloads"), workloads),
            _names(where, f"{key}.scenarios", part.get("scenarios"), scenarios),
            _names(where, f"{key}.members", part.get("members"), pairs),
        )

    def kind_of(workload: str, scenario: str, pair: str) -> str:
        for kind in ("test", "validation"):
            w, s, m = chosen.get(kind, (set(), set(), set()))
            if workload in w or scenario in s or pair in m:
                return kind
        return "train"

    return kind_of


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
