"""Our ``fairseq`` rule against fairseq's own ``DynamicLossScaler``.

fairseq 0.12.2 (its last release) does not import on Python 3.11 or later (its dataclass configs
use mutable defaults: fairseq issue #5012), so it cannot be a dependency. Its loss scaler is a
self-contained module without imports; it is read from fairseq's source distribution on PyPI,
which ``.ci/run`` downloads (``pip download --no-deps fairseq==0.12.2 -d .cache/reference``), and
executed as it is.

fairseq drives it in two calls: ``check_overflow(grad_norm)`` every step, which on an overflow
lowers the scale (subject to ``tolerance``) and raises ``OverflowError`` so the trainer skips the
step, and ``update()`` after a clean step, which grows it.
"""

from __future__ import annotations

import os
import tarfile
import types
from pathlib import Path

import pytest

from autoscale.errors import MinimumLossScaleError
from autoscale.scalers import make_scaler
from tests.reference.helpers import (
    TOP,
    describe_difference,
    events,
    first_difference,
    our_scales,
    sequences,
)
from tests.scalers.helpers import adamw, batches, run, tiny_model

VERSION = "0.12.2"
MEMBER = f"fairseq-{VERSION}/fairseq/optim/dynamic_loss_scaler.py"
FOLDER = Path(
    os.environ.get("AUTOSCALE_REFERENCE_DIR", Path(__file__).parents[2] / ".cache" / "reference")
)
SDIST = FOLDER / f"fairseq-{VERSION}.tar.gz"


def _load() -> types.ModuleType:
    if not SDIST.exists():
        pytest.skip(
            f"fairseq {VERSION} does not import on Python 3.11+ (fairseq issue #5012); its loss "
            f"scaler is read from its sdist, not found at {SDIST}: run "
            f"pip download --no-deps fairseq=={VERSION} -d {FOLDER}",
            allow_module_level=True,
        )
    with tarfile.open(SDIST) as tar:
        source = tar.extractfile(MEMBER).read().decode()
    module = types.ModuleType("fairseq_dynamic_loss_scaler")
    exec(compile(source, f"{SDIST.name}/{MEMBER}", "exec"), module.__dict__)
    return module


FAIRSEQ = _load()

# DynamicLossScaler's (init_scale, scale_factor, scale_window, tolerance, min_loss_scale); the
# first is fairseq's command-line defaults on one device (--fp16-init-scale 128,
# --fp16-scale-window 2^14, --fp16-scale-tolerance 0, --min-loss-scale 1e-4)
CASES = {
    "defaults": (128.0, 2.0, 16384, 0.0, 1e-4),
    "window200-min2^-60": (128.0, 2.0, 200, 0.0, 2.0**-60),
    "window500-tolerance0.25": (2.0**15, 2.0, 500, 0.25, 2.0**-10),
    "window100-tolerance0.05-min2^-60": (2.0**10, 2.0, 100, 0.05, 2.0**-60),
    "factor4-window300-min2^-100": (2.0**16, 4.0, 300, 0.0, 2.0**-100),
}
# fairseq halves on every overflow (tolerance 0) and aborts at its minimum: where most steps
# overflow, a run ends there within a few hundred steps. At these rates runs last thousands.
LEVELS = (0.0, 0.0, 1e-4, 1e-3, 3e-3, 1e-2)


class Aborted(Exception):
    """fairseq raised FloatingPointError ("Minimum loss scale reached") at ``step``."""

    def __init__(self, step: int, scales: list[float]):
        super().__init__(step)
        self.step, self.scales = step, scales


def upstream(overflows, init, factor, window, tolerance, min_scale):
    """fairseq's scale after each step, as its trainer drives it."""
    s = FAIRSEQ.DynamicLossScaler(
        init_scale=init,
        scale_factor=factor,
        scale_window=window,
        tolerance=tolerance,
        min_loss_scale=min_scale,
    )
    out = []
    for i, flag in enumerate(overflows):
        if flag:
            try:
                s.check_overflow(float("inf"))
            except OverflowError:
                pass  # the trainer skips the step
            except FloatingPointError:
                raise Aborted(i, out) from None
        else:
            s.check_overflow(1.0)
            s.update()
        out.append(float(s.loss_scale))
    return out


def ours(overflows, init, factor, window, tolerance, min_scale):
    params = {"scale_factor": factor, "scale_window": window, "tolerance": tolerance}
    return our_scales(
        "fairseq", params, overflows, init_scale=init, min_scale=min_scale, max_scale=TOP
    )


@pytest.mark.slow  # 10,000-step sequences x 10 seeds
@pytest.mark.parametrize("case", list(CASES))
def test_same_scale_sequence_as_fairseq_until_its_minimum(case):
    """Step for step the same scale, up to the step where fairseq aborts at its minimum; there
    ours is at the minimum (fairseq restored the scale before it and stopped training)."""
    args = CASES[case]
    floor = make_scaler("fairseq", device="cpu", min_scale=args[4]).min_scale  # float32, rounded up
    seen = {"up": 0, "down": 0, "held_on_overflow": 0, "aborted": 0, "compared": 0}
    for name, overflows in sequences(LEVELS):
        mine = ours(overflows, *args)
        try:
            theirs = upstream(overflows, *args)
        except Aborted as stop:
            seen["aborted"] += 1
            theirs, k = stop.scales, stop.step
            assert mine[:k] == theirs, f"{case} {name}: " + describe_difference(
                mine[:k], theirs, overflows
            )
            assert overflows[k] and mine[k] == floor  # clamped where fairseq aborted
            assert (theirs[-1] if k else args[0]) / args[1] <= args[4] < mine[k - 1]
        else:
            assert max(theirs) < TOP
            assert mine == theirs, f"{case} {name}: " + describe_difference(mine, theirs, overflows)
        seen["compared"] += len(theirs)
        for key, v in events(theirs, args[0], overflows).items():
            seen[key] += v
    # backoff, growth (windows shorter than the run), overflows tolerated, the abort
    assert seen["down"] and (seen["up"] or args[2] > 5000), seen
    assert bool(seen["held_on_overflow"]) == (args[3] > 0), seen
    assert seen["aborted"] and seen["compared"] >= 10_000, seen


def test_fairseq_aborts_one_overflow_before_ours_with_raise_at_min():
    """fairseq aborts at the overflow whose backoff would reach its minimum, restoring the scale
    before it; ours clamps to the minimum there and, with raise_at_min=True, raises at the next
    overflow, which finds the scale at the minimum."""
    init, min_scale = 8.0, 1.0
    overflows = [True, False, True, True, False, True]
    with pytest.raises(Aborted) as stop:
        upstream(overflows, init, 2.0, 1000, 0.0, min_scale)
    assert stop.value.step == 3 and stop.value.scales == [4.0, 4.0, 2.0]  # 2 -> 1 is refused
    assert ours(overflows, init, 2.0, 1000, 0.0, min_scale) == [4.0, 4.0, 2.0, 1.0, 1.0, 1.0]

    scaler = make_scaler("fairseq", device="cpu", init_scale=init, min_scale=1.0, raise_at_min=True)
    model = tiny_model()
    done = []
    with pytest.raises(MinimumLossScaleError):
        run(model, adamw(model), scaler, batches(6), [0, 2, 3, 5], each=done.append)
    assert done == [0, 1, 2, 3, 4]  # steps 3 (clamped to the minimum) and 4 went on


def test_growth_window_counts_from_the_last_overflow():
    overflows = [False] * 250 + [True] + [False] * 450
    theirs = upstream(overflows, 128.0, 2.0, 200, 0.0, 1e-4)
    assert theirs == ours(overflows, 128.0, 2.0, 200, 0.0, 1e-4)
    grew = [i for i in range(1, len(theirs)) if theirs[i] > theirs[i - 1]]
    assert grew == [199, 450, 650]  # iter - last_overflow_iter a multiple of 200
    assert first_difference(theirs, ours(overflows, 128.0, 2.0, 201, 0.0, 1e-4)) == 199
