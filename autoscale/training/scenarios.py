"""Scenarios: training conditions that reproduce a known loss-scaling failure on any workload.

A :class:`Scenario` decides, per step, the learning-rate multiplier, the weight on the loss and the
objective a micro-batch is trained on. Everything it does is a function of its parameters, the
seed and the step index, so runs are reproducible and snapshots need no scenario state beyond
what :meth:`Scenario.state_dict` returns.

Register a new one with :func:`register_scenario`::

    @register_scenario("my-failure")
    class MyFailure(Scenario):
        '''What it reproduces.'''
        description = "one line for listings"
        defaults = {"strength": 1.0}

        def loss_weight(self, step):
            return self.params["strength"]
"""

from __future__ import annotations

import difflib
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from autoscale.errors import ConfigError, unknown_name

if TYPE_CHECKING:
    import torch

    from autoscale.training.data import BatchStream

__all__ = [
    "Scenario",
    "register_scenario",
    "unregister_scenario",
    "scenario_class",
    "make_scenario",
    "list_scenarios",
    "Clean",
    "BadBatches",
    "SmallGrads",
    "Moving",
    "Preference",
    "Drift",
    "TokenSum",
]

_SCENARIOS: dict[str, type[Scenario]] = {}


class Scenario:
    """Base of every scenario: the clean loop, which subclasses perturb.

    Subclasses set ``description`` and ``defaults`` (every accepted parameter with its default;
    the default's type is the parameter's type) and override any of :meth:`lr_factor`,
    :meth:`loss_weight`, :meth:`objective`, :meth:`eval_objective`.

    Args:
        seed: The workload's seed.
        **params: Overrides of ``defaults``.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    defaults: ClassVar[dict[str, int | float]] = {}

    def __init__(self, seed: int = 0, **params: Any) -> None:
        self.seed = seed
        self.params: dict[str, int | float] = {**self.defaults, **self.check_params(params)}

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> dict[str, int | float]:
        """Validate user parameters (not merged with the defaults); return them typed."""
        if not isinstance(params, dict):
            raise ConfigError(f"scenario parameters must be a mapping, got {type(params).__name__}")
        out: dict[str, int | float] = {}
        for key, value in params.items():
            if key not in cls.defaults:
                accepted = sorted(cls.defaults)
                close = difflib.get_close_matches(str(key), accepted, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                takes = f"it takes: {', '.join(accepted)}" if accepted else "it takes none"
                raise ConfigError(
                    f"scenario '{cls.name}' has no parameter '{key}'; {hint}({takes})"
                )
            out[key] = _typed(cls.name, key, value, cls.defaults[key])
        cls.validate({**cls.defaults, **out})
        return out

    @classmethod
    def validate(cls, params: dict[str, int | float]) -> None:
        """Check ranges of the merged parameters; raise ConfigError. Default: all positive."""
        for key, value in params.items():
            if not value > 0:
                raise ConfigError(
                    f"scenario '{cls.name}' parameter '{key}' must be > 0, got {value!r}"
                )

    def lr_factor(self, step: int) -> float:
        """Multiplier of the spec's learning rate at ``step``."""
        return 1.0

    def loss_weight(self, step: int) -> float:
        """Weight on the objective at ``step`` (the scaler sees ``weight * objective``)."""
        return 1.0

    def objective(
        self, data: BatchStream, model: torch.nn.Module, batch: Any, step: int, micro: int
    ) -> torch.Tensor:
        """The unweighted training loss of one micro-batch (a scalar tensor)."""
        return data.loss(model, batch)

    def eval_objective(self, data: BatchStream, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The loss measured on held-out batches, without injected failures or weights."""
        return data.loss(model, batch)

    def state_dict(self) -> dict[str, Any]:
        """Mutable state for snapshots; the built-in scenarios are stateless (functions of step)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params.items())})"


def _typed(scenario: str, key: str, value: Any, default: int | float) -> int | float:
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(default, int):
            as_float = float(value)
            if as_float != int(as_float):
                raise ValueError
            return int(as_float)
        out = float(value)
        if not math.isfinite(out):
            raise ValueError
        return out
    except (TypeError, ValueError, OverflowError):
        kind = "an integer" if isinstance(default, int) else "a finite number"
        raise ConfigError(
            f"scenario '{scenario}' parameter '{key}' must be {kind}, got {value!r}"
        ) from None


def register_scenario(name: str) -> Callable[[type[Scenario]], type[Scenario]]:
    """Class decorator registering a :class:`Scenario` subclass under ``name``."""

    def decorator(cls: type[Scenario]) -> type[Scenario]:
        if not (isinstance(cls, type) and issubclass(cls, Scenario)):
            raise TypeError(f"register_scenario('{name}') expects a Scenario subclass, got {cls!r}")
        cls.name = name
        _SCENARIOS[name] = cls
        return cls

    return decorator


def unregister_scenario(name: str) -> None:
    """Remove the scenario registered as ``name`` (a plugin's, or a test's); UnknownNameError if
    none is."""
    scenario_class(name)
    del _SCENARIOS[name]


def scenario_class(name: str) -> type[Scenario]:
    """The scenario class registered as ``name``; UnknownNameError (with did-you-mean) if none."""
    if name not in _SCENARIOS:
        raise unknown_name("scenario", str(name), _SCENARIOS, "autoscale run --help")
    return _SCENARIOS[name]


def make_scenario(name: str, params: dict[str, Any] | None = None, seed: int = 0) -> Scenario:
    """Build the scenario ``name`` with ``params``."""
    return scenario_class(name)(seed, **(params or {}))


def list_scenarios() -> list[str]:
    """Names of every registered scenario."""
    return list(_SCENARIOS)


@register_scenario("clean")
class Clean(Scenario):
    """Plain training on real data: the baseline every rule should get through without skips.

    Optionally with the usual learning-rate schedule of a real run: a linear warm-up over
    ``warmup`` steps, then a cosine decay to ``floor`` times the base rate over ``decay`` steps
    (``0`` turns either off). The long clean runs of the no-harm check use it.

    Parameters: ``warmup`` (int, 0), ``decay`` (int, 0), ``floor`` (float, 0.1).
    """

    description = "plain training on real data (the baseline); optional warm-up + cosine lr"
    defaults = {"warmup": 0, "decay": 0, "floor": 0.1}

    @classmethod
    def validate(cls, params):
        if params["warmup"] < 0 or params["decay"] < 0 or not 0 <= params["floor"] <= 1:
            raise ConfigError(
                f"scenario 'clean' needs warmup >= 0, decay >= 0 and 0 <= floor <= 1; got "
                f"{params['warmup']}, {params['decay']}, {params['floor']}"
            )

    def lr_factor(self, step: int) -> float:
        warmup, decay, floor = self.params["warmup"], self.params["decay"], self.params["floor"]
        if warmup and step < warmup:
            return (step + 1) / warmup
        if not decay:
            return 1.0
        t = min(1.0, (step - warmup) / decay)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


@register_scenario("bad-batches")
class BadBatches(Scenario):
    """A scale-independent non-finite loss every ``every`` steps.

    Reproduces: a corrupted or outlier batch whose forward pass overflows (an fp16 activation or
    attention logit beyond 65504) yields an infinite loss, so the step fails at *any* scale, in
    any dtype. Classic rules read every overflow as "scale too high" and halve; with one such batch
    every K steps and growth only after 2000 clean steps, the scale ratchets down one bit per K
    steps until it sits at the minimum (DeepSpeed aborts there: "Current loss scale already at
    minimum"), and the clean steps in between train at a scale far too low.

    The forward's result is modelled exactly: the batch's loss is multiplied by ``inf`` (keeping
    its graph), on the first micro-batch of steps ``every-1, 2*every-1, ...``.

    Parameters: ``every`` (int, default 10).
    """

    description = "inf loss (fails at any scale) every K steps: rules ratchet the scale down"
    defaults = {"every": 10}

    def is_bad(self, step: int) -> bool:
        """Whether ``step`` gets the corrupted batch."""
        return step % self.params["every"] == self.params["every"] - 1

    def objective(self, data, model, batch, step, micro):
        loss = data.loss(model, batch)
        return loss * math.inf if micro == 0 and self.is_bad(step) else loss


@register_scenario("small-grads")
class SmallGrads(Scenario):
    """The loss is multiplied by a tiny ``weight``, so gradients are tiny too.

    Reproduces: heavily down-weighted losses (auxiliary or distillation terms, a loss averaged
    over very many tokens, late-training gradients): at the scale the torch rule starts from
    (2^16), many scaled gradient elements fall below fp16's normal minimum 2^-14 and lose
    precision or flush to zero, and the rule only grows the scale by one bit per 2000 clean steps.
    A good rule raises the scale until the gradients sit near the top of fp16's range. AdamW is
    invariant to the weight, so the task itself is unchanged: only precision suffers.

    Parameters: ``weight`` (float, default 1e-5).
    """

    description = "loss x1e-5: scaled gradients fall into fp16's subnormal range (precision loss)"
    defaults = {"weight": 1e-5}

    def loss_weight(self, step: int) -> float:
        return self.params["weight"]


@register_scenario("moving")
class Moving(Scenario):
    """A transient spike in gradient magnitude, optionally after an LR warmup to a high peak.

    Reproduces: the optimum scale moves and comes back (a loss weight that rises then decays, a
    schedule change, a warmup into an unstable phase). The loss weight follows
    ``peak ** max(0, 1 - |step - at| / width)``: it rises geometrically to ``peak`` at step ``at``
    and decays back to 1 over ``width`` steps each way. The torch rule backs off by about
    log2(peak) bits during the spike, then regrows one doubling per 2000 clean steps, so it trains
    far below the optimum for a long time afterwards. The learning rate is
    ``lr_peak * min(1, (step + 1) / warmup)`` times the spec's (``warmup=0``: no warmup).

    Parameters: ``at`` (int, 20), ``width`` (int, 10), ``peak`` (float, 4096), ``warmup`` (int,
    0), ``lr_peak`` (float, 1.0), ``period`` (int, 0: a spike every ``period`` steps, the first at
    ``at``, for runs long enough to see several; 0 = one spike).
    """

    description = "loss weight spikes x4096 and decays back: slow regrowth after the spike"
    defaults = {"at": 20, "width": 10, "peak": 4096.0, "warmup": 0, "lr_peak": 1.0, "period": 0}

    @classmethod
    def validate(cls, params):
        if params["at"] < 0 or params["warmup"] < 0 or params["period"] < 0:
            raise ConfigError(
                f"scenario 'moving' needs at, warmup and period >= 0, got {params['at']}, "
                f"{params['warmup']}, {params['period']}"
            )
        if params["period"] and params["period"] < 2 * params["width"]:
            raise ConfigError(
                f"scenario 'moving' needs period >= 2 * width (spikes must not overlap), got "
                f"period {params['period']}, width {params['width']}"
            )
        if params["width"] < 1 or params["peak"] < 1 or params["lr_peak"] <= 0:
            raise ConfigError(
                f"scenario 'moving' needs width >= 1, peak >= 1, lr_peak > 0; got "
                f"{params['width']}, {params['peak']}, {params['lr_peak']}"
            )

    def loss_weight(self, step: int) -> float:
        p = self.params
        distance = abs(step - p["at"])
        if p["period"] and step > p["at"]:  # the nearest spike: at, at + period, ...
            off = (step - p["at"]) % p["period"]
            distance = min(off, p["period"] - off)
        return float(p["peak"] ** max(0.0, 1.0 - distance / p["width"]))

    def lr_factor(self, step: int) -> float:
        warmup = self.params["warmup"]
        ramp = min(1.0, (step + 1) / warmup) if warmup else 1.0
        return self.params["lr_peak"] * ramp


@register_scenario("preference")
class Preference(Scenario):
    """A DPO-style preference loss with a large ``beta``: ``-log sigmoid(beta * margin)``.

    Reproduces: preference fine-tuning (DPO, reward-model training). The margin is the mean
    per-token (per-example for ``mlp``) log-probability of the real sequence minus that of a
    dispreferred one (the same window reversed; for ``mlp`` the same input with a wrong label).
    Gradients are ``beta * sigmoid(-beta * margin)`` times a log-prob difference: large while
    the margin is wrong, vanishing once it saturates, so their magnitude swings by orders of
    magnitude from batch to batch: occasional overflows, then long stretches of tiny gradients.
    The held-out loss is the same preference loss.

    Parameters: ``beta`` (float, default 50).
    """

    description = "DPO-style -logsigmoid(beta*margin), beta=50: spiky gradients, overflows"
    defaults = {"beta": 50.0}

    def objective(self, data, model, batch, step, micro):
        return self.eval_objective(data, model, batch)

    def eval_objective(self, data, model, batch):
        import torch.nn.functional as F

        chosen, rejected = data.preference_logprobs(model, batch)
        return -F.logsigmoid(self.params["beta"] * (chosen - rejected)).mean()


@register_scenario("drift")
class Drift(Clean):
    """Gradients that drift down by orders of magnitude over a run, then up past fp16's range.

    Reproduces: what a whole run does to the gradients' size: a loss that converges shrinks
    them; a schedule, a curriculum or a loss term switched on late grows them again. The loss
    weight follows ``2**bits(step)`` with ``bits`` falling linearly from 0 to ``-down`` over the
    first half of ``length`` steps, then rising linearly to ``+up`` at ``length`` (and staying
    there). A rule that cannot adapt shows its harm here: a fixed scale loses the small gradients
    to underflow in the first half and overflows on every step of the last stretch; the torch rule
    follows down (halving) but regrows one bit per 2000 clean steps. It keeps :class:`Clean`'s
    optional warm-up and cosine decay, so the no-harm check's long runs can use it. AdamW is
    nearly invariant to the weight, so the task itself is unchanged.

    Parameters: ``down`` (float, 20: bits), ``up`` (float, 8: bits), ``length`` (int, 1000),
    and :class:`Clean`'s ``warmup``, ``decay``, ``floor``.
    """

    description = "loss weight drifts 2^-20 down then 2^8 up over the run: fixed scales lose"
    defaults = {**Clean.defaults, "down": 20.0, "up": 8.0, "length": 1000}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        if params["down"] < 0 or params["up"] < 0 or params["length"] < 2:
            raise ConfigError(
                f"scenario 'drift' needs down >= 0, up >= 0 and length >= 2; got "
                f"{params['down']}, {params['up']}, {params['length']}"
            )

    def bits(self, step: int) -> float:
        """log2 of the loss weight at ``step``."""
        p = self.params
        half = p["length"] / 2
        t = min(float(step), float(p["length"]))
        if t <= half:
            return -p["down"] * t / half
        return -p["down"] + (p["down"] + p["up"]) * (t - half) / half

    def loss_weight(self, step: int) -> float:
        return 2.0 ** self.bits(step)


@register_scenario("token-sum")
class TokenSum(Scenario):
    """A loss summed over a batch's items, whose number changes from step to step.

    Reproduces: a loss reduced by sum instead of mean over a batch whose size varies (tokens of
    packed or variable-length sequences, examples of a dynamic batch, a loss normalised late or
    never): the gradient's size follows the step's count, which swings by orders of magnitude
    from one step to the next. The loss weight is that count, drawn log-uniformly in
    [``low``, ``high``] for each step (a function of the seed and the step alone). A scale that
    suits the small steps overflows on the large ones; one that suits the large ones loses the
    small steps' gradients to underflow. Unlike ``bad-batches``, every overflow here is the
    scale's doing (a lower scale passes it); unlike ``moving`` and ``drift``, the last step's size
    says nothing of the next one's.

    Parameters: ``low`` (float, 16), ``high`` (float, 16384): the fewest and most items a step
    sums over.
    """

    description = "loss summed over 16..16384 items, a new count every step: sizes swing 10 bits"
    defaults = {"low": 16.0, "high": 16384.0}

    @classmethod
    def validate(cls, params):
        if not 0 < params["low"] <= params["high"]:
            raise ConfigError(
                f"scenario 'token-sum' needs 0 < low <= high, got low {params['low']}, "
                f"high {params['high']}"
            )

    def loss_weight(self, step: int) -> float:
        u = random.Random(self.seed * 1_000_003 + step).random()
        low, high = self.params["low"], self.params["high"]
        return float(low * (high / low) ** u)
