"""``SuiteEnv``: the loss-scale environment over every member of a suite."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
from gymnasium.utils import seeding

from autoscale.envs.spec import EnvSpec, InstanceSpec
from autoscale.envs.suite import SuiteSpec, as_suite, load_spec
from autoscale.errors import ConfigError, unknown_name

__all__ = ["SuiteEnv", "suite_instances", "split_instance", "SEP"]

SEP = ":"  # "MEMBER:INSTANCE", e.g. "mlp/bad-batches:test-s100-t0"


def suite_instances(suite: SuiteSpec, which: str, members: str = "searched") -> list[str]:
    """``MEMBER:INSTANCE`` names of set ``which`` over the chosen members."""
    return [
        f"{m.name}{SEP}{i.name}" for m in _members(suite, members) for i in m.instance_set(which)
    ]


def split_instance(name: str) -> tuple[str, str]:
    """``("mlp/clean", "test-s100-t0")`` from ``"mlp/clean:test-s100-t0"``."""
    member, sep, instance = name.rpartition(SEP)
    if not sep:
        raise ConfigError(f"'{name}' names no suite member; write MEMBER{SEP}INSTANCE")
    return member, instance


def _members(suite: SuiteSpec, which: str | list[str]) -> tuple[EnvSpec, ...]:
    if which == "searched":
        return suite.members
    if which == "left_out":
        return suite.left_out
    if which == "all":
        return suite.members + suite.left_out
    if isinstance(which, (list, tuple)):
        return tuple(suite.member(n) for n in which)
    raise ConfigError(f"members must be 'searched', 'left_out', 'all' or a list, got {which!r}")


class SuiteEnv(gym.Env):
    """The loss-scale problem over a suite: each episode is an instance of one member.

    Every member is an ordinary environment (:class:`~autoscale.envs.LossScaleEnv` on real steps,
    or :class:`~autoscale.envs.ReplayEnv` over that member's trace); the members share the
    episode, the action mapping and the reward, so they share the spaces too.

    ## Action Space / Observation Space / Rewards / Episode End
    As ``LossScaleEnv``.

    ## Starting State
    An instance drawn uniformly over every (member, instance) pair of the set, or the one named
    with ``options={"instance": "MEMBER:INSTANCE"}``; other options (``offset``) go to the member.
    ``info["member"]`` names the member.

    ## Version History
    * v0: first version.

    Args:
        spec: A suite (or a plain spec: a suite of one member), as a path, name, dict or object.
        instances: ``"train"`` or ``"test"``.
        traces: None for real steps; else member name -> its :class:`~autoscale.envs.Trace` (or
            path), and the members replay them.
        members: ``"searched"`` (default), ``"left_out"``, ``"all"``, or a list of member names.
        random_offset: Replay: start episodes at random points of longer traces.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        spec: Any,
        instances: str = "train",
        traces: dict[str, Any] | None = None,
        members: str | list[str] = "searched",
        random_offset: bool = False,
    ) -> None:
        super().__init__()
        self.suite = as_suite(load_spec(spec))
        if instances not in ("train", "test"):
            raise ConfigError(f"instances must be 'train' or 'test', got {instances!r}")
        chosen = _members(self.suite, members)
        if not chosen:
            raise ConfigError(f"suite '{self.suite.name}' has no {members} members")
        self.envs: dict[str, Any] = {}
        for m in chosen:
            if traces is None:
                from autoscale.envs.loss_scale_env import LossScaleEnv

                self.envs[m.name] = LossScaleEnv(m, instances=instances)
            else:
                from autoscale.envs.replay_env import ReplayEnv

                if m.name not in traces:
                    raise ConfigError(f"no trace of suite member '{m.name}'; record it first")
                self.envs[m.name] = ReplayEnv(
                    m, traces[m.name], instances=instances, random_offset=random_offset
                )
        first = next(iter(self.envs.values()))
        self.action_space, self.observation_space = first.action_space, first.observation_space
        self.env_spec = first.env_spec
        self.episode_steps = first.episode_steps
        self.pairs: list[tuple[str, InstanceSpec]] = [
            (name, inst) for name, env in self.envs.items() for inst in env.instances
        ]
        self.instance_names = [f"{m}{SEP}{i.name}" for m, i in self.pairs]
        self.current: Any = None
        self.member: str | None = None
        self._seeded = False

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        if seed is not None or not self._seeded:  # member envs draw offsets from their own rngs
            base = int(self.np_random.integers(2**31))
            for k, env in enumerate(self.envs.values()):
                env.np_random, _ = seeding.np_random(base + k)
            self._seeded = True
        options = dict(options or {})
        if "instance" in options:
            member, instance = split_instance(options.pop("instance"))
            if member not in self.envs:
                raise unknown_name("suite member", member, list(self.envs), f"'{self.suite.name}'")
        else:
            member, inst = self.pairs[int(self.np_random.integers(len(self.pairs)))]
            instance = inst.name
        self.member, self.current = member, self.envs[member]
        obs, info = self.current.reset(options={**options, "instance": instance})
        return obs, {**info, "member": member, "instance": f"{member}{SEP}{instance}"}

    def step(self, action):
        return self._delegate(self._env().step(action))

    def set_guard(self, rule) -> None:
        """Apply ``rule``'s per-step guard in every member (see :meth:`ScaleEnvBase.set_guard`)."""
        for env in self.envs.values():
            env.set_guard(rule)

    def step_at(self, scale: float):
        """Take the next step at ``scale`` (see :meth:`ScaleEnvBase.step_at`)."""
        return self._delegate(self._env().step_at(scale))

    def advance_at(self, scale: float) -> bool:
        """Take the next step at ``scale`` without observation (see :meth:`ScaleEnvBase.advance_at`)."""
        return self._env().advance_at(scale)

    def _delegate(self, result):
        obs, reward, terminated, truncated, info = result
        info = {**info, "member": self.member, "instance": f"{self.member}{SEP}{info['instance']}"}
        return obs, reward, terminated, truncated, info

    def _env(self):
        if self.current is None:
            raise RuntimeError("call reset() before step()")
        return self.current

    # ------------------------------------------------------------------ what drivers read
    @property
    def features(self):
        return self._env().features

    @property
    def last_stats(self):
        return self._env().last_stats

    @property
    def hit_min(self) -> bool:
        return self._env().hit_min

    @property
    def episode_knobs(self):
        """The current episode's knobs draw (replay under knobs; else None)."""
        return getattr(self._env(), "episode_knobs", None)

    def scorecard(self):
        """The current episode's scorecard (its member's)."""
        return self._env().scorecard()

    def episode_records(self) -> list:
        return self._env().episode_records()
