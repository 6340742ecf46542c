"""The per-trial plot (:func:`trajectory_svg`): scale trajectory against the recorded overflow
threshold, written as SVG text because a matplotlib figure costs more than a replay trial.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

__all__ = ["trajectory_svg"]

_W, _H, _LEFT, _RIGHT, _TOP, _GAP = 640, 110, 56, 12, 26, 22
_MAX_POINTS = 300  # per line: long episodes are drawn per bin of steps


def _polyline(points: list[tuple[float, float]], style: str) -> str:
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return f'<polyline points="{pts}" fill="none" {style}/>'


def trajectory_svg(
    panels: Sequence[tuple[str, Sequence, Sequence[float] | None]], title: str
) -> str:
    """One panel per episode: log2 scale per step (blue; x = skipped step) and the log2 overflow
    threshold the trace recorded (grey, dashed: steps above it overflow).

    Args:
        panels: ``(label, step records, thresholds or None)`` per episode.
        title: Shown on top.
    """
    height = _TOP + len(panels) * (_H + _GAP)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" '
        f'viewBox="0 0 {_W} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{_W}" height="{height}" fill="white"/>',
        f'<text x="{_LEFT}" y="16" font-size="13">{escape(title)}</text>',
    ]
    for p, (label, records, thresholds) in enumerate(panels):
        top = _TOP + p * (_H + _GAP) + _GAP - 8
        scales = [math.log2(r.scale) for r in records]
        thr = [t for t in (thresholds or [])[: len(records)] if math.isfinite(t)]
        values = scales + thr
        lo, hi = (min(values) - 1, max(values) + 1) if values else (0.0, 1.0)
        n = max(1, len(records))

        def xy(i: float, v: float, top: float = top, lo: float = lo, hi: float = hi, n: int = n):
            x = _LEFT + (_W - _LEFT - _RIGHT) * i / n
            return x, top + _H * (hi - v) / (hi - lo)

        out.append(
            f'<rect x="{_LEFT}" y="{top}" width="{_W - _LEFT - _RIGHT}" height="{_H}" '
            'fill="none" stroke="#bbb"/>'
        )
        out.append(f'<text x="{_LEFT + 4}" y="{top - 4}">{escape(label)}</text>')
        for v in (hi - 1, lo + 1):
            _, y = xy(0, v)
            out.append(f'<text x="{_LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">2^{v:.0f}</text>')
        # long episodes: the threshold per bin of steps (its lowest), a skip mark per bin
        stride = max(1, math.ceil(n / _MAX_POINTS))
        if thresholds is not None:
            t = list(thresholds)[:n]
            pts = []
            for b in range(0, len(t), stride):
                finite = [v for v in t[b : b + stride] if math.isfinite(v)]
                if finite:
                    pts.append(xy(b + stride / 2, min(finite)))
            if pts:
                out.append(_polyline(pts, 'stroke="#999" stroke-dasharray="4 3"'))
        steps: list[tuple[float, float]] = []
        for i, v in enumerate(scales):
            if i == 0 or v != scales[i - 1]:
                steps += [xy(i, scales[i - 1] if i else v), xy(i, v)]
        if scales:
            steps.append(xy(len(scales), scales[-1]))
            out.append(_polyline(steps, 'stroke="#1f77b4" stroke-width="1.5"'))
        for b in range(0, len(records), stride):
            hit = [i for i in range(b, min(b + stride, len(records))) if records[i].found_inf]
            if hit:
                x, y = xy(hit[0] + 0.5, scales[hit[0]])
                out.append(
                    f'<path d="M{x - 3:.1f},{y - 3:.1f}l6,6m0,-6l-6,6" stroke="#d62728" '
                    'stroke-width="1.5"/>'
                )
    out.append("</svg>")
    return "\n".join(out)
