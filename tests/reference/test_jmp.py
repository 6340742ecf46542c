"""Our ``jmp`` rule against DeepMind jmp's own ``DynamicLossScale`` (JAX on CPU).

Each step is jmp's ``adjust`` on a ``DynamicLossScale`` built from the previous step's scale and
counter, with this test's ``period``, ``factor`` and ``min_loss_scale``, inside one ``lax.scan``.
(jmp's ``tree_unflatten`` drops ``min_loss_scale``, so a ``DynamicLossScale`` carried through
``jit`` or ``scan`` itself falls back to a minimum of 1; building it in the step keeps the
minimum, as eager use does.)
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.reference.helpers import (
    TOP,
    describe_difference,
    events,
    first_difference,
    growth_steps,
    our_scales,
    sequences,
)


@functools.cache
def _jax():
    """JAX and jmp, imported by the first test that runs them (a second of import each time the
    tests are collected otherwise); the test skips where they are not installed."""
    jax = pytest.importorskip("jax", reason="JAX is not installed: pip install -e '.[reference]'")
    jmp = pytest.importorskip("jmp", reason="jmp is not installed: pip install -e '.[reference]'")
    return jax, jmp, jax.numpy


# DynamicLossScale's (loss_scale, period, factor, min_loss_scale); the first is jmp's defaults
# with the initial scale of its examples
CASES = {
    "defaults": (2.0**15, 2000, 2, 1.0),
    "period100": (2.0**15, 100, 2, 1.0),
    "period500-factor4-min1/8": (2.0**20, 500, 4, 0.125),
    "period300-init1000": (1000.0, 300, 2, 1.0),
}


def upstream(overflows, init, period, factor, min_scale):
    jax, jmp, jnp = _jax()

    def step(carry, finite):
        loss_scale, counter = carry
        state = jmp.DynamicLossScale(
            loss_scale=loss_scale,
            counter=counter,
            period=period,
            factor=factor,
            min_loss_scale=jnp.float32(min_scale),
        ).adjust(finite)
        return (state.loss_scale, state.counter), state.loss_scale

    finite = jnp.asarray(~np.asarray(overflows, dtype=bool))
    _, scales = jax.jit(lambda f: jax.lax.scan(step, (jnp.float32(init), jnp.int32(0)), f))(finite)
    return [float(s) for s in np.asarray(scales)]


def ours(overflows, init, period, factor, min_scale, max_scale=TOP):
    params = {"period": period, "factor": factor}
    return our_scales(
        "jmp", params, overflows, init_scale=init, min_scale=min_scale, max_scale=max_scale
    )


@pytest.mark.slow  # 10,000-step sequences x 10 seeds
@pytest.mark.parametrize("case", list(CASES))
def test_same_scale_sequence_as_dynamic_loss_scale(case):
    args = CASES[case]
    seen = {"up": 0, "down": 0, "held_on_overflow": 0}
    for name, overflows in sequences():
        theirs = upstream(overflows, *args)
        assert max(theirs) < TOP  # our max_scale never engaged: a pure comparison
        mine = ours(overflows, *args)
        assert mine == theirs, f"{case} {name}: " + describe_difference(mine, theirs, overflows)
        for k, v in events(theirs, args[0], overflows).items():
            seen[k] += v
    assert all(v > 0 for v in seen.values()), seen  # held on overflow: at the minimum


@pytest.mark.slow
def test_both_keep_the_largest_float32_power_of_two():
    """Where growth would overflow float32, jmp keeps the scale; ours stops at max_scale, and
    with max_scale = 2^127 the two are the same."""
    clean = [False] * 100
    theirs = upstream(clean, 2.0**120, 10, 2, 1.0)
    assert theirs == ours(clean, 2.0**120, 10, 2, 1.0, max_scale=2.0**127)
    assert theirs[-1] == 2.0**127 and growth_steps(theirs, 2.0**120) == [9, 19, 29, 39, 49, 59, 69]


@pytest.mark.slow  # about a second or more
def test_jmp_grows_past_our_default_max_scale():
    """Below float32's range jmp has no ceiling; ours stops at max_scale (2^64 by default), the
    only difference on a clean run, and backs off from there."""
    overflows = [False] * 1000 + [True]
    theirs = upstream(overflows, 2.0**60, 100, 2, 1.0)
    mine = ours(overflows, 2.0**60, 100, 2, 1.0, max_scale=2.0**64)
    assert mine[:-1] == [min(t, 2.0**64) for t in theirs[:-1]]
    first = first_difference(mine, theirs)
    assert first == 499 and theirs[first] == 2.0**65 and mine[first] == 2.0**64
    assert theirs[-1] == 2.0**69 and mine[-1] == 2.0**63


def eager(overflows, init, period, factor, min_scale):
    """jmp's adjust step by step, outside jit."""
    _, jmp, jnp = _jax()
    state = jmp.DynamicLossScale(
        jnp.float32(init), period=period, factor=factor, min_loss_scale=jnp.float32(min_scale)
    )
    out = []
    for flag in overflows:
        state = state.adjust(jnp.asarray(not flag))
        out.append(float(state.loss_scale))
    return out


def test_a_factor_that_is_not_a_power_of_two_under_jit():
    """Ours divides by the factor as jmp does outside jit (the correctly rounded float32
    quotient). Under jit, XLA turns the division by the constant factor into a product with its
    float32 reciprocal, which can land one float32 ulp away: jmp's jitted sequence then differs
    from ours from that step on."""
    overflows = [False] * 3 + [True] * 3 + [False] * 300  # 1000 -> 1000/3 -> 1000/9 -> 1000/27
    args = (1000.0, 100, 3, 1.0)
    mine = ours(overflows, *args)
    assert mine == eager(overflows, *args)
    jitted = upstream(overflows, *args)
    first = first_difference(mine, jitted)
    assert first == 5 and mine[:first] == jitted[:first]
    by_reciprocal = float(np.float32(mine[first - 1]) * np.float32(1 / 3))
    assert jitted[first] == by_reciprocal and mine[first] == float(np.float32(mine[first - 1]) / 3)
    assert np.nextafter(np.float32(mine[first]), np.float32(np.inf)) == np.float32(jitted[first])
