"""``ResidualEnv``: an agent picks an offset on a base rule's scale once a window, trained to the bar.

The environment steps the run-time :class:`~autoscale.scalers.residual.ResidualRule` itself (the
base rule underneath, its guard applied to every step, the shield), with the agent's offsets in
place of an exported actor's: what the agent sees and what its offsets do are what an exported
residual policy sees and does.

Observation Space:
    ``Box(-4, 4, (20,))``: the window's statistics
    (:data:`~autoscale.scalers.residual.RESIDUAL_FEATURE_NAMES`) and the shared after-step
    features at the set scale (:data:`~autoscale.scalers.features.FEATURE_NAMES`).

Action Space:
    ``Discrete(n)``: the offsets in bits (default -4..+4); or ``Box(-1, 1, (1,))`` times
    ``max_offset`` bits, rounded to whole bits. The offset holds for ``window`` steps.

Rewards:
    The sum of the window's per-step rewards (:func:`~autoscale.envs.base.step_reward`, the
    spec's weights), less the constraints of the acceptance check: torch's replay of the same
    episode (the same steps, from the same start) runs at reset, and each window pays
    ``lambda_skip`` per step it skipped beyond torch's skips in the same steps and
    ``lambda_precision x window`` per point of mean precision loss beyond torch's there. The
    multipliers (:class:`Multipliers`) rise at the end of each episode whose skip rate exceeded
    torch's plus the bar's allowance (or whose precision loss exceeded torch's) and fall back
    otherwise (dual ascent, a Lagrangian relaxation): the agent is trained under the bar it is
    judged by, not only the weighted sum. ``info["constraint"]`` at an episode's end gives the
    violations and multipliers.

Episode End:
    ``truncated`` after the inner episode's steps (replay: the spec's horizon), ``terminated``
    when training diverges (three non-finite losses in a row, as the inner env says).

Version History:
    * v0: first version (residual features v1, feature spec 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from autoscale.errors import ConfigError
from autoscale.scalers.actions import ActionMap
from autoscale.scalers.controller import ScaleController, ScaleRule
from autoscale.scalers.features import FEATURE_BOUND
from autoscale.scalers.residual import N_OBSERVATION, ResidualRule, default_offsets

__all__ = ["Multipliers", "ResidualEnv", "BAR_SKIP_ALLOWANCE"]

BAR_SKIP_ALLOWANCE = 0.005  # the acceptance bar's allowance over torch's skip rate (DESIGN.md 3.8)


@dataclass
class Multipliers:
    """The Lagrange multipliers of the two constraints and their history.

    Attributes:
        skip: Reward units per skipped step beyond torch's in a window.
        precision: Reward units per point of precision loss beyond torch's, per step.
        rate: How much a multiplier moves per point (1.0 = 100%) of an episode's violation.
        ceiling: The largest a multiplier gets.
        history: (skip violation, precision violation, skip multiplier, precision multiplier) at
            the end of each training episode.
    """

    skip: float = 1.0
    precision: float = 1.0
    rate: float = 200.0
    ceiling: float = 50.0
    history: list[tuple[float, float, float, float]] = field(default_factory=list)

    def update(self, skip_violation: float, precision_violation: float) -> None:
        """Dual ascent: each multiplier moves by ``rate`` times its episode's violation."""
        self.skip = min(self.ceiling, max(0.0, self.skip + self.rate * skip_violation))
        self.precision = min(
            self.ceiling, max(0.0, self.precision + self.rate * precision_violation)
        )
        self.history.append((skip_violation, precision_violation, self.skip, self.precision))

    def to_dict(self) -> dict[str, Any]:
        return {"skip": self.skip, "precision": self.precision, "rate": self.rate}


def _rule_factory(base: str | ScaleRule, spec: Any):
    """A maker of fresh base rules: ``base`` is a scaler name (``auto``, a rule id, a policy
    folder) or a rule to copy the parameters of."""
    if isinstance(base, ScaleRule):
        cls, params = type(base), base.params()
        return lambda: cls(**params)
    from autoscale.envs.episodes import scaler_for

    rule = scaler_for(base, spec).controller.rule
    if isinstance(rule, ResidualRule):
        rule = rule.base
    cls, params = type(rule), rule.params()
    return lambda: cls(**params)


class ResidualEnv(gym.Env):
    """Residual loss-scale control over an inner real-step or replay environment (module doc).

    Args:
        spec: An env or suite spec (path, name or object).
        instances: ``"train"``, ``"test"`` or instance names.
        trace: Replay these traces (a Trace, a path, or for a suite member -> Trace); None: real
            steps (then no torch reference, and no constraint).
        base: The rule underneath: a scaler name (default ``auto``) or a rule.
        window: Steps an offset holds.
        mode: ``discrete`` (``offsets``) or ``continuous`` (``max_offset`` bits at +-1).
        offsets: The discrete offsets in bits.
        max_offset: The largest offset either way.
        constrained: Train to the bar: torch's replay and the multipliers (replay only).
        multipliers: Shared :class:`Multipliers` (e.g. between a training and an evaluation env);
            None: new ones.
        learn_multipliers: Whether episodes update the multipliers (False: an evaluation env).
        random_offset: Replay: start episodes anywhere in longer traces.
        knobs: Replay: scenario knobs drawn per episode (:class:`~autoscale.envs.knobs.Knobs`:
            loss weights, drifts, spikes, bad batches on the recorded steps); torch's reference
            replays the same draw, so the constraints bind where the knobs make the rule wrong.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        spec: Any,
        instances: str | list[str] = "train",
        trace: Any = None,
        *,
        base: str | ScaleRule = "auto",
        window: int = 16,
        mode: str = "discrete",
        offsets: tuple[float, ...] | None = None,
        max_offset: int = 4,
        constrained: bool = True,
        multipliers: Multipliers | None = None,
        learn_multipliers: bool = True,
        random_offset: bool = False,
        knobs: Any = None,
    ) -> None:
        super().__init__()
        from autoscale.envs.episodes import make_env
        from autoscale.envs.suite import load_spec

        self.spec = load_spec(spec)
        self.inner = make_env(self.spec, instances, trace)
        self._members = list(getattr(self.inner, "envs", {}).values()) or [self.inner]
        if knobs is not None and trace is None:
            raise ConfigError(
                "knobs apply to replayed steps: give the traces (trace=...) or drop knobs"
            )
        for env in self._members:
            env.random_offset = random_offset
            if knobs is not None:
                env.knobs = knobs
        self.knobs = knobs
        self.ref = (
            make_env(self.spec, instances, trace) if constrained and trace is not None else None
        )
        self.window = window
        self.action_map = (
            ActionMap(deltas=offsets or default_offsets(max_offset))
            if mode == "discrete"
            else ActionMap(mode="continuous", max_delta=float(max_offset), resolution=1.0)
        )
        self.max_offset = float(max_offset)
        self.action_space = (
            spaces.Discrete(self.action_map.n)
            if mode == "discrete"
            else spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
        )
        self.observation_space = spaces.Box(
            -FEATURE_BOUND, FEATURE_BOUND, shape=(N_OBSERVATION,), dtype=np.float32
        )
        self.make_base = _rule_factory(base, self.spec)
        self.base_name = base if isinstance(base, str) else base.name
        ep = self.spec.episode
        from autoscale.scalers.controller import ScaleBounds

        self.bounds = ScaleBounds.of(ep.min_scale, ep.max_scale)
        self.multipliers = multipliers if multipliers is not None else Multipliers()
        self.learn_multipliers = learn_multipliers
        self.rule: ResidualRule | None = None
        self.controller: ScaleController | None = None
        self.scale = math.nan
        self._t = 0
        self._ref: tuple[list[bool], list[float]] | None = None
        self._mine: tuple[list[bool], list[float]] = ([], [])

    def new_rule(self) -> ResidualRule:
        """A residual rule over a fresh base rule, with this env's window and actions (no actor)."""
        return ResidualRule(
            self.make_base(), window=self.window, action=self.action_map, max_offset=self.max_offset
        )

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        inner_seed = None  # the inner env is seeded from this one's, once or when asked
        if seed is not None or not getattr(self, "_seeded", False):
            inner_seed, self._seeded = int(self.np_random.integers(2**31)), True
        _, info = self.inner.reset(seed=inner_seed, options=options)
        self.rule = self.new_rule()
        self.controller = ScaleController(self.rule, self.bounds)
        self.inner.set_guard(self.rule)
        self.scale = self.controller.start(info["scale"], self.inner.features.state_dict())
        self._t = 0
        self._mine = ([], [])
        self._ref = self._torch_episode(info) if self.ref is not None else None
        return self._obs(), info

    def _torch_episode(self, info: dict[str, Any]) -> tuple[list[bool], list[float]]:
        """Torch's skipped steps and precision losses on the same episode (the same start)."""
        from autoscale.envs.episodes import drive_episode, scaler_for

        _, records = drive_episode(
            self.ref,
            scaler_for("torch", self.spec),
            info["instance"],
            info.get("offset"),
            knobs=self.inner.episode_knobs if self.knobs is not None else None,
        )
        return [r.found_inf for r in records], [r.precision_loss for r in records]

    def _obs(self) -> np.ndarray:
        return np.asarray(self.rule.observation(), dtype=np.float32)

    def step(self, action):
        if self.rule is None:
            raise RuntimeError("call reset() before step()")
        rule, controller, inner = self.rule, self.controller, self.inner
        self.scale = self.bounds.clamp(rule.set_offset(rule.offset_of(action)))
        rule.adopt(self.scale)
        reward, terminated, truncated, info = 0.0, False, False, {}
        start = self._t
        skips, precisions = self._mine
        for _ in range(self.window):
            _, r, terminated, truncated, info = inner.step_at(self.scale)
            reward += r
            skips.append(bool(info["skipped"]))
            precisions.append(info["precision_loss"])
            self._t += 1
            self.scale = controller.step(inner.last_stats)
            if terminated or truncated:
                break
        info = {**info, "offset": rule.offset, "scale": self.scale}
        if self._ref is not None:
            reward -= self._penalty(start, self._t)
            if terminated or truncated:
                info["constraint"] = self._episode_end()
        return self._obs(), float(reward), bool(terminated), bool(truncated), info

    # ------------------------------------------------------------------ the constraints
    def _penalty(self, lo: int, hi: int) -> float:
        ref_skips, ref_prec = self._ref
        skips, precisions = self._mine
        extra = sum(skips[lo:hi]) - sum(ref_skips[lo:hi])
        worse = _mean(precisions[lo:hi]) - _mean(ref_prec[lo:hi])
        m = self.multipliers
        return m.skip * max(0.0, extra) + m.precision * (hi - lo) * max(0.0, worse)

    def _episode_end(self) -> dict[str, float]:
        ref_skips, ref_prec = self._ref
        skips, precisions = self._mine
        n = len(skips)
        skip_v = sum(skips) / n - sum(ref_skips[:n]) / n - BAR_SKIP_ALLOWANCE
        prec_v = _mean(precisions) - _mean(ref_prec[:n])
        if self.learn_multipliers:
            self.multipliers.update(skip_v, prec_v if math.isfinite(prec_v) else 0.0)
        return {
            "skip_rate": sum(skips) / n,
            "torch_skip_rate": sum(ref_skips[:n]) / n,
            "skip_violation": skip_v,
            "precision_violation": prec_v,
            **{f"lambda_{k}": v for k, v in self.multipliers.to_dict().items() if k != "rate"},
        }


def _mean(values: list[float]) -> float:
    """Mean of the finite values (a skipped step has no precision loss); 0.0 when none."""
    finite = [v for v in values if v == v]
    return sum(finite) / len(finite) if finite else 0.0
