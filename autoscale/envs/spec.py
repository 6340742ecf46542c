"""Environment specs: workload, episode, instance sets and reward weights, from YAML.

A spec file (``envs/*.yaml``) is parsed here, at the edge, into frozen dataclasses; nothing below
sees nested dicts. Unknown keys are errors, with the nearest valid key suggested.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from autoscale.errors import ConfigError, check_keys, unknown_name
from autoscale.scalers.actions import ActionMap
from autoscale.yamlio import load_yaml, yaml_problem

__all__ = [
    "EnvSpec",
    "EpisodeSpec",
    "GuardSpec",
    "InstanceSpec",
    "RewardWeights",
    "load_env_spec",
    "find_env_spec",
    "spec_dirs",
    "read_spec_yaml",
    "near_spec",
]


@dataclass(frozen=True)
class RewardWeights:
    """Weights of the per-step reward, whose terms come from the scorecard's step metrics.

    reward = -skip * skipped - precision * precision_loss + progress * (log prev_loss - log loss)
             - divergence * diverged
    The progress term telescopes over an episode to log(first loss) - log(last loss).
    """

    skip: float = 1.0
    precision: float = 4.0
    progress: float = 0.1
    divergence: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(
                    f"reward weight '{f.name}' must be a finite number >= 0, got {v!r}"
                )


# the keys of an env spec's ``episode`` section
EPISODE_KEYS = (
    "steps",
    "action",
    "init_scale",
    "min_scale",
    "max_scale",
    "horizon",
    "history",
    "guard",
    "scale_time",
)
DEFAULT_HORIZON = 2048


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode: ``steps`` training steps, the action mapping and the scale bounds.

    ``horizon`` is the longest episode a search replays from recorded traces (a policy is used
    for whole runs, so it is judged on long ones); ``steps`` is the length of real-step episodes
    (validation, agents trained on real steps), which cost a real training step each.
    """

    steps: int = 32
    action: ActionMap = field(default_factory=ActionMap)
    init_scale: float = 2.0**16
    min_scale: float = 2.0**-24
    max_scale: float = 2.0**48
    horizon: int | None = None  # default: max(2048, steps)
    history: int = 1  # feature vectors stacked into one observation (oldest first)
    # an agent's per-step loss guard (autoscale.scalers.rules.guard.LossGuard's parameters):
    # the environment lowers a spike's scale as amax-loss does, and the exported policy keeps it
    guard: GuardSpec | None = None
    # the agent acts when the loss is scaled, seeing this step's loss
    # (autoscale.scalers.scale_time); its discrete actions may drop one step's scale (action.drops)
    scale_time: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.scale_time, bool):
            raise ConfigError(f"episode scale_time must be true or false, got {self.scale_time!r}")
        if self.action.drops and not self.scale_time:
            raise ConfigError(
                "episode.action.drops drop a step's scale from the loss it sees: they need "
                "episode.scale_time: true"
            )
        if self.scale_time and self.guard is not None:
            raise ConfigError(
                "episode.scale_time and episode.guard both decide a step's scale from its loss: "
                "give one (scale_time: the agent learns the guard; guard: it inherits amax-loss's)"
            )
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps <= 0:
            raise ConfigError(f"episode steps must be a positive integer, got {self.steps!r}")
        if isinstance(self.history, bool) or not isinstance(self.history, int) or self.history < 1:
            raise ConfigError(
                f"episode history (feature vectors per observation) must be an integer >= 1, "
                f"got {self.history!r}"
            )
        if self.horizon is None:
            object.__setattr__(self, "horizon", max(DEFAULT_HORIZON, self.steps))
        if (
            isinstance(self.horizon, bool)
            or not isinstance(self.horizon, int)
            or self.horizon < self.steps
        ):
            raise ConfigError(
                f"episode horizon must be an integer >= steps ({self.steps}), got {self.horizon!r}"
            )
        for name in ("init_scale", "min_scale", "max_scale"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"episode {name} must be a positive finite number, got {v!r}")
        if self.min_scale > self.max_scale:
            raise ConfigError(
                f"episode min_scale ({self.min_scale:g}) exceeds max_scale ({self.max_scale:g})"
            )

    def scale_kwargs(self) -> dict[str, float]:
        """The initial scale and the bounds, as a scaler's keyword arguments."""
        return {
            "init_scale": self.init_scale,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
        }

    def at_scale_time(self) -> EpisodeSpec:
        """This episode with the agent acting when the loss is scaled (``scale_time``); discrete
        actions that give no ``drops`` get the default ones (4, 8, 12, 16 bits)."""
        from autoscale.scalers.scale_time import DEFAULT_DROPS

        if self.guard is not None:
            raise ConfigError(
                "an episode under a guard cannot act at scale time: the guard already decides "
                "a step's scale from its loss (drop episode.guard, or leave scale_time off)"
            )
        action = self.action
        if action.mode == "discrete" and not action.drops:
            action = replace(action, drops=DEFAULT_DROPS)
        return replace(self, scale_time=True, action=action)


@dataclass(frozen=True)
class GuardSpec:
    """The per-step loss guard an agent acts under (see :mod:`autoscale.scalers.rules.guard`)."""

    guard_history: int = 16
    guard_margin: float = 1.0

    def __post_init__(self) -> None:
        from autoscale.scalers.rules.guard import LossGuard

        LossGuard(self.guard_history, self.guard_margin)  # its own checks, one message each

    def to_dict(self) -> dict[str, Any]:
        return {"guard_history": self.guard_history, "guard_margin": self.guard_margin}

    @classmethod
    def parse(cls, value: Any, where: str) -> GuardSpec | None:
        """``episode.guard`` of a spec: absent, false or null for none; true for the defaults; or a
        mapping of ``guard_history`` and ``guard_margin``."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, dict):
            raise ConfigError(
                f"{where}: episode.guard must be true, false or a mapping of guard_history and "
                f"guard_margin, got {value!r}"
            )
        check_keys(f"{where}: episode.guard", value, ["guard_history", "guard_margin"])
        return cls(**value)


@dataclass(frozen=True)
class InstanceSpec:
    """A workload instance: the workload with this seed, starting after ``start`` warm-up steps."""

    name: str
    seed: int = 0
    start: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"instance '{self.name}': seed must be an integer, got {self.seed!r}")
        if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 0:
            raise ConfigError(
                f"instance '{self.name}': start must be an integer >= 0, got {self.start!r}"
            )


@dataclass(frozen=True)
class EnvSpec:
    """Everything an environment needs: which workload, how episodes look, which instances.

    ``instances`` maps a set name (``train``, ``test``) to its instances; the test set is never
    trained on.
    """

    name: str
    workload: Any  # autoscale.training.WorkloadSpec
    episode: EpisodeSpec = field(default_factory=EpisodeSpec)
    instances: dict[str, tuple[InstanceSpec, ...]] = field(default_factory=dict)
    reward: RewardWeights = field(default_factory=RewardWeights)
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for set_name in ("train", "test"):
            if not self.instances.get(set_name):
                raise ConfigError(
                    f"env spec '{self.name}': instance set '{set_name}' is missing or empty"
                )
        train = {i.name for i in self.instances["train"]}
        test = {i.name for i in self.instances["test"]}
        if train & test:
            raise ConfigError(
                f"env spec '{self.name}': instances {sorted(train & test)} are in both train and test"
            )
        train_keys = {(i.seed, i.start) for i in self.instances["train"]}
        clash = [i.name for i in self.instances["test"] if (i.seed, i.start) in train_keys]
        if clash:
            raise ConfigError(
                f"env spec '{self.name}': test instances {clash} repeat a train instance's seed and start"
            )

    def instance_set(self, which: str | list[str] | tuple[str, ...]) -> tuple[InstanceSpec, ...]:
        """Instances by set name (``"train"``/``"test"``) or by a list of instance names."""
        if isinstance(which, str):
            if which in self.instances:
                return self.instances[which]
            which = [which]
        by_name = {i.name: i for group in self.instances.values() for i in group}
        out = []
        for name in which:
            if name not in by_name:
                raise unknown_name(
                    "instance",
                    name,
                    list(by_name) + list(self.instances),
                    f"the spec '{self.name}'",
                )
            out.append(by_name[name])
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "workload": self.workload.to_dict(),
            "episode": {
                "steps": self.episode.steps,
                "action": self.episode.action.to_dict(),
                "init_scale": self.episode.init_scale,
                "min_scale": self.episode.min_scale,
                "max_scale": self.episode.max_scale,
                "horizon": self.episode.horizon,
                "history": self.episode.history,
                **({"guard": self.episode.guard.to_dict()} if self.episode.guard else {}),
                **({"scale_time": True} if self.episode.scale_time else {}),
            },
            "instances": {k: [asdict(i) for i in v] for k, v in self.instances.items()},
            "reward": asdict(self.reward),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> EnvSpec:
        from autoscale.training import WorkloadSpec

        where = source or "env spec"
        if data is None:
            raise ConfigError(f"{where} is empty; write an env spec there (envs/*.yaml show how)")
        if not isinstance(data, dict):
            raise ConfigError(
                f"{where}: expected a mapping at the top level, got {type(data).__name__}"
            )
        nested = {
            "workload": [f.name for f in fields(WorkloadSpec)],
            "episode": EPISODE_KEYS,
            "reward": [f.name for f in fields(RewardWeights)],
        }
        check_keys(where, data, ["name", "workload", "episode", "instances", "reward"], nested)
        name = data.get("name") or (Path(source).stem if source else "env")
        if not isinstance(name, (str, int)) or isinstance(name, bool):
            raise ConfigError(f"{where}: 'name' must be a string, got {name!r}")
        name = str(name)
        wl = data.get("workload") or {}
        if not isinstance(wl, dict):
            raise ConfigError(f"{where}: 'workload' must be a mapping")
        workload = WorkloadSpec.from_dict(wl)
        for key in ("episode", "reward"):
            if not isinstance(data.get(key) or {}, dict):
                raise ConfigError(
                    f"{where}: '{key}' must be a mapping of its fields, got {data[key]!r}"
                )
        ep = dict(data.get("episode") or {})
        check_keys(f"{where}: episode", ep, EPISODE_KEYS)
        guard = GuardSpec.parse(ep.pop("guard", None), where)
        scale_time = ep.pop("scale_time", False)
        action = ep.pop("action", None) or {}
        if isinstance(action, str):
            action = {"mode": action}
        if not isinstance(action, dict):
            raise ConfigError(
                f"{where}: episode.action must be a mode name or a mapping (mode, deltas, ...), "
                f"got {action!r}"
            )
        check_keys(
            f"{where}: episode.action",
            action,
            ["mode", "deltas", "max_delta", "resolution", "drops"],
        )
        episode = EpisodeSpec(
            action=ActionMap.from_dict(action),
            guard=guard,
            scale_time=scale_time,
            **{k: _num(k, v) for k, v in ep.items()},
        )
        instances = _instances(where, data.get("instances") or {})
        rw = data.get("reward") or {}
        check_keys(f"{where}: reward", rw, [f.name for f in fields(RewardWeights)])
        return cls(name, workload, episode, instances, RewardWeights(**rw), source)


def _num(key: str, value: Any) -> Any:
    if key in ("steps", "horizon", "history"):
        return value
    if isinstance(value, str):  # allow "2**16" / "2^16" as well as plain numbers
        m = re.fullmatch(r"\s*2\s*(?:\*\*|\^)\s*(-?\d+)\s*", value)
        if m:
            try:
                return 2.0 ** int(m.group(1))
            except OverflowError:
                raise ConfigError(
                    f"episode {key}: '{value}' is beyond the range of a float; use at most 2**1023"
                ) from None
        try:
            return float(value)
        except ValueError as exc:
            raise ConfigError(
                f"episode {key}: '{value}' is not a number (write 65536 or 2**16)"
            ) from exc
    return value


def spec_dirs() -> list[Path]:
    """Where spec names are looked up: ``./envs``, then the specs shipped with autoscale."""
    from autoscale.resources import shipped_dir

    shipped = shipped_dir("envs")
    return [Path.cwd() / "envs"] + ([shipped] if shipped is not None else [])


def find_env_spec(name_or_path: str | os.PathLike) -> Path:
    """A spec path as given, or ``NAME.yaml`` in :func:`spec_dirs`."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    candidates = spec_dirs()
    for d in candidates:
        for q in (d / f"{p.name}", d / f"{p.name}.yaml"):
            if q.is_file():
                return q
    known = sorted({q.stem for d in candidates if d.is_dir() for q in d.glob("*.yaml")})
    if len(p.parts) > 1 or p.suffix in (".yaml", ".yml"):  # a path, not a name
        what = "is a folder" if p.is_dir() else "does not exist"
        raise ConfigError(
            f"env spec file '{name_or_path}' {what}; give the path of a YAML spec, or the name "
            f"of one ({', '.join(known)})"
        )
    raise unknown_name("env spec", str(name_or_path), known, "ls envs/")


def load_env_spec(spec: str | os.PathLike | dict[str, Any] | EnvSpec) -> EnvSpec:
    """An :class:`EnvSpec` from a path, a spec name in ``envs/``, a dict, or an EnvSpec."""
    if isinstance(spec, EnvSpec):
        return spec
    if isinstance(spec, dict):
        return EnvSpec.from_dict(spec)
    path = find_env_spec(spec)
    data = read_spec_yaml(path)
    if isinstance(data, dict) and isinstance(data.get("workload"), dict):
        data["workload"] = near_spec(data["workload"], path.parent)
    return EnvSpec.from_dict(data, source=str(path))


def near_spec(workload: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``workload`` with a relative ``path/to/file.py:factory`` model read from the spec's folder.

    A spec file that names a workload file (``model: ../experiments/workloads/cnn.py:make``) means
    the file next to it, wherever the command runs; a path that is not there is left as written
    (relative to the working directory). Module references (``pkg.mod:make``) are left alone.
    """
    model = workload.get("model")
    if not isinstance(model, str) or ":" not in model:
        return workload
    target, factory = model.rsplit(":", 1)
    if not (target.endswith(".py") or "/" in target) or os.path.isabs(target):
        return workload
    here = folder / target
    if not here.is_file():
        return workload
    return {**workload, "model": f"{here.resolve()}:{factory}"}


def read_spec_yaml(path: Path) -> Any:
    """The YAML in the spec file ``path`` (strictly: a key given twice is an error).

    Raises:
        ConfigError: an unreadable file or malformed YAML, with the line.
    """
    try:
        return load_yaml(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read env spec '{path}': {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"env spec '{path}' is not text (byte {exc.start} is not UTF-8); give a YAML file"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"env spec '{path}' is not valid YAML: {yaml_problem(exc)}; fix that line"
        ) from exc


def _instances(where: str, inst_data: Any) -> dict[str, tuple[InstanceSpec, ...]]:
    """An env spec's ``instances``: set names to instances (a seed alone, or a mapping)."""
    if not isinstance(inst_data, dict):
        raise ConfigError(f"{where}: 'instances' must map set names to lists")
    instances: dict[str, tuple[InstanceSpec, ...]] = {}
    for set_name, items in inst_data.items():
        if not isinstance(items, list):
            raise ConfigError(f"{where}: instances.{set_name} must be a list")
        group = []
        for item in items:
            if isinstance(item, int):
                item = {"seed": item}
            if not isinstance(item, dict):
                raise ConfigError(
                    f"{where}: instances.{set_name} entries must be mappings or seeds, got {item!r}"
                )
            check_keys(f"{where}: instances.{set_name}", item, ["name", "seed", "start"])
            seed, start = item.get("seed", 0), item.get("start", 0)
            group.append(
                InstanceSpec(str(item.get("name") or f"{set_name}-s{seed}-t{start}"), seed, start)
            )
        instances[set_name] = tuple(group)
    return instances
