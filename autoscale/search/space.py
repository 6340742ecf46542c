"""The two search spaces: parametric rule families with their knobs (:func:`suggest_parametric`),
and residual RL agents (:func:`suggest_residual`). A rule's knobs are sampled as ``RULE.KNOB``, so
each rule keeps its own distribution; ranges are defined by knob name in :data:`KNOBS`, so a new
rule reusing those keyword names is searched with no change here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KNOBS",
    "Knob",
    "parametric_families",
    "searched_families",
    "suggest_parametric",
    "default_trial_params",
    "suggest_residual",
]


@dataclass(frozen=True)
class Knob:
    """A searched keyword: ``kind`` is ``int``, ``float``, ``bool`` or ``log2`` (2**k, k an int)."""

    kind: str
    low: float = 0.0
    high: float = 1.0
    log: bool = False

    def suggest(self, trial: Any, name: str) -> Any:
        if self.kind == "int":
            return trial.suggest_int(name, int(self.low), int(self.high), log=self.log)
        if self.kind == "float":
            return trial.suggest_float(name, self.low, self.high, log=self.log)
        if self.kind == "bool":
            return trial.suggest_categorical(name, [False, True])
        return 2.0 ** trial.suggest_int(name, int(self.low), int(self.high))

    def encode(self, value: Any) -> Any:
        """The trial parameter that stands for ``value`` (clipped into the range)."""
        if self.kind == "bool":
            return bool(value)
        if self.kind == "log2":
            value = round(math.log2(value))
        value = min(max(value, self.low), self.high)
        return int(round(value)) if self.kind in ("int", "log2") else float(value)


_FACTOR = Knob("float", 1.25, 8.0, log=True)
KNOBS: dict[str, Knob] = {
    "growth_factor": _FACTOR,
    "scale_factor": _FACTOR,
    "factor": _FACTOR,
    "backoff_factor": Knob("float", 1 / 16, 0.9, log=True),
    "growth_interval": Knob("int", 1, 2000, log=True),
    "loss_scale_window": Knob("int", 1, 1000, log=True),
    "period": Knob("int", 1, 2000, log=True),
    "scale_window": Knob("int", 1, 16384, log=True),
    "hysteresis": Knob("int", 1, 8),
    "consecutive_hysteresis": Knob("bool"),
    "tolerance": Knob("float", 0.0, 0.5),
    "history_len": Knob("int", 1, 64, log=True),
    "margin": Knob("float", 0.0, 6.0),
}
# Searched only for these rules (elsewhere the episode's value is used).
RULE_KNOBS: dict[str, dict[str, Knob]] = {
    "static": {"init_scale": Knob("log2", 0, 40)},
    # 0 keeps every step's lesson; above, near-zero losses teach the guard nothing (LossGuard)
    "amax-loss": {"guard_floor": Knob("float", 0.0, 24.0)},
}


def parametric_families() -> dict[str, dict[str, Any]]:
    """Built-in rule -> its keyword defaults (plugins and exported policies are not searched)."""
    from autoscale.scalers import list_scalers

    return {i.name: dict(i.defaults) for i in list_scalers() if i.kind == "rule"}


def searched_families(names: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """The families a search tries: ``names`` (``--family``), else every built-in rule whose
    scale adapts (``static`` cannot follow gradients that drift over a run).

    Raises:
        UnknownNameError: a name that is no built-in rule (with the nearest one).
    """
    from autoscale.errors import unknown_name
    from autoscale.scalers.registry import rule_class

    every = parametric_families()
    if names is None:
        return {r: d for r, d in every.items() if rule_class(r).adapts}
    for n in names:
        if n not in every:
            raise unknown_name("rule family", n, sorted(every), "autoscale list")
    return {n: every[n] for n in dict.fromkeys(names)}


def _knobs(rule: str, defaults: dict[str, Any]) -> dict[str, Knob]:
    out = {k: KNOBS[k] for k in defaults if k in KNOBS}
    out.update(RULE_KNOBS.get(rule, {}))
    return out


def _param_name(rule: str, knob: str, spec: Knob) -> str:
    return f"{rule}.log2_{knob}" if spec.kind == "log2" else f"{rule}.{knob}"


def suggest_parametric(
    trial: Any, families: dict[str, dict[str, Any]]
) -> tuple[str, dict[str, Any]]:
    """Sample a rule and its knobs; returns ``(rule, keyword arguments)``."""
    rule = trial.suggest_categorical("rule", sorted(families))
    params = {
        knob: spec.suggest(trial, _param_name(rule, knob, spec))
        for knob, spec in _knobs(rule, families[rule]).items()
    }
    return rule, params


def default_trial_params(rule: str, defaults: dict[str, Any], episode: Any) -> dict[str, Any]:
    """The trial parameters of the built-in ``rule`` as it is evaluated, for enqueueing."""
    values = {**defaults, "init_scale": episode.init_scale}
    out: dict[str, Any] = {"rule": rule}
    for knob, k in _knobs(rule, defaults).items():
        out[_param_name(rule, knob, k)] = k.encode(values[knob])
    return out


def suggest_residual(trial: Any) -> dict[str, Any]:
    """Sample a residual agent's algorithm, hyperparameters and precision reward multiplier."""
    algo = trial.suggest_categorical("algo", ["a2c", "dqn", "ppo"])
    hp: dict[str, Any] = {
        "learning_rate": trial.suggest_float(f"{algo}.learning_rate", 1e-4, 3e-3, log=True),
        "gamma": trial.suggest_float(f"{algo}.gamma", 0.8, 0.99),
    }
    if algo in ("ppo", "a2c"):
        hp["ent_coef"] = trial.suggest_float(f"{algo}.ent_coef", 1e-4, 0.05, log=True)
    if algo == "dqn":
        hp["exploration_fraction"] = trial.suggest_float(f"{algo}.exploration_fraction", 0.1, 0.5)
    precision_x = trial.suggest_float("reward.precision_x", 0.25, 4.0, log=True)
    return {"algo": algo, "hyperparams": hp, "precision_x": precision_x}
