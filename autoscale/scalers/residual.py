"""Residual policies: a learned offset in bits on a base rule's scale, the rule running beneath.

A rule such as ``auto`` (``amax-loss``) is right most of the time; an agent that sets the scale
from nothing has to learn all of it again, and under an objective that prices precision above
skips it learns to overflow (``experiments/results/auto_selection.json``). A residual policy
keeps the rule and learns only where it is wrong (docs/design.md, "Residual agents"):

- **The rule runs every step.** Its ``next_scale`` sees each step as it would have seen it at
  its own scale: the scale the step used, less the offset in force (a guarded step's scale is the
  guard's, which no offset moves, and is passed on as it is). Offset 0 is the rule exactly:
  the same scales, the same skipped steps (``tests/agents/test_residual.py``).
- **The agent acts once a window.** Every ``window`` steps it picks an offset in bits (a discrete
  set such as -4..+4, or a value in [-1, 1] times ``max_offset`` rounded to whole bits); the set
  scale is the rule's times 2^offset until the next decision. Acting once a window keeps the
  run-time cost at the rule's.
- **The rule's shield stays in force.** Its loss guard (``guard_limit``) lowers every step's
  scale after the offset, so no offset undoes it; and no decision can raise the offset at a step
  that overflowed its gradients, so the rule's backoff is never skipped.
- **What it sees** (:class:`ResidualFeatures`): what the rule cannot see over the last window:
  the headroom between the rule's scale and the hindsight limit of each step (the largest scale
  that would not have overflowed it, ``fp16 max / amax``), overflows, guard triggers, the spread
  of the loss and the gradients' floor, next to the shared after-step features
  (:mod:`~autoscale.scalers.features`) at the set scale.

The environment (:class:`~autoscale.envs.residual_env.ResidualEnv`) steps this very class with
the agent's offsets, so a policy sees in deployment what it saw in training.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError, PolicyError
from autoscale.scalers.actions import ActionMap
from autoscale.scalers.controller import FP16_MAX, ScaleRule, StepStats
from autoscale.scalers.features import FEATURE_BOUND, FEATURE_VERSION, N_FEATURES, FeatureExtractor
from autoscale.scalers.policies import register_policy_kind

__all__ = [
    "RESIDUAL_FEATURE_NAMES",
    "RESIDUAL_VERSION",
    "N_RESIDUAL",
    "ResidualFeatures",
    "ResidualRule",
    "default_offsets",
    "load_residual",
]

RESIDUAL_VERSION = 1
LOG2_FP16_MAX = math.log2(FP16_MAX)

RESIDUAL_FEATURE_NAMES: tuple[str, ...] = (
    "offset",  # the offset in force, bits / 4
    "overflow_share",  # share of the window's steps whose gradients overflowed (loss finite)
    "guarded_share",  # share of the window's steps the rule's guard lowered
    "room_known",  # 1 when a step of the window had a finite gradient amax
    "room_min",  # min over the window of log2(limit / rule's scale), bits / 16
    "room_mean",  # its mean, bits / 16
    "floor_min",  # min over the window of log2(grad rms x scale used) - log2(2^-14), bits / 16
    "loss_spread",  # log2(max |loss| / min |loss|) over the window, bits / 16
    "nonfinite_share",  # share of the window's steps whose loss was non-finite
)
N_RESIDUAL = len(RESIDUAL_FEATURE_NAMES)
N_OBSERVATION = N_RESIDUAL + N_FEATURES


def default_offsets(max_offset: int = 4) -> tuple[float, ...]:
    """The discrete offsets -max_offset..+max_offset bits."""
    return tuple(float(b) for b in range(-max_offset, max_offset + 1))


def _clip(x: float, b: float = FEATURE_BOUND) -> float:
    return x if -b <= x <= b else (-b if x < -b else b)


class ResidualFeatures:
    """The window's statistics a residual agent reads, from the steps as the rule saw them."""

    names = RESIDUAL_FEATURE_NAMES

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.n = self.overflows = self.guarded = self.nonfinite = 0
        self.rooms: list[float] = []
        self.floor = math.inf
        self.loss_lo, self.loss_hi = math.inf, 0.0

    def update(self, stats: StepStats, rule_scale: float) -> None:
        """One step; ``rule_scale``: the base rule's scale in force for it."""
        self.n += 1
        if stats.loss_nonfinite:
            self.nonfinite += 1
            return
        if stats.found_inf or not math.isfinite(stats.grad_amax):
            self.overflows += 1
        elif stats.grad_amax > 0:
            self.rooms.append(LOG2_FP16_MAX - math.log2(stats.grad_amax) - math.log2(rule_scale))
            if stats.grad_rms > 0 and math.isfinite(stats.grad_rms):
                self.floor = min(self.floor, math.log2(stats.grad_rms * stats.scale) + 14.0)
        if stats.guarded:
            self.guarded += 1
        loss = abs(stats.loss) if stats.loss_seen else math.nan
        if 0.0 < loss < math.inf:
            self.loss_lo, self.loss_hi = min(self.loss_lo, loss), max(self.loss_hi, loss)

    def features(self, offset: float) -> list[float]:
        n = self.n or 1
        rooms = self.rooms
        known = bool(rooms)
        spread = math.log2(self.loss_hi / self.loss_lo) if self.loss_hi > 0 else 0.0
        return [
            _clip(offset / 4.0),
            self.overflows / n,
            self.guarded / n,
            float(known),
            _clip(min(rooms) / 16.0) if known else 0.0,
            _clip(sum(rooms) / len(rooms) / 16.0) if known else 0.0,
            _clip(self.floor / 16.0) if math.isfinite(self.floor) else 0.0,
            _clip(spread / 16.0),
            self.nonfinite / n,
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "overflows": self.overflows,
            "guarded": self.guarded,
            "nonfinite": self.nonfinite,
            "rooms": list(self.rooms),
            "floor": None if math.isinf(self.floor) else self.floor,
            "loss_lo": None if math.isinf(self.loss_lo) else self.loss_lo,
            "loss_hi": self.loss_hi,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n, self.overflows = int(state["n"]), int(state["overflows"])
        self.guarded, self.nonfinite = int(state["guarded"]), int(state["nonfinite"])
        self.rooms = [float(r) for r in state["rooms"]]
        self.floor = math.inf if state["floor"] is None else float(state["floor"])
        self.loss_lo = math.inf if state["loss_lo"] is None else float(state["loss_lo"])
        self.loss_hi = float(state["loss_hi"])


class ResidualRule(ScaleRule):
    """A base rule with an offset in bits on its scale, chosen once a window (module docstring).

    Args:
        base: The rule underneath (a fresh one: it is driven from this rule's start).
        window: Steps between decisions.
        action: How an action becomes the offset (:class:`~autoscale.scalers.actions.ActionMap`:
            its discrete ``deltas`` are the offsets; continuous: ``max_delta`` bits at +-1).
        decide: ``decide(observation) -> action`` at each window's end and at the start (an
            exported actor); None: the offset changes only through :meth:`set_offset` (the
            environment's agent).
        max_offset: Offsets are clipped to +-this many bits.
    """

    description = "a learned offset in bits on a base rule's scale, chosen once a window"
    source = "autoscale train-agent --residual"
    needs_stats = True
    needs_loss = True

    def __init__(
        self,
        base: ScaleRule,
        *,
        window: int = 16,
        action: ActionMap | None = None,
        decide: Callable[[list[float]], Any] | None = None,
        max_offset: float = 4.0,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"residual window must be an integer >= 1 step, got {window!r}")
        if getattr(base, "scale_time", False):
            raise ConfigError(
                f"a residual policy needs a base rule that sets the scale after each step; "
                f"'{base.name}' decides at scale time"
            )
        self.base = base
        self.window = window
        self.action = action or ActionMap(deltas=default_offsets(int(max_offset)))
        self.decide = decide
        self.max_offset = float(max_offset)
        self.has_guard = bool(getattr(base, "has_guard", False))
        self.needs_rms = True
        self.features = FeatureExtractor()
        self.window_stats = ResidualFeatures()
        self.offset = 0.0  # bits in force
        self.t = 0  # steps since the start
        self.rule_scale = math.nan  # the base rule's last wish (before the offset)
        self.last_scale = math.nan  # the scale the last step used
        self.last_overflow = False  # its gradients overflowed (the loss finite, not guarded)
        self.last_offset = 0.0  # the offset that step was taken under

    # ------------------------------------------------------------------ decisions
    def observation(self) -> list[float]:
        """What the agent reads now: the window's statistics and the after-step features at the
        set scale."""
        scale = self.rule_scale * 2.0**self.offset
        return self.window_stats.features(self.offset) + self.features.features(scale)

    def offset_of(self, action: Any) -> float:
        """The offset in bits ``action`` asks for (clipped to +-``max_offset``)."""
        bits = float(self.action.delta(action))
        return max(-self.max_offset, min(self.max_offset, bits))

    def set_offset(self, bits: float) -> float:
        """Put ``bits`` in force from the next step (the shield applies); return the scale wanted
        now. The environment's entry: the caller clamps it and calls :meth:`adopt`."""
        self.offset = bits
        self.window_stats.reset()  # the agent read the window: the next one starts
        return self._wanted()

    def _wanted(self) -> float:
        if self.last_overflow and self.offset > self.last_offset:
            self.offset = self.last_offset  # the shield: no rise over an overflowed step
        return self.rule_scale * 2.0**self.offset

    def _decide(self) -> None:
        """At a window's end: the actor's decision, from the window it read (without an actor
        the window is kept for the environment's agent to read, until :meth:`set_offset`)."""
        if self.decide is not None:
            self.offset = self.offset_of(self.decide(self.observation()))
            self.window_stats.reset()

    # ------------------------------------------------------------------ the rule interface
    def start(self, scale: float, features_state: dict[str, Any] | None = None) -> float:
        if features_state is None:
            self.features.reset()
        else:
            self.features.load_state_dict(features_state)
        self.window_stats.reset()
        self.rule_scale = self.base.start(scale, features_state)
        self.t, self.offset, self.last_offset = 0, 0.0, 0.0
        self.last_scale, self.last_overflow = math.nan, False
        self._decide()
        return self._wanted()

    def adopt(self, scale: float) -> None:
        self.base.adopt(scale * 2.0**-self.offset)

    def guard_limit(self) -> float | None:
        return self.base.guard_limit()

    def spike_limit(self) -> float | None:
        return self.base.spike_limit()

    def backs_off_on_overflow(self) -> bool:
        return self.base.backs_off_on_overflow()

    def next_scale(self, scale: float, stats: StepStats) -> float:
        offset = self.offset
        rule_scale = self.rule_scale if self.rule_scale == self.rule_scale else scale
        seen = scale if stats.guarded or not offset else scale * 2.0**-offset
        self.window_stats.update(stats, rule_scale)
        self.features.update(stats)
        self.rule_scale = self.base.next_scale(seen, stats)
        self.last_scale, self.last_offset = scale, offset
        self.last_overflow = stats.found_inf and not stats.loss_nonfinite and not stats.guarded
        self.t += 1
        if self.t % self.window == 0:
            self._decide()
        return self._wanted()

    def params(self) -> dict[str, Any]:
        return {
            "base": {"family": self.base.name, "parameters": self.base.params()},
            "window": self.window,
            "action": self.action.to_dict(),
            "max_offset": self.max_offset,
        }

    def state(self) -> dict[str, Any]:
        return {
            "base": self.base.state(),
            "features": self.features.state_dict(),
            "window_stats": self.window_stats.state_dict(),
            "offset": self.offset,
            "t": self.t,
            "rule_scale": None if self.rule_scale != self.rule_scale else self.rule_scale,
            "last_scale": None if self.last_scale != self.last_scale else self.last_scale,
            "last_overflow": self.last_overflow,
            "last_offset": self.last_offset,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "base" not in state:
            raise ConfigError(
                "residual policy: the checkpoint's state is not a residual policy's (no 'base'); "
                "it was written by another scaler"
            )
        self.base.load_state(state["base"])
        try:
            self.features.load_state_dict(state["features"])
            self.window_stats.load_state_dict(state["window_stats"])
            self.offset = float(state["offset"])
            self.t = int(state["t"])
            self.last_offset = float(state["last_offset"])
            self.last_overflow = bool(state["last_overflow"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"residual policy: the checkpoint's state is malformed ({type(exc).__name__}: "
                f"{exc}); it was not written by this policy"
            ) from None
        rs, ls = state.get("rule_scale"), state.get("last_scale")
        self.rule_scale = math.nan if rs is None else float(rs)
        self.last_scale = math.nan if ls is None else float(ls)

    def deepspeed_config(self, init_scale: float, min_scale: float) -> dict[str, Any]:
        from autoscale.scalers.neural import deepspeed_refusal

        raise deepspeed_refusal(getattr(self, "policy_name", "residual"), "residual")


def load_residual(path: Path, manifest: Any, device: str | None, overrides: dict[str, Any]):
    """A ``kind: residual`` policy: the base rule of its manifest, its actor from ``weights.pt``."""
    from autoscale.scalers.neural import HEADS, act_with, load_weights
    from autoscale.scalers.registry import SCALER_OPTIONS, rule_class
    from autoscale.scalers.scaler import LossScaler

    name, p = manifest.name, manifest.parameters
    version = p.get("residual_version")
    if version != RESIDUAL_VERSION or manifest.feature_version != FEATURE_VERSION:
        raise PolicyError(
            f"policy '{name}' reads residual features v{version} and feature spec "
            f"v{manifest.feature_version}; this autoscale computes v{RESIDUAL_VERSION} and "
            f"v{FEATURE_VERSION}: retrain and re-export it with this version"
        )
    for key in ("base", "window", "action", "layers", "activation", "head", "max_offset"):
        if key not in p:
            raise PolicyError(f"policy '{name}' manifest lacks parameters.{key}; re-export it")
    base = p["base"]
    cls = rule_class(base.get("family", "")) if isinstance(base, dict) else None
    if cls is None:
        raise PolicyError(
            f"policy '{name}' ({path}) runs on rule {base!r}, which is not registered here; "
            "install the package that provides it (autoscale list shows the rules)"
        )
    if p["head"] not in HEADS or p["layers"][0] != N_OBSERVATION:
        raise PolicyError(
            f"policy '{name}' expects a network from {N_OBSERVATION} inputs with a head in "
            f"{HEADS}; its manifest has layers {p['layers']!r}, head {p['head']!r}: re-export it"
        )
    _, actor = load_weights(path, manifest, overrides, "residual")
    try:
        base_rule = cls(**{k: v for k, v in base["parameters"].items() if k not in SCALER_OPTIONS})
        action = ActionMap.from_dict(p["action"])
    except (ConfigError, TypeError) as exc:
        raise PolicyError(
            f"policy '{name}': unreadable base rule or actions ({exc}); re-export it"
        ) from None
    act = act_with(actor.eval(), p["head"], None)
    rule = ResidualRule(
        base_rule,
        window=int(p["window"]),
        action=action,
        decide=act,
        max_offset=float(p["max_offset"]),
    )
    rule.policy_name = name
    options = {k: p[k] for k in ("init_scale", "min_scale", "max_scale") if p.get(k) is not None}
    return LossScaler(rule, device, name=name, **{**options, **overrides})


register_policy_kind("residual", load_residual)
