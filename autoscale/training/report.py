"""Human-facing output of runs: scorecard tables, trajectories and plots (matplotlib, Agg).

matplotlib is imported only when a plot is drawn, and through ``matplotlib.figure.Figure``, so
no global backend is switched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError
from autoscale.training.records import StepRecord
from autoscale.training.scorecard import Scorecard

__all__ = [
    "format_scale",
    "format_scorecard",
    "format_comparison",
    "trajectory",
    "plot_run",
    "plot_comparison",
    "COMPARE_COLUMNS",
    "REPLAY_COLUMNS",
]

# (scorecard field, column title) of the comparison table, in order.
COMPARE_COLUMNS = (
    ("skip_rate", "skip rate"),
    ("precision_loss", "prec. loss"),
    ("final_loss", "final loss"),
    ("eval_loss", "eval loss"),
    ("min_scale", "min scale"),
    ("max_scale", "max scale"),
    ("hit_min", "hit min"),
    ("diverged", "diverged"),
    ("useful_steps_per_s", "useful steps/s"),
)
# what a replay of recorded steps measures: not the loss (it is the recorded one whatever the
# scale did), nor divergence or speed
REPLAY_COLUMNS = (
    ("skip_rate", "skip rate"),
    ("precision_loss", "prec. loss"),
    ("min_scale", "min scale"),
    ("max_scale", "max scale"),
    ("hit_min", "hit min"),
)


def format_scale(value: float) -> str:
    """A loss scale as ``2^k`` (``2^12.3`` when not a power of two)."""
    if not (value > 0 and math.isfinite(value)):
        return str(value)
    k = math.log2(value)
    return f"2^{round(k)}" if abs(k - round(k)) < 1e-9 else f"2^{k:.1f}"


def _fmt(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if name.endswith("_scale"):
        return format_scale(float(value))
    if name in ("skip_rate", "precision_loss"):
        return f"{100 * value:.2f}%" if math.isfinite(value) else "n/a"
    if isinstance(value, float):
        return (
            f"{value:.4g}" if math.isfinite(value) else ("n/a" if math.isnan(value) else str(value))
        )
    return str(value)


def format_scorecard(card: Scorecard, title: str | None = None) -> str:
    """A two-column table of the scorecard."""
    rows = [
        ("steps", str(card.steps)),
        ("skipped", f"{card.skipped} ({_fmt('skip_rate', card.skip_rate)})"),
        ("precision loss", _fmt("precision_loss", card.precision_loss)),
        ("final train loss", _fmt("final_loss", card.final_loss)),
        ("eval loss", _fmt("eval_loss", card.eval_loss)),
        ("scale range", f"{format_scale(card.min_scale)} .. {format_scale(card.max_scale)}"),
        ("hit minimum scale", _fmt("hit_min", card.hit_min)),
        ("diverged", _fmt("diverged", card.diverged)),
        ("wall time", f"{card.wall_s:.2f} s"),
        ("useful steps/s", _fmt("useful_steps_per_s", card.useful_steps_per_s)),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [title] if title else []
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def format_comparison(
    summaries: Mapping[str, Mapping[str, Mapping[str, float]]],
    seeds: int,
    columns: Sequence[tuple[str, str]] = COMPARE_COLUMNS,
) -> str:
    """A table with one row per rule: ``mean ± std`` over seeds (``mean`` alone with one seed).

    Args:
        summaries: rule name -> :func:`~autoscale.training.summarize` output.
        seeds: Number of seeds behind each row (shown in the header).
        columns: (scorecard field, title) of the columns.
    """
    header = ["rule"] + [title for _, title in columns]
    rows = []
    for name, summary in summaries.items():
        row = [name]
        for field, _ in columns:
            s = summary[field]
            if field in ("hit_min", "diverged"):
                row.append(
                    f"{round(s['mean'] * seeds)}/{seeds}" if math.isfinite(s["mean"]) else "n/a"
                )
                continue
            cell = _fmt(field, s["mean"])
            if seeds > 1 and math.isfinite(s["std"]) and s["std"] > 0:
                spread = (
                    f"{100 * s['std']:.2f}%"
                    if field in ("skip_rate", "precision_loss")
                    else f"{s['std']:.2g}"
                )
                cell += f" ± {spread}" if not field.endswith("_scale") else ""
            row.append(cell)
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def trajectory(records: Sequence[StepRecord]) -> dict[str, list]:
    """Per-step scale, skip flag, loss and precision loss, for JSON output."""
    return {
        "scale": [r.scale for r in records],
        "found_inf": [r.found_inf for r in records],
        "loss": [r.loss for r in records],
        "precision_loss": [r.precision_loss for r in records],
    }


def _figure(title: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6), constrained_layout=True)
    ax_scale, ax_loss = fig.subplots(2, 1, sharex=True)
    ax_scale.set_ylabel("log2(loss scale)")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_xlabel("step")
    ax_scale.set_title(title)
    return fig, ax_scale, ax_loss


def _save(fig, path: str | Path) -> None:
    try:
        fig.savefig(Path(path), format="png", dpi=100)
    except OSError as exc:
        raise ConfigError(f"cannot write plot '{path}': {exc.strerror or exc}") from exc


def _draw(
    ax_scale,
    ax_loss,
    records: Sequence[StepRecord],
    label: str | None,
    color: Any,
    alpha: float = 1.0,
) -> None:
    steps = [r.step for r in records]
    ax_scale.step(
        steps,
        [math.log2(r.scale) for r in records],
        where="post",
        color=color,
        alpha=alpha,
        label=label,
    )
    skips = [r for r in records if r.found_inf]
    if skips:
        ax_scale.scatter(
            [r.step for r in skips],
            [math.log2(r.scale) for r in skips],
            marker="x",
            color=color,
            alpha=alpha,
            s=18,
        )
    finite = [r for r in records if math.isfinite(r.loss)]
    ax_loss.plot([r.step for r in finite], [r.loss for r in finite], color=color, alpha=alpha, lw=1)


def plot_run(records: Sequence[StepRecord], path: str | Path, title: str = "") -> None:
    """PNG: log2 scale per step with skipped steps marked ``x``, and the training loss."""
    fig, ax_scale, ax_loss = _figure(title or "loss scale (x = skipped step)")
    _draw(ax_scale, ax_loss, records, None, "C0")
    _save(fig, path)


def plot_comparison(
    runs: Mapping[str, Sequence[Sequence[StepRecord]]], path: str | Path, title: str = ""
) -> None:
    """PNG: scale and loss trajectories per rule; the first seed solid, other seeds faint."""
    fig, ax_scale, ax_loss = _figure(title or "loss scale per rule (x = skipped step)")
    for i, (name, seeds) in enumerate(runs.items()):
        for j, records in enumerate(seeds):
            _draw(
                ax_scale,
                ax_loss,
                records,
                name if j == 0 else None,
                f"C{i % 10}",
                1.0 if j == 0 else 0.3,
            )
    ax_scale.legend(loc="best", fontsize="small")
    _save(fig, path)
