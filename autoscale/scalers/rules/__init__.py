"""The built-in loss-scale rules, each with its published defaults and where it comes from: the
counter rules (:mod:`.counter`) and the amax rules (:mod:`.amax`).

Every rule is a pure :class:`~autoscale.scalers.controller.ScaleRule`: hyperparameters in ``__init__``,
the decision in ``next_scale``, counters in ``state``. The counters reproduce the original code
paths step for step (tests hold them to hand-computed sequences and to the upstream code itself),
including their quirks, since learned policies are measured against them.
"""

from __future__ import annotations

from autoscale.scalers.controller import ScaleRule
from autoscale.scalers.rules.amax import HALF_BIT, AmaxCapRule, AmaxHistoryRule, AmaxLossRule
from autoscale.scalers.rules.counter import (
    DeepSpeedRule,
    FairseqRule,
    JmpRule,
    MegatronRule,
    MetaseqRule,
    StaticRule,
    TorchRule,
)

__all__ = [
    "StaticRule",
    "TorchRule",
    "DeepSpeedRule",
    "MegatronRule",
    "JmpRule",
    "FairseqRule",
    "MetaseqRule",
    "AmaxHistoryRule",
    "AmaxCapRule",
    "AmaxLossRule",
    "BUILTIN_RULES",
    "HALF_BIT",
]

# the built-in rules by the name each is registered under (autoscale/scalers/registry.py)
BUILTIN_RULES: dict[str, type[ScaleRule]] = {
    "static": StaticRule,
    "torch": TorchRule,
    "deepspeed": DeepSpeedRule,
    "megatron": MegatronRule,
    "jmp": JmpRule,
    "fairseq": FairseqRule,
    "metaseq": MetaseqRule,
    "amax-history": AmaxHistoryRule,
    "amax-cap": AmaxCapRule,
    "amax-loss": AmaxLossRule,
}
for _name, _cls in BUILTIN_RULES.items():  # the name get_scaler knows each by
    _cls.name = _name
