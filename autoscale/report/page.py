"""The report page: plots (matplotlib, Agg, embedded as PNG) and tables in one HTML file that
needs no network."""

from __future__ import annotations

import base64
import html
import io
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from autoscale.observe import RunRecord, read_record
from autoscale.report.findings import findings
from autoscale.report.replay import Outcome, RecordReplay

__all__ = ["compare_names", "scale_axis_limits", "write_report"]

MAX_POINTS = 4000  # plotted points per line: long runs are thinned evenly
LOG2_FP16_MAX = math.log2(65504.0)


def compare_names() -> list[str]:
    """Every built-in rule and ``auto`` (when it ships), the counterfactual's rows."""
    from autoscale.scalers import find_policy
    from autoscale.scalers.registry import rule_names

    names = list(rule_names())
    if find_policy("auto") is not None:
        names.append("auto")
    return names


def _thin(n: int) -> np.ndarray:
    return np.arange(n) if n <= MAX_POINTS else np.linspace(0, n - 1, MAX_POINTS).astype(int)


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _figure(height: float = 3.6):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, height))
    return fig, fig.add_subplot(1, 1, 1)


def scale_axis_limits(
    replay: RecordReplay, recorded: Outcome, shown: dict[str, Outcome]
) -> tuple[float, float]:
    """The log2 scales the scale chart spans: every line it draws (the recorded scale and each
    replayed one) and the finite thresholds, 4 bits beyond, within 2^-30 .. 2^60."""
    thr = replay.inst.threshold
    lines = [np.log2(o.scales) for o in (recorded, *shown.values())]
    values = np.concatenate([*lines, thr[np.isfinite(thr)]])
    values = values[np.isfinite(values)]
    return max(float(values.min()) - 4, -30.0), min(float(values.max()) + 4, 60.0)


def _scale_plot(replay: RecordReplay, recorded: Outcome, shown: dict[str, Outcome]) -> str:
    t = replay.inst
    n = t.steps
    x = _thin(n)
    steps = np.arange(n)
    fig, ax = _figure(4.2)
    thr = t.threshold
    ax.fill_between(
        x, thr[x], 60, color="#f4cccc", step="post", lw=0, label="overflow (above threshold)"
    )
    # the scale below which 1% of the step's gradient elements fall under fp16's normal range
    cum = replay.cumulative
    lo = float(replay.trace.hist_edges[0])
    pct = np.full(n, np.nan)
    for i in x:
        row = cum[i]
        if np.isfinite(row).all():
            k = int(np.searchsorted(row, 0.01))
            pct[i] = -14.0 - (lo + max(k - 1, 0))
    ax.fill_between(
        x,
        -30,
        pct[x],
        color="#cfe2f3",
        step="post",
        lw=0,
        label=">1% of gradients underflow (below)",
    )
    ax.step(
        x, np.log2(recorded.scales[x]), where="post", color="black", lw=1.6, label=recorded.name
    )
    colors = ["#e69138", "#6aa84f", "#674ea7"]
    for (name, o), c in zip(shown.items(), colors):
        ax.step(
            x,
            np.log2(o.scales[x]),
            where="post",
            color=c,
            lw=1.0,
            ls="--",
            label=f"{name} (replayed)",
        )
    sk = steps[recorded.skipped]
    nf = sk[t.nonfinite[sk]]
    of = sk[~t.nonfinite[sk]]
    if len(of):
        ax.scatter(
            of,
            np.log2(recorded.scales[of]),
            marker="x",
            color="#cc0000",
            s=28,
            zorder=5,
            label="skipped: gradient overflow",
        )
    if len(nf):
        ax.scatter(
            nf,
            np.log2(recorded.scales[nf]),
            marker="v",
            color="#990000",
            s=30,
            zorder=5,
            label="skipped: non-finite loss",
        )
    ax.set_ylim(*scale_axis_limits(replay, recorded, shown))
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_xlabel("step")
    ax.set_ylabel("log2 loss scale")
    ax.set_title("Loss scale against the gradients' fp16 range")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return _png(fig)


def _underflow_plot(recorded: Outcome, shown: dict[str, Outcome]) -> str:
    n = recorded.steps
    x = _thin(n)
    fig, ax = _figure(3.0)
    own = np.isfinite(recorded.precision)
    xs = np.flatnonzero(own)
    if len(xs) > MAX_POINTS:
        xs = xs[np.linspace(0, len(xs) - 1, MAX_POINTS).astype(int)]
    ax.plot(xs, 100 * recorded.precision[xs], color="black", lw=1.2, label=recorded.name)
    for (name, o), c in zip(shown.items(), ["#e69138", "#6aa84f", "#674ea7"]):
        ax.plot(x, 100 * o.precision[x], color=c, lw=0.9, ls="--", label=f"{name} (replayed)")
    ax.set_xlabel("step")
    ax.set_ylabel("% of gradient elements")
    ax.set_title("Gradient elements below fp16's normal range (2^-14) after scaling")
    ax.set_xlim(0, max(n - 1, 1))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return _png(fig)


def _loss_plot(replay: RecordReplay) -> str | None:
    loss = replay.inst.loss
    ok = np.isfinite(loss)
    if not ok.any():
        return None
    n = len(loss)
    x = _thin(n)
    x = x[ok[x]]
    fig, ax = _figure(2.6)
    ax.plot(x, loss[x], color="#3d85c6", lw=1.0)
    if (loss[ok] > 0).all() and loss[ok].max() / max(loss[ok].min(), 1e-30) > 100:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Training loss (non-finite steps left out)")
    ax.set_xlim(0, max(n - 1, 1))
    ax.grid(alpha=0.3)
    return _png(fig)


def _pct(v: float) -> str:
    return f"{100 * v:.2f}%" if math.isfinite(v) else "n/a"


def _scale(v: float) -> str:
    if not (v > 0 and math.isfinite(v)):
        return str(v)
    k = math.log2(v)
    return f"2^{round(k)}" if abs(k - round(k)) < 1e-9 else f"2^{k:.1f}"


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1150px;margin:24px auto;padding:0 16px;color:#222}
h1{font-size:1.5em;margin-bottom:4px} h2{font-size:1.15em;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;font-size:0.92em} td,th{padding:4px 10px;border-bottom:1px solid #eee;text-align:right}
th{background:#f6f6f6} td:first-child,th:first-child{text-align:left}
.meta{color:#555;font-size:0.92em} .note{background:#fff8e1;border-left:4px solid #f1c232;padding:8px 12px;margin:10px 0}
.finding{border-left:4px solid #cc0000;padding:6px 12px;margin:12px 0;background:#fdf3f3}
.finding.ok{border-color:#6aa84f;background:#f3f9f1} .advice{color:#333;margin-top:4px}
img{max-width:100%} code{background:#f3f3f3;padding:1px 4px;border-radius:3px}
tr.own td{font-weight:600}
"""


def write_report(
    record: RunRecord | str | os.PathLike,
    out: str | os.PathLike | None = None,
    names: list[str] | None = None,
) -> Path:
    """Write the report of ``record`` to ``out`` (default ``RECORD/report.html``); return its path.

    Raises:
        ConfigError: the record cannot be read (see :func:`autoscale.observe.read_record`), or
            holds no step yet.
    """
    if not isinstance(record, RunRecord):
        record = read_record(record)
    replay = RecordReplay(record)
    recorded = replay.recorded()
    names = compare_names() if names is None else names
    outcomes = {name: replay.replay(name) for name in names}
    found = findings(replay, recorded, outcomes)
    shown = {k: outcomes[k] for k in ("torch", "auto") if k in outcomes}
    esc = html.escape
    parts = _head(record, recorded)
    parts.append("<h2>Findings</h2>")
    for f in found:
        cls = "finding ok" if f.title.startswith("Nothing") else "finding"
        parts.append(
            f"<div class='{cls}'><b>{esc(f.title)}.</b> {esc(f.detail)}"
            f"<div class='advice'>{esc(f.advice)}</div></div>"
        )
    parts.append("<h2>The scale, the gradients and fp16's range</h2>")
    parts.append(
        f"<img alt='loss scale over the steps' src='data:image/png;base64,{_scale_plot(replay, recorded, shown)}'>"
    )
    parts.append(
        f"<img alt='gradient underflow' src='data:image/png;base64,{_underflow_plot(recorded, shown)}'>"
    )
    loss_png = _loss_plot(replay)
    if loss_png:
        parts.append(f"<img alt='training loss' src='data:image/png;base64,{loss_png}'>")
    parts += _others(replay, recorded, outcomes)
    parts.append("</body></html>")
    path = Path(out) if out is not None else record.path / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(parts))
    os.replace(tmp, path)
    return path


def _head(record: RunRecord, recorded: Any) -> list[str]:
    """The page's head, title and run line, the record's notes and the run's own row."""
    meta, esc = record.meta, html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>autoscale report: {esc(record.path.name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>Loss scaling in <code>{esc(record.label)}</code></h1>",
        "<p class='meta'>"
        + " · ".join(
            esc(str(v))
            for v in (
                f"scaler {meta.get('scaler')}",
                f"{recorded.steps} steps recorded",
                f"device {meta.get('device')}",
                f"torch {meta.get('torch')}",
                f"autoscale {meta.get('autoscale')}",
                f"started {meta.get('started')}",
                f"record {record.path}",
            )
        )
        + "</p>",
    ]
    for note in record.notes:
        parts.append(f"<div class='note'>Record cut short: {esc(note)}.</div>")
    parts.append(
        "<table><tr><th></th><th>steps</th><th>skipped</th><th>skip rate</th><th>below fp16 range</th>"
        "<th>scale range</th><th>steps at minimum</th></tr>"
        f"<tr class='own'><td>{esc(recorded.name)}</td><td>{recorded.steps}</td>"
        f"<td>{int(recorded.skipped.sum())}</td><td>{_pct(recorded.skip_rate)}</td>"
        f"<td>{_pct(recorded.precision_loss)}</td><td>{_scale(recorded.scales.min())} .. "
        f"{_scale(recorded.scales.max())}</td><td>{recorded.at_min}</td></tr></table>"
    )
    return parts


def _others(replay: RecordReplay, recorded: Any, outcomes: dict[str, Any]) -> list[str]:
    """What the other rules would have done on the replay, beside the run's own row, and how
    to use one."""
    esc, record = html.escape, replay.record
    parts = [
        "<h2>What the other rules would have done (replay)</h2>",
        f"<p class='note'>{esc(replay.limits)}</p>",
        "<table><tr><th>scaler</th><th>skip rate</th><th>below fp16 range</th><th>scale range</th>"
        "<th>steps at minimum</th></tr>",
    ]
    rows = [recorded, *sorted(outcomes.values(), key=lambda o: (o.skip_rate, o.precision_loss))]
    for o in rows:
        cls = " class='own'" if o is recorded else ""
        parts.append(
            f"<tr{cls}><td>{esc(o.name)}</td><td>{_pct(o.skip_rate)}</td><td>{_pct(o.precision_loss)}</td>"
            f"<td>{_scale(o.scales.min())} .. {_scale(o.scales.max())}</td><td>{o.at_min}</td></tr>"
        )
    parts.append("</table>")
    parts.append(
        "<p class='meta'>Use one in the same run without changing a line: "
        "<code>autoscale wrap --scaler NAME -- "
        + esc(record.label)
        + "</code>; or search a policy "
        "for this run: <code>autoscale search --traces " + esc(str(record.path)) + "</code>.</p>"
    )
    return parts
