"""The end of a search in words and pictures: the table of the winner against every built-in
rule on real steps of the test instances, and the plot of their trajectories."""

from __future__ import annotations

from pathlib import Path

from autoscale.envs.spec import EnvSpec
from autoscale.search.study import describe_spec
from autoscale.search.validate import Validated

__all__ = ["comparison_rows", "comparison_table", "draw_comparison", "REPLAY_MARK"]

REPLAY_MARK = " (replay)"


def comparison_rows(
    winner: Validated | None, validated: dict[str, Validated]
) -> dict[str, Validated]:
    """Row name -> scores: the winner first, then the rules in order; a rule without real steps
    is marked ``(replay)``."""
    rows = {winner.label: winner} if winner is not None else {}
    for key, v in validated.items():
        if key.startswith("rule:"):
            rows[v.label + ("" if v.real else REPLAY_MARK)] = v
    return rows


def comparison_table(rows: dict[str, Validated], spec: EnvSpec) -> str:
    """:func:`~autoscale.training.report.format_comparison` of the rows, with a heading and the
    objective of each row."""
    from autoscale.training import summarize
    from autoscale.training.report import format_comparison

    n = len(spec.instances["test"])
    table = format_comparison({k: summarize(v.cards) for k, v in rows.items()}, n)
    scores = ", ".join(
        f"{k.split(' (')[0]} {v.objective(spec.reward):.4f}" for k, v in rows.items()
    )
    lines = [
        f"{describe_spec(spec)}: {n} test episodes of {spec.episode.steps} real steps each; mean ± std",
        table,
        f"objective (lower is better): {scores}",
    ]
    if any(not v.real for v in rows.values()):
        lines.append(
            f"{REPLAY_MARK.strip()} = no time for real steps: replay of the recorded real test steps"
        )
    return "\n".join(lines)


def draw_comparison(rows: dict[str, Validated], path: Path, title: str) -> bool:
    """PNG of the trajectories on the first test instance of the rows that have them; whether
    there was anything to draw."""
    from autoscale.training.report import plot_comparison

    runs = {k: [v.records] for k, v in rows.items() if v.records}
    if runs:
        plot_comparison(runs, path, title=title)
    return bool(runs)
