"""How an action becomes the next loss scale: shared by the environments and exported neural policies.

Actions change log2(scale). Discrete mode picks one of ``deltas`` (bits); continuous mode maps
an action in [-1, 1] to ``action * max_delta`` bits, rounded to ``resolution`` bits so that scales
stay on a grid (powers of two by default: unscaling by a power of two is exact).
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
    """

    mode: str = "discrete"
    deltas: tuple[float, ...] = field(default=(-2.0, -1.0, 0.0, 1.0, 2.0))
    max_delta: float = 2.0
    resolution: float = 1.0

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
        return len(self.deltas)

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
            if not 0 <= index < len(self.deltas):
                raise ConfigError(f"discrete action {index} out of range 0..{len(self.deltas) - 1}")
            return self.deltas[index]
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
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ActionMap:
        return cls(
            **{k: tuple(v) if k == "deltas" and isinstance(v, list) else v for k, v in d.items()}
        )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
