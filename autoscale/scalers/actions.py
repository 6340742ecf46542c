"""How an action becomes the next loss scale: shared by the environments and exported neural policies.

Actions change log2(scale). Discrete mode picks one of ``deltas`` (bits); continuous mode maps
an action in [-1, 1] to ``action * max_delta`` bits, rounded to ``resolution`` bits so that scales
stay on a grid (powers of two by default: unscaling by a power of two is exact).

At scale time (``episode.scale_time``), discrete actions may also drop this step's scale by one
of ``drops`` bits and keep the base scale for the next step: the action a policy needs to take
a loss spike it sees coming. :meth:`ActionMap.base_after` decodes the next base from the scale
the step used, the same way in the environments and in an exported policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autoscale.errors import ConfigError

__all__ = ["ActionMap"]


@dataclass(frozen=True)
class ActionMap:
    """Maps policy actions to changes of log2(scale).

    Attributes:
        mode: ``"discrete"`` or ``"continuous"``.
        deltas: Discrete mode: the change in bits of each action index.
        max_delta: Continuous mode: bits at action = +-1.
        resolution: Continuous mode: the change is rounded to a multiple of this (bits); 0 = none.
        drops: Discrete mode at scale time: bits the step's scale drops for this step only
            (action indices after the deltas'); each larger than the largest downward delta.
    """

    mode: str = "discrete"
    deltas: tuple[float, ...] = field(default=(-2.0, -1.0, 0.0, 1.0, 2.0))
    max_delta: float = 2.0
    resolution: float = 1.0
    drops: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in ("discrete", "continuous"):
            raise ConfigError(f"action mode must be 'discrete' or 'continuous', got '{self.mode}'")
        if not isinstance(self.deltas, (list, tuple)) or not all(
            _number(d) and math.isfinite(d) for d in self.deltas
        ):
            raise ConfigError(
                f"action deltas must be a list of numbers of bits such as [-2, -1, 0, 1, 2], "
                f"got {self.deltas!r}"
            )
        object.__setattr__(self, "deltas", tuple(float(d) for d in self.deltas))
        if not isinstance(self.drops, (list, tuple)) or not all(
            _number(d) and math.isfinite(d) and d > 0 for d in self.drops
        ):
            raise ConfigError(
                f"action drops must be a list of positive numbers of bits such as [4, 8, 12, 16], "
                f"got {self.drops!r}"
            )
        object.__setattr__(self, "drops", tuple(float(d) for d in self.drops))
        if self.drops and self.mode != "discrete":
            raise ConfigError(
                "action drops need discrete actions (mode: discrete); remove drops or the mode"
            )
        if self.drops and min(self.drops) <= -min(self.deltas):
            raise ConfigError(
                f"action drops {list(self.drops)} must each exceed the largest downward delta "
                f"({-min(self.deltas):g} bits), or a drop could not be told from a delta"
            )
        if self.mode == "discrete" and len(self.deltas) < 2:
            raise ConfigError(f"discrete actions need at least two deltas, got {list(self.deltas)}")
        if not (_number(self.max_delta) and math.isfinite(self.max_delta) and self.max_delta > 0):
            raise ConfigError(
                f"max_delta must be a positive number of bits, got {self.max_delta!r}"
            )
        if not (
            _number(self.resolution) and math.isfinite(self.resolution) and self.resolution >= 0
        ):
            raise ConfigError(f"resolution must be >= 0 bits, got {self.resolution!r}")

    @property
    def n(self) -> int:
        return len(self.deltas) + len(self.drops)

    def base_after(self, used: float, base: float) -> float:
        """The base scale after a step that used ``used`` at base ``base``: ``used`` after a
        delta, ``base`` after a drop (a used scale further below the base than halfway, in
        log2, between the largest downward delta and the smallest drop, so that the float32
        rounding of a clamped scale cannot move it across). Decoded from the scale alone, so
        that an exported policy needs nothing more back from the device. A drop that the
        minimum scale cut short to within the deltas' range reads as a delta: the base moves
        there, in the environments and in a scaler alike."""
        if self.drops and used < base * 2.0 ** ((min(self.deltas) - min(self.drops)) / 2):
            return base
        return used

    def delta(self, action: Any) -> float:
        """The change of log2(scale), in bits, that ``action`` asks for."""
        if self.mode == "discrete":
            index = (
                action  # an int as it comes (the common case, first: this runs once a step)
                if type(action) is int
                else int(
                    action.item()
                    if hasattr(action, "item")
                    else (action[0] if isinstance(action, (list, tuple)) else action)
                )
            )
            n = len(self.deltas)
            if 0 <= index < n:
                return self.deltas[index]
            if n <= index < n + len(self.drops):
                return -self.drops[index - n]
            raise ConfigError(f"discrete action {index} out of range 0..{self.n - 1}")
        value = float(
            action.reshape(-1)[0]
            if hasattr(action, "reshape")
            else (action[0] if isinstance(action, (list, tuple)) else action)
        )
        bits = max(-1.0, min(1.0, value)) * self.max_delta
        if self.resolution > 0:
            bits = round(bits / self.resolution) * self.resolution
        return bits

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "deltas": list(self.deltas),
            "max_delta": self.max_delta,
            "resolution": self.resolution,
            **({"drops": list(self.drops)} if self.drops else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ActionMap:
        return cls(
            **{
                k: tuple(v) if k in ("deltas", "drops") and isinstance(v, list) else v
                for k, v in d.items()
            }
        )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
