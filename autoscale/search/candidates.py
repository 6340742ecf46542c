"""What a search compares: a built-in rule, a shipped policy or a trial of the study, as one type.

A :class:`Candidate` is the string the study stores it under (``"rule:torch"``, ``"policy:auto"``,
``"trial:12"``), its parts read here and nowhere else. :data:`TORCH` is the reference,
:data:`AUTO` the bar.
"""

from __future__ import annotations

__all__ = ["AUTO", "TORCH", "Candidate"]

_KINDS = ("rule", "policy", "trial")


class Candidate(str):
    """``"rule:NAME"``, ``"policy:NAME"`` or ``"trial:NUMBER"``; build one with :meth:`rule`,
    :meth:`policy`, :meth:`trial` or :meth:`parse` (which refuses anything else)."""

    __slots__ = ()

    @classmethod
    def rule(cls, name: str) -> Candidate:
        return cls(f"rule:{name}")

    @classmethod
    def policy(cls, name: str) -> Candidate:
        return cls(f"policy:{name}")

    @classmethod
    def trial(cls, number: int) -> Candidate:
        return cls(f"trial:{int(number)}")

    @classmethod
    def parse(cls, key: str) -> Candidate:
        """``key`` as a candidate; ValueError unless it is one of the three forms."""
        kind, sep, rest = str(key).partition(":")
        if not sep or kind not in _KINDS or not rest or (kind == "trial" and not rest.isdigit()):
            raise ValueError(f"not a candidate: {key!r} (rule:NAME, policy:NAME or trial:NUMBER)")
        return cls(key)

    @property
    def kind(self) -> str:
        return self.partition(":")[0]

    @property
    def is_rule(self) -> bool:
        return self.startswith("rule:")

    @property
    def is_policy(self) -> bool:
        return self.startswith("policy:")

    @property
    def is_named(self) -> bool:
        """A scaler built by its name (a built-in rule or a shipped policy), not a trial."""
        return not self.is_trial

    @property
    def is_trial(self) -> bool:
        return self.startswith("trial:")

    @property
    def name(self) -> str:
        """The rule's or policy's name, or the trial's number as text."""
        return self.partition(":")[2]

    @property
    def number(self) -> int:
        """The trial's number (ValueError for a rule)."""
        if not self.is_trial:
            raise ValueError(f"{self} is not a trial")
        return int(self.name)


TORCH = Candidate.rule("torch")
AUTO = Candidate.policy("auto")
