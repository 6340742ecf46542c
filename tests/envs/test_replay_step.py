"""ReplayEnv.step (the fused fast path) equals the generic ScaleEnvBase.step, step by step."""

from __future__ import annotations

import numpy as np

from autoscale.envs import ReplayEnv
from autoscale.envs.base import ScaleEnvBase
from tests.envs.test_replay_pin import STEPS, pin_spec, pin_trace


def test_fused_step_equals_the_generic_step():
    spec = pin_spec()
    trace = pin_trace(spec)
    fast, generic = (ReplayEnv(spec, trace, instances="test") for _ in range(2))
    rng = np.random.default_rng(5)
    kinds = (int, np.int64, lambda a: np.array(a), lambda a: [a])
    for offset in (0, 250):
        for env in (fast, generic):
            env.reset(options={"instance": "test-s7-t0", "offset": offset})
        for t in range(STEPS):
            # mostly downwards then upwards: reaches the minimum scale and the maximum
            a = int(rng.integers(3)) if t < STEPS // 2 else int(rng.integers(2, 5))
            action = kinds[t % len(kinds)](a)
            got = fast.step(action)
            want = ScaleEnvBase.step(generic, action)
            assert got[0].dtype == want[0].dtype == np.float32
            np.testing.assert_array_equal(got[0], want[0])
            assert repr(got[1:]) == repr(want[1:])
            assert repr(fast.last_stats) == repr(generic.last_stats)
            assert repr((fast.scale, fast.hit_min)) == repr((generic.scale, generic.hit_min))
            assert repr(fast.features.state_dict()) == repr(generic.features.state_dict())
        assert repr(fast.scorecard()) == repr(generic.scorecard())
    assert fast.hit_min


def test_a_guarded_step_is_the_generic_one():
    """With a rule's per-step guard set, step lowers scales as the generic path does."""
    from autoscale.scalers.catalog import make_scaler

    spec = pin_spec()
    trace = pin_trace(spec)
    fast, generic = (ReplayEnv(spec, trace, instances="test") for _ in range(2))
    for env in (fast, generic):
        rule = make_scaler("amax-loss", device="cpu", guard_history=2, guard_margin=4.0)
        env.set_guard(rule.controller.rule)
        env.reset(options={"instance": "test-s7-t0"})
        for t in range(40):  # the rule's ratios from clean steps, so that its guard bites
            rule.controller.rule.next_scale(2.0**10, _clean(t))
    for t in range(STEPS):
        action = 4 if t % 3 else 2
        got, want = fast.step(action), ScaleEnvBase.step(generic, action)
        np.testing.assert_array_equal(got[0], want[0])
        assert repr(got[1:]) == repr(want[1:])
        assert repr(fast.last_stats) == repr(generic.last_stats)
    assert any(s.guarded for s, _ in fast.records)


def _clean(t: int):
    from autoscale.scalers.controller import StepStats

    return StepStats(t, 2.0**10, False, 1.0, 1e-3, 1.0, True)
