"""Shared parts of the differential tests: our rules driven through one adapter, and random
sequences of clean and overflowing steps.

``our_scales`` is the only place that knows how a built-in rule is driven; the upstream side of
each test drives the upstream object through its own public update call.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from autoscale.scalers import StepStats, make_scaler

N_STEPS = 10_000
SEEDS = (0, 1, 2, 3, 4, 5)
# overflow probabilities of the segments a sequence is made of: long clean stretches (growth),
# rare and frequent overflows, and stretches where almost every step overflows (down to the floor)
P_LEVELS = (0.0, 0.0, 1e-4, 1e-3, 1e-2, 0.05, 0.3, 0.9)
BURST_P = 1e-3  # chance per step that a burst of consecutive overflows starts
TOP = 2.0**127  # the largest power of two float32 holds: a max_scale no test sequence reaches


def our_scales(
    rule: str,
    params: dict,
    overflows: Sequence[bool],
    *,
    init_scale: float,
    min_scale: float,
    max_scale: float = TOP,
) -> list[float]:
    """The scale after each step of ``overflows`` under our built-in ``rule``.

    The one adapter between these tests and the rule interface: the scaler's controller takes
    each step's found-inf flag and returns the next scale, clamped to ``[min_scale, max_scale]``,
    as ``update()`` does.
    """
    s = make_scaler(
        rule,
        device="cpu",
        init_scale=init_scale,
        min_scale=min_scale,
        max_scale=max_scale,
        **params,
    )
    scale = s.get_scale()
    out = []
    for i, flag in enumerate(overflows):
        scale = s.controller.step(StepStats(i, scale, bool(flag)))
        out.append(scale)
    return out


def overflow_sequence(
    seed: int, n: int = N_STEPS, p: float | None = None, levels: Sequence[float] = P_LEVELS
) -> list[bool]:
    """``n`` steps, True where the step overflows.

    Made of segments of 100-3000 steps, each with an overflow probability drawn from ``levels``
    (or ``p`` for every segment), with bursts of 2-40 overflows in a row.
    """
    rng = random.Random(seed)
    out: list[bool] = []
    while len(out) < n:
        q = rng.choice(levels) if p is None else p
        for _ in range(rng.randint(100, 3000)):
            if rng.random() < BURST_P:
                out.extend([True] * rng.randint(2, 40))
            else:
                out.append(rng.random() < q)
    return out[:n]


def sequences(levels: Sequence[float] = P_LEVELS) -> list[tuple[str, list[bool]]]:
    """The sequences every rule is compared on: mixed segments for each seed, and a few seeds
    with one overflow probability throughout."""
    mixed = [(f"mixed-seed{s}", overflow_sequence(s, levels=levels)) for s in SEEDS]
    fixed = [
        (f"p{p:g}-seed{s}", overflow_sequence(100 + s, p=p))
        for s, p in enumerate((1e-4, 1e-3, 0.02, 0.5))
    ]
    return mixed + fixed


def first_difference(a: Sequence[float], b: Sequence[float]) -> int | None:
    """The first index where ``a`` and ``b`` differ (None if they are equal)."""
    assert len(a) == len(b)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def describe_difference(a: Sequence[float], b: Sequence[float], overflows: Sequence[bool]) -> str:
    """A failure message: where the sequences part, with the steps around it."""
    i = first_difference(a, b)
    if i is None:
        return "equal"
    lo, hi = max(0, i - 3), min(len(a), i + 3)
    rows = [
        f"  step {j}: overflow={overflows[j]} ours={a[j]:g} upstream={b[j]:g}"
        for j in range(lo, hi)
    ]
    return f"first difference at step {i}:\n" + "\n".join(rows)


def events(scales: Sequence[float], init: float, overflows: Sequence[bool]) -> dict[str, int]:
    """How often the scale grew, fell, and held on an overflow (hysteresis or the floor)."""
    prev, out = init, {"up": 0, "down": 0, "held_on_overflow": 0}
    for s, flag in zip(scales, overflows):
        if s > prev:
            out["up"] += 1
        elif s < prev:
            out["down"] += 1
        elif flag:
            out["held_on_overflow"] += 1
        prev = s
    return out


def growth_steps(scales: Sequence[float], init: float) -> list[int]:
    """The steps after which the scale was higher than before them."""
    return [i for i, s in enumerate(scales) if s > (scales[i - 1] if i else init)]
