"""What the real-step and the replay environments share: spaces, actions, features, reward."""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from autoscale.envs.spec import EnvSpec, InstanceSpec, RewardWeights, load_env_spec
from autoscale.scalers.controller import ScaleBounds, ScaleRule, StepStats
from autoscale.scalers.features import FEATURE_BOUND, N_FEATURES, FeatureExtractor, FrameStack
from autoscale.scalers.rules.guard import LossGuard
from autoscale.scalers.scale_time import N_SCALE_TIME, LossNow

__all__ = ["ScaleEnvBase", "step_reward"]


def step_reward(
    weights: RewardWeights,
    skipped: bool,
    precision_loss: float,
    loss: float,
    prev_loss: float,
    diverged: bool,
) -> float:
    """The per-step reward from the scorecard's step metrics (see :class:`RewardWeights`)."""
    r = -weights.skip * float(skipped)
    if not skipped and math.isfinite(precision_loss):
        r -= weights.precision * precision_loss
    if (
        weights.progress
        and not skipped
        and loss > 0
        and prev_loss > 0
        and math.isfinite(loss)
        and math.isfinite(prev_loss)
    ):
        r += weights.progress * max(-1.0, min(1.0, math.log(prev_loss) - math.log(loss)))
    if diverged:
        r -= weights.divergence
    return r


class ScaleEnvBase(gym.Env):
    """Base of the loss-scale environments; subclasses provide the steps.

    Subclasses implement ``_start(instance) -> (scale, extractor_state)``,
    ``_advance(scale) -> (stats, precision_loss, diverged)`` and, for agents that act at scale
    time (``episode.scale_time``), ``_peek_loss() -> float``: the loss of the step about to be
    taken, as the scaler sees it when it scales it.

    At scale time the observation is the stacked after-step features at the base scale followed
    by :mod:`~autoscale.scalers.scale_time`'s features of this step's loss; an action changes the
    base (a delta) or drops this step's scale only (a drop), decoded from the scale the step
    used by :meth:`~autoscale.scalers.actions.ActionMap.base_after`, as an exported policy does.
    """

    metadata = {"render_modes": []}

    def __init__(self, spec: str | EnvSpec | dict, instances: str | list[str] = "train") -> None:
        super().__init__()
        self.env_spec = load_env_spec(spec)
        self.instances: tuple[InstanceSpec, ...] = self.env_spec.instance_set(instances)
        ep = self.env_spec.episode
        self.action_map = ep.action
        self.weights = self.env_spec.reward
        self.episode_steps = ep.steps
        self.bounds = ScaleBounds.of(ep.min_scale, ep.max_scale)
        self.min_scale, self.max_scale = self.bounds.min_scale, self.bounds.max_scale
        if self.action_map.mode == "discrete":
            self.action_space = spaces.Discrete(self.action_map.n)
        else:
            self.action_space = spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
        self.scale_time = ep.scale_time
        self.loss_now = LossNow()
        width = N_FEATURES * ep.history + (N_SCALE_TIME if ep.scale_time else 0)
        self.observation_space = spaces.Box(
            -FEATURE_BOUND, FEATURE_BOUND, shape=(width,), dtype=np.float32
        )
        self.features = FeatureExtractor()
        self.stack = FrameStack(ep.history)
        self.instance: InstanceSpec | None = None
        self.scale = ep.init_scale
        self._t = 0
        self._prev_loss = math.nan
        self._nonfinite_run = 0
        self.last_stats: StepStats | None = None
        self.hit_min = False  # an overflow at the minimum scale this episode
        # the agent's own guard (episode.guard): applied to its scales, learnt from every step
        self.agent_guard: LossGuard | None = None
        self.guard_rule: Any = None  # whose per-step guard the steps apply

    def set_guard(self, rule: ScaleRule | None) -> None:
        """Apply ``rule``'s per-step guard (:meth:`ScaleRule.guard_limit`) to the steps taken from
        now on, as a scaler hosting that rule does (None: no guard); the rule learns its guard
        from the steps its driver hands it. Drivers that step the env with a rule's decisions
        set it; an agent acts under the episode's guard (``episode.guard``), if it has one."""
        self.guard_rule = rule if getattr(rule, "has_guard", False) else None
        self.agent_guard = None  # a driven rule brings its own guard, or none

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        if "instance" in options:
            (self.instance,) = self.env_spec.instance_set([options["instance"]])
        else:
            self.instance = self.instances[int(self.np_random.integers(len(self.instances)))]
        guard = self.env_spec.episode.guard
        if guard is not None and (self.guard_rule is None or self.agent_guard is not None):
            self.agent_guard = LossGuard(guard.guard_history, guard.guard_margin)
            self.guard_rule = self.agent_guard  # an agent starts each episode with a fresh guard
        self.scale, fx_state = self._start(self.instance)
        self.features.load_state_dict(fx_state)
        self._t = 0
        self._prev_loss = self.features.last_loss
        self._nonfinite_run = 0
        self.hit_min = False
        self.loss_now = LossNow()  # fresh at every start, as an exported policy's at a run's
        obs = self._observe(self.stack.reset(self.features.features(self.scale)), False)
        return obs, {"instance": self.instance.name, "scale": self.scale}

    def _observe(self, frames: list[float], done: bool) -> np.ndarray:
        """The observation: the stacked frames, and at scale time the features of the next
        step's loss (zeros once the episode is over: no next step)."""
        if self.scale_time:
            now = (
                [0.0] * N_SCALE_TIME
                if done
                else self.loss_now.features(self._peek_loss(), self.scale)
            )
            frames = frames + now
        return np.asarray(frames, dtype=np.float32)

    def step(self, action):
        if self.instance is None:
            raise RuntimeError("call reset() before step()")
        bits = self.action_map.delta(action)
        if self.scale_time:  # this step's scale; the base carries on unless it was a drop
            return self.step_at(self.scale * 2.0**bits, base=self.scale)
        return self.step_at(self.scale * 2.0**bits)

    def step_at(self, scale: float, base: float | None = None):
        """Take the next step at ``scale`` (clamped to the episode's bounds, as a scaler clamps it)
        instead of an action.

        Lets a rule or an exported scaler drive the environment, with the same reward and
        bookkeeping as an agent's actions. ``base``: the base scale of an agent acting at scale
        time (the next base is decoded from the scale the step used).
        """
        if self.instance is None:
            raise RuntimeError("call reset() before step_at()")
        prev_loss = self._prev_loss
        stats, precision, diverged = self._take(scale)
        truncated = self._t >= self.episode_steps and not diverged
        if base is not None:
            self.scale = self.action_map.base_after(stats.scale, base)
            frame = self.features.features(self.scale)
        else:
            frame = self.features.features(stats.scale)
        obs = self._observe(self.stack.push(frame), diverged or truncated)
        reward = step_reward(
            self.weights, stats.found_inf, precision, stats.loss, prev_loss, diverged
        )
        info = {
            "instance": self.instance.name,
            "scale": self.scale,
            "skipped": stats.found_inf,
            "precision_loss": precision,
            "loss": stats.loss,
        }
        return obs, float(reward), bool(diverged), bool(truncated), info

    def advance_at(self, scale: float) -> bool:
        """:meth:`step_at` for drivers that read no observation, reward or info (a rule or an
        exported scaler reads :attr:`last_stats`): the same step and bookkeeping, without building
        them. Returns whether the episode ended (terminated or truncated)."""
        if self.instance is None:
            raise RuntimeError("call reset() before advance_at()")
        diverged = self._take(scale)[2]
        return diverged or self._t >= self.episode_steps

    def _take(self, scale: float) -> tuple[StepStats, float, bool]:
        """Take the step at the clamped ``scale`` and keep the books; (stats, precision loss,
        diverged)."""
        scale = self.bounds.clamp(scale)
        stats, precision, diverged = self._advance(scale)
        self.last_stats = stats
        found_inf = stats.found_inf
        # ScaleBounds.overflow_at_min; a step skipped as a spike is no overflow (the controller's)
        if found_inf and not stats.spiked and stats.scale <= self.bounds.min_scale:
            self.hit_min = True
        self._t += 1
        self._nonfinite_run = self._nonfinite_run + 1 if stats.loss_nonfinite else 0
        diverged = diverged or self._nonfinite_run >= 3
        self.features.update(stats)
        if self.scale_time:
            self.loss_now.update(stats)
        if self.agent_guard is not None:
            self.agent_guard.observe(stats.scale, stats)
        loss = stats.loss
        if not found_inf and loss == loss and loss != math.inf and loss != -math.inf:
            self._prev_loss = loss
        self.scale = scale
        return stats, precision, bool(diverged)

    # ------------------------------------------------------------------ for subclasses
    def _start(self, instance: InstanceSpec) -> tuple[float, dict[str, Any]]:
        raise NotImplementedError

    def _advance(self, scale: float) -> tuple[StepStats, float, bool]:
        raise NotImplementedError

    def _peek_loss(self) -> float:
        raise NotImplementedError
