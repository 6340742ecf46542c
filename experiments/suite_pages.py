"""Markdown tables, plots and README blocks of suite results (experiments/reproduce.py and
experiments/build_auto.py); the judging itself is :mod:`autoscale.selection.suite_eval`."""

from __future__ import annotations

import math
from pathlib import Path

from autoscale.selection.suite_eval import regrets_of
from autoscale.training.bar import mean


def plot_long_runs(runs: dict[str, dict[str, list]], path: Path, title: str) -> None:
    """One panel per member: log2 scale per step of each scaler; x marks skipped steps."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 2.8 * len(runs)), constrained_layout=True)
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, (member, by_scaler) in zip(axes, runs.items()):
        for i, (scaler, run) in enumerate(by_scaler.items()):
            records = run["records"]
            xs = [r.step for r in records]
            ys = [math.log2(r.scale) for r in records]
            skipped = sum(r.found_inf for r in records)
            ax.plot(xs, ys, color=f"C{i}", lw=1.2, label=f"{scaler} ({skipped} skipped)")
            sx = [r.step for r in records if r.found_inf]
            sy = [math.log2(r.scale) for r in records if r.found_inf]
            ax.scatter(sx, sy, color=f"C{i}", marker="x", s=12)
        ax.set_title(member, fontsize=10, loc="left")
        ax.set_ylabel("log2 scale")
        ax.legend(fontsize=8, loc="best")
    axes[-1].set_xlabel("step")
    fig.suptitle(title)
    fig.savefig(path, dpi=90)


def table(cards, members: list[str], left_out, weights, scalers: list[str]) -> list[str]:
    """Markdown: per member and scaler, skip rate, precision loss, eval loss and regret;
    ``left_out``: members tagged "left out", or member -> its tag (a build's split: "validation",
    "test")."""
    regrets = regrets_of(cards, weights)
    lines = [
        "| member | scaler | skip rate | precision loss | eval loss | regret vs torch |",
        "|---|---|---|---|---|---|",
    ]
    for m in members:
        kind = left_out.get(m) if isinstance(left_out, dict) else "left out"
        tag = f" ({kind})" if m in left_out else ""
        for s in scalers:
            c = cards[s][m]
            lines.append(
                f"| {m}{tag} | {s} | {100 * mean(c, 'skip_rate'):.2f}% | "
                f"{100 * mean(c, 'precision_loss'):.3f}% | {mean(c, 'eval_loss'):.4g} | "
                f"{regrets[s][m]:+.4f} |"
            )
    return lines


def write_readme_block(readme: Path, start: str, end: str, block: list[str]) -> bool:
    """Replace what stands between the ``start`` and ``end`` markers of ``readme`` with ``block``;
    False (and nothing written) when the markers are missing."""
    text = readme.read_text()
    if start not in text or end not in text:
        return False
    body = "\n".join([start, "", *block, "", end])
    readme.write_text(text[: text.index(start)] + body + text[text.index(end) + len(end) :])
    return True
