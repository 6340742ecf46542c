"""The end of a search in words and pictures: the ranking of the candidates and every built-in rule
on real steps of the test episodes, a row per member, and the plot of their trajectories."""

from __future__ import annotations

from pathlib import Path

from autoscale.envs.suite import SuiteSpec
from autoscale.progress import draw_bars
from autoscale.search.budget import plural
from autoscale.search.study import describe_spec
from autoscale.search.validate import Validated

__all__ = [
    "comparison_table",
    "member_table",
    "limit_block",
    "draw_comparison",
    "draw_bars",
    "REPLAY_MARK",
]

REPLAY_MARK = " (replay)"


def _label(v: Validated) -> str:
    return v.label + ("" if v.real else REPLAY_MARK)


def comparison_table(
    rows: list[Validated], reference: Validated, validation: SuiteSpec, winner: str | None = None
) -> str:
    """The rows (ranked) over every test episode, ``winner`` (a key) marked with ``*``: real-step
    rows in one table, replayed rows in a second that shows only what replay measures (not the
    loss, which replay keeps as recorded)."""
    from autoscale.training import summarize
    from autoscale.training.report import REPLAY_COLUMNS, format_comparison

    n = sum(len(c) for c in reference.cards.values())
    labels = {v.key: ("* " if v.key == winner else "") + v.label for v in rows}
    weights = validation.reward
    real = [v for v in rows if v.real]
    replayed = [v for v in rows if not v.real]

    def scores(group: list[Validated]) -> str:
        return ", ".join(f"{labels[v.key]} {v.objective(reference, weights):+.4f}" for v in group)

    lines = [
        f"{describe_spec(validation)}: {plural(n, 'test episode')} of "
        f"{validation.episode.steps} real steps; mean ± std over them",
        format_comparison({labels[v.key]: summarize(v.all_cards()) for v in real}, n),
        f"objective vs torch (lower is better; * = exported): {scores(real)}",
    ]
    if replayed:
        table = format_comparison(
            {labels[v.key]: summarize(v.all_cards()) for v in replayed}, n, REPLAY_COLUMNS
        )
        lines += [
            "",
            "no time for real steps: replay of the same recorded test steps (no loss: a replay "
            "keeps the recorded one; not ranked against the rows above)",
            table,
        ]
    return "\n".join(lines)


def member_table(rows: list[Validated], reference: Validated, validation: SuiteSpec) -> str:
    """Regret per member (mean cost minus torch's on its test episodes) of each row."""
    from autoscale.search.objective import regrets

    members = list(reference.cards)
    width = max(len(_label(v)) for v in rows) + 2
    head = f"{'regret vs torch':<{width}}" + "".join(f"{m:>24}" for m in members)
    out = [head, "-" * len(head)]
    for v in rows:
        r = regrets(v.cards, reference.cards, validation.reward)
        out.append(f"{_label(v):<{width}}" + "".join(f"{r[m]:>+24.4f}" for m in members))
    return "\n".join(out)


def limit_block(rows: list[Validated], traces: dict, validation: SuiteSpec) -> list[str]:
    """The test steps' hindsight limit and each real row's share of it (none: not recorded)."""
    import math

    from autoscale.envs.limit import episodes_limit, limit_lines

    steps, limits, unsavable = validation.episode.steps, [], 0
    for m in validation.members:
        names = [i.name for i in m.instances["test"]]
        trace = traces.get(m.name)
        if trace is None or any(n not in trace.instances for n in names):
            return []
        p, lost = episodes_limit(trace, names, steps, m.episode)
        limits += [p] * len(names)
        unsavable += lost
    finite = [p for p in limits if math.isfinite(p)]
    if not finite:
        return []

    def mean_p(v: Validated) -> float:
        values = [c.precision_loss for c in v.all_cards() if math.isfinite(c.precision_loss)]
        return sum(values) / len(values) if values else math.nan

    precision = {v.label: mean_p(v) for v in rows if v.real}
    return limit_lines(precision, sum(finite) / len(finite), unsavable)


def draw_comparison(rows: list[Validated], path: Path, title: str) -> bool:
    """PNG of the rows' trajectories on the first test episode; whether any had one."""
    from autoscale.training.report import plot_comparison

    runs = {_label(v): [v.records] for v in rows if v.records}
    if runs:
        plot_comparison(runs, path, title=title)
    return bool(runs)
