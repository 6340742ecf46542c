"""Validation on real steps of every member's test instances (:class:`Validator`), shared by
every worker of a study: a scaler's episodes are stored in the study under ``real:SCALER`` at
least every :data:`FLUSH_S` seconds, so no stored episode is run again. A scaler starts only where
all its remaining episodes fit before the deadline, so every validated scaler has the full test set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autoscale.envs.suite import SuiteSpec
from autoscale.search.budget import Ledger
from autoscale.search.candidates import Candidate
from autoscale.search.objective import objective
from autoscale.search.timing import MARGIN, Timings
from autoscale.training.scorecard import Scorecard, json_safe

__all__ = [
    "Validated",
    "Validator",
    "ReplayValidator",
    "keep_cards",
    "real_cards",
    "by_member",
    "PREFIX",
]

PREFIX = "real:"
FLUSH_S = 5.0


def real_cards(attrs: dict[str, Any], scaler: str, names: Sequence[str]) -> dict[str, Scorecard]:
    """The stored real-step scorecards of ``scaler`` among the episodes ``names``."""
    stored = (attrs.get(PREFIX + scaler) or {}).get("cards", {})
    return {n: Scorecard.from_dict(stored[n]) for n in names if n in stored}


def keep_cards(
    study: Any,
    key: str,
    cards: dict[str, Scorecard],
    *,
    worker: str,
    ledger: Ledger,
    on: str | None = None,
) -> None:
    """Keep ``key``'s scorecards by episode name in the study under ``real:KEY``."""
    value: dict[str, Any] = {"cards": {n: c.to_dict() for n, c in cards.items()}, "worker": worker}
    if on is not None:
        value["on"] = on
    with ledger.track("bk:attrs"):
        study.set_user_attr(PREFIX + key, json_safe(value))


def by_member(cards: dict[str, Scorecard], names: Sequence[str]) -> dict[str, list[Scorecard]]:
    """``MEMBER:INSTANCE`` -> card, as member -> cards in the order of ``names``."""
    from autoscale.envs.suite_env import split_instance

    out: dict[str, list[Scorecard]] = {}
    for n in names:
        out.setdefault(split_instance(n)[0], []).append(cards[n])
    return out


@dataclass
class Validated:
    """A scaler scored on every test episode of every member.

    Attributes:
        key: ``rule:NAME``, ``policy:NAME`` or ``trial:NUMBER``.
        label: Row name in tables.
        cards: Member -> one scorecard per test instance, in the suite's order.
        real: Real steps (False: replay of the recorded real test steps).
        records: Step records of this worker's episode on the first test instance, if it ran it.
    """

    key: Candidate
    label: str
    cards: dict[str, list[Scorecard]]
    real: bool = True
    records: list | None = None

    def objective(self, reference: Validated, weights: Any) -> float:
        """The objective against ``reference`` (``torch``'s validation) on the same episodes."""
        return objective(self.cards, reference.cards, weights)

    def all_cards(self) -> list[Scorecard]:
        return [c for cs in self.cards.values() for c in cs]


class Validator:
    """Runs scalers on real steps of the test episodes of a suite, within a deadline.

    Args:
        validation: The plan's validation suite (its members' test instances are run).
        timings: Measured costs, refined by every episode run here.
    """

    def __init__(
        self,
        study: Any,
        validation: SuiteSpec,
        ledger: Ledger,
        timings: Timings,
        *,
        worker: str,
        progress: bool = False,
    ) -> None:
        from autoscale.envs.suite_env import SuiteEnv

        self.study, self.validation, self.ledger, self.worker = study, validation, ledger, worker
        self.progress = progress
        self.env = SuiteEnv(validation, "test")
        self.names = list(self.env.instance_names)
        self.timings = timings
        steps = validation.episode.steps
        self.episode_s: dict[str, float] = {}
        self.setup_s: dict[str, float] = {}
        for name, (member, inst) in zip(self.names, self.env.pairs):
            t = timings.of(validation.member(member).workload)
            self.episode_s[name] = steps * t.step_s + t.eval_s
            self.setup_s[name] = t.build_s + inst.start * t.step_s
        self.prepared: set[str] = set()
        self.skipped: list[str] = []

    def _cost(self, todo: list[str]) -> float:
        """Estimated seconds of ``todo`` episodes, with a :data:`MARGIN` for noisy step times."""
        return MARGIN * sum(
            self.episode_s[n] + (0.0 if n in self.prepared else self.setup_s[n]) for n in todo
        )

    def cost(self, scalers: int) -> float:
        """Estimated seconds to validate ``scalers`` more scalers on every episode."""
        return self._cost(list(self.names)) + (scalers - 1) * MARGIN * sum(self.episode_s.values())

    def run(
        self,
        scalers: Sequence[tuple[str, str, Callable[[], Any]]],
        stop_at: float,
        on_done: Callable[[Validated], None] | None = None,
    ) -> dict[str, Validated]:
        """Validate ``(key, label, factory)`` scalers in order, skipping (into :attr:`skipped`)
        those that do not fit; ``on_done`` is called for each this call ran episodes of."""
        with self.ledger.track("bk:attrs"):
            attrs = self.study.user_attrs
        have = {key: real_cards(attrs, key, self.names) for key, _, _ in scalers}
        todo_all = {key: [n for n in self.names if n not in have[key]] for key, _, _ in scalers}
        bar = None
        if self.progress:
            from autoscale.progress import progress_bar

            bar = progress_bar(sum(map(len, todo_all.values())), desc="validate", unit="episode")
        out: dict[str, Validated] = {}
        try:
            for key, label, factory in scalers:
                todo, cards = todo_all[key], have[key]
                if todo and time.monotonic() + self._cost(todo) > stop_at:
                    self.skipped.append(label)
                    if bar is not None:
                        bar.total -= len(todo)
                        bar.refresh()
                    continue
                records, flushed = None, time.monotonic()
                for i, name in enumerate(todo):
                    cards[name], recs = self._episode(factory, name)
                    records = recs if name == self.names[0] else records
                    if i + 1 == len(todo) or time.monotonic() - flushed > FLUSH_S:
                        keep_cards(self.study, key, cards, worker=self.worker, ledger=self.ledger)
                        flushed = time.monotonic()
                    if bar is not None:
                        bar.update(1)
                out[key] = Validated(key, label, by_member(cards, self.names), True, records)
                if on_done is not None and todo:
                    on_done(out[key])
        finally:
            if bar is not None:
                bar.close()
        return out

    def _episode(self, factory: Callable[[], Any], name: str):
        from autoscale.envs.episodes import drive_episode
        from autoscale.envs.suite_env import split_instance

        with self.ledger.track("work:validate"):
            if name not in self.prepared:
                member, inst = split_instance(name)
                env = self.env.envs[member]
                (spec,) = env.env_spec.instance_set([inst])
                env.prepare(spec)
                self.prepared.add(name)
            t0 = time.monotonic()
            result = drive_episode(self.env, factory(), name)
            self.episode_s[name] = 0.5 * self.episode_s[name] + 0.5 * (time.monotonic() - t0)
        return result


class ReplayValidator:
    """:class:`Validator`'s interface on the replay of a bench's test episodes (a search on
    records); rows are kept in the study marked ``on: replay``.

    Args:
        bench: The :class:`~autoscale.search.bench.ReplayBench` whose test episodes are replayed.
        run_s: Seconds of one scaler's replay of them, until one is measured.
    """

    def __init__(
        self, bench: Any, study: Any, ledger: Ledger, *, worker: str, run_s: float = 0.0
    ) -> None:
        from autoscale.envs.suite_env import suite_instances

        self.bench, self.study, self.ledger, self.worker = bench, study, ledger, worker
        self.names = list(suite_instances(bench.suite, "test"))
        self.run_s = run_s
        self.skipped: list[str] = []  # none: every scaler is replayed

    def cost(self, scalers: int) -> float:
        """Estimated seconds to replay ``scalers`` scalers on every test episode."""
        return scalers * self.run_s

    def run(
        self,
        scalers: Sequence[tuple[str, str, Callable[[], Any]]],
        stop_at: float,
        on_done: Callable[[Validated], None] | None = None,
    ) -> dict[str, Validated]:
        """Replay ``(key, label, factory)`` scalers in order (rows the study holds are read back);
        ``stop_at`` is ignored: replay takes a fraction of a second and the search planned it."""
        with self.ledger.track("bk:attrs"):
            attrs = self.study.user_attrs
        out: dict[str, Validated] = {}
        for key, label, factory in scalers:
            stored = real_cards(attrs, key, self.names)
            if len(stored) == len(self.names):
                out[key] = Validated(key, label, by_member(stored, self.names), False, None)
                continue
            t0 = time.perf_counter()
            with self.ledger.track("work:validate"):
                cards = self.bench.run("test", factory)[0]
            self.run_s = time.perf_counter() - t0
            flat = [c for m in self.bench.suite.members for c in cards[m.name]]
            named = dict(zip(self.names, flat, strict=True))
            keep_cards(self.study, key, named, worker=self.worker, ledger=self.ledger, on="replay")
            out[key] = Validated(key, label, by_member(named, self.names), False, None)
            if on_done is not None:
                on_done(out[key])
        return out
