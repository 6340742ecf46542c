"""The replay bench of a search (:class:`ReplayBench`): every member's train and test episodes on
its recorded traces, and ``torch``'s scorecards on the same episodes. An episode is a window of an
instance's trace: its first ``horizon`` steps and, where the trace holds two horizons, its last
(the same run later in training). Replay speed: experiments/results/env_speed.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoscale.envs.suite import SuiteSpec
from autoscale.envs.traces import Trace
from autoscale.search.candidates import TORCH
from autoscale.search.objective import objective
from autoscale.training.scorecard import Scorecard

__all__ = ["Episode", "ReplayBench"]

# fewer episodes than this replay faster scalar (experiments/results/vector_replay_few_lanes.md)
VECTOR_MIN_LANES = 16


@dataclass(frozen=True)
class Episode:
    """One replayed episode: an instance (``MEMBER:INSTANCE``) from step ``offset`` of its trace."""

    member: str
    instance: str
    offset: int = 0

    @property
    def key(self) -> str:
        return f"{self.instance}@{self.offset}"


class ReplayBench:
    """Replay envs over a suite's train and test instances, and ``torch`` on every episode.

    Args:
        suite: The planned suite (episode length = the replay horizon).
        traces: Member name -> its trace (every train and test instance).
    """

    def __init__(self, suite: SuiteSpec, traces: dict[str, Trace]) -> None:
        from autoscale.envs.suite_env import SuiteEnv

        self.suite, self.traces = suite, traces
        self.envs = {which: SuiteEnv(suite, which, traces=traces) for which in ("train", "test")}
        self.episodes = {which: self._episodes(which) for which in self.envs}
        self.reference = {
            which: self.run(which, lambda: self.scaler(TORCH.name))[0] for which in self.envs
        }
        self._windows: dict[str, Any] = {}  # which -> its episodes' ReplayWindows, when needed
        self.vector_min_lanes = VECTOR_MIN_LANES

    def _episodes(self, which: str) -> list[Episode]:
        h = self.suite.episode.steps
        out = []
        env = self.envs[which]
        for name, (member, inst) in zip(env.instance_names, env.pairs):
            steps = self.traces[member].instance(inst.name).steps
            offsets = [0] + ([steps - h] if steps >= 2 * h else [])
            out.extend(Episode(member, name, off) for off in offsets)
        return out

    @property
    def members(self) -> list[str]:
        return [m.name for m in self.suite.members]

    def scaler(self, name: str, **overrides: Any):
        """The scaler ``name`` with the episodes' initial scale and bounds."""
        from autoscale.envs.episodes import scaler_for

        return scaler_for(name, self.suite.members[0], **overrides)

    def episode(self, which: str, factory: Callable[[], Any], ep: Episode):
        """(scorecard, records) of one replayed episode with a fresh scaler."""
        from autoscale.envs.episodes import drive_episode

        return drive_episode(self.envs[which], factory(), ep.instance, ep.offset)

    def member_episodes(self, which: str, member: str) -> list[Episode]:
        return [e for e in self.episodes[which] if e.member == member]

    def run(
        self, which: str, factory: Callable[[], Any], members: list[str] | None = None
    ) -> tuple[dict[str, list[Scorecard]], dict[str, list]]:
        """Member -> scorecards of its episodes (in order), and episode key -> step records."""
        cards: dict[str, list[Scorecard]] = {}
        records: dict[str, list] = {}
        for member in members or self.members:
            cards[member] = []
            for ep in self.member_episodes(which, member):
                card, recs = self.episode(which, factory, ep)
                cards[member].append(card)
                records[ep.key] = recs
        return cards, records

    def vector_cards(
        self, which: str, rule: str, params: dict[str, Any]
    ) -> dict[str, list[Scorecard]] | None:
        """:meth:`run`'s scorecards of ``rule(**params)`` from the vectorised replay (equal to
        the scalar replay's); None where the rule is not vectorised or ``which`` has fewer than
        ``vector_min_lanes`` episodes."""
        from autoscale.envs.vector_replay import VECTOR_RULES, replay_rule, replay_windows

        episodes = self.episodes[which]
        if (
            rule not in VECTOR_RULES
            or params.get("spike_bits")  # (spikes are skipped in the scalar replay only)
            or len(episodes) < self.vector_min_lanes
        ):
            return None
        if which not in self._windows:
            pairs = [(e.instance, e.offset) for e in episodes]
            self._windows[which] = replay_windows(self.envs[which], pairs)
        (row,) = replay_rule(rule, [self.scaler(rule, **params)], self._windows[which])
        cards: dict[str, list[Scorecard]] = {}
        for ep, card in zip(episodes, row, strict=True):
            cards.setdefault(ep.member, []).append(card)
        return cards

    def objective(self, which: str, cards: dict[str, list[Scorecard]]) -> float:
        """The objective of ``cards`` (any members, each one's first episodes) against ``torch``."""
        return objective(cards, self.reference_for(which, cards), self.suite.reward)

    def reference_for(
        self, which: str, cards: dict[str, list[Scorecard]]
    ) -> dict[str, list[Scorecard]]:
        """torch's scorecards on the episodes ``cards`` has (the same members, the first ones)."""
        return {m: self.reference[which][m][: len(c)] for m, c in cards.items()}

    def thresholds(self, ep: Episode) -> list[float]:
        member, inst = ep.instance.split(":", 1)[0], ep.instance.rsplit(":", 1)[1]
        t = self.traces[member].instance(inst)
        return t.threshold[ep.offset : ep.offset + self.suite.episode.steps].tolist()
