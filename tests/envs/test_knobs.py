"""Scenario knobs drawn per replayed episode: a step under a loss weight 2^g is the recorded step
with its gradients 2^g larger, so an episode under a constant weight at scale S replays exactly
as the plain episode at S * 2^g; bad batches overflow at any scale."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autoscale.envs import ReplayEnv
from autoscale.envs.knobs import Knobs
from autoscale.errors import ConfigError
from tests.envs.test_replay_pin import STEPS, pin_spec, pin_trace


def constant(bits: float, **more) -> Knobs:
    fields = {"plain": 0.0, "weight_bits": (bits, bits), "drift_bits": (0.0, 0.0), "spike": 0.0}
    return Knobs(**{**fields, "bad": 0.0, **more})


@pytest.mark.parametrize("bits", [-12.0, -3.5, 5.0])
def test_a_constant_weight_is_the_plain_step_at_a_shifted_scale(bits):
    spec = pin_spec()
    trace = pin_trace(spec)
    plain = ReplayEnv(spec, trace, instances="test")
    knobbed = ReplayEnv(spec, trace, instances="test", knobs=constant(bits))
    plain.reset(options={"instance": "test-s7-t0"})
    _, info = knobbed.reset(options={"instance": "test-s7-t0"})
    assert info["knobs"] == {"weight_bits": bits, "drift_bits": 0.0}
    skipped = 0
    for t in range(STEPS):
        log2 = 6.0 + (t % 23)  # scales 2^6 .. 2^28 (shifted: within the bounds), overflowing or not
        a = knobbed.step_at(2.0 ** (log2 - bits))
        b = plain.step_at(2.0**log2)
        assert a[2:4] == b[2:4]
        assert a[4]["skipped"] == b[4]["skipped"]
        skipped += a[4]["skipped"]
        if not a[4]["skipped"]:
            assert a[4]["precision_loss"] == pytest.approx(b[4]["precision_loss"], abs=1e-6)
            assert knobbed.last_stats.grad_amax == pytest.approx(
                plain.last_stats.grad_amax * 2.0**bits, rel=1e-12, nan_ok=True
            )
            assert knobbed.last_stats.loss == pytest.approx(
                plain.last_stats.loss * 2.0**bits, rel=1e-12, nan_ok=True
            )
    assert 0 < skipped < STEPS  # both kinds of step were compared


def test_bad_batches_overflow_at_any_scale_on_their_period():
    spec = pin_spec()
    trace = pin_trace(spec)
    plain = ReplayEnv(spec, trace, instances="test")
    env = ReplayEnv(spec, trace, instances="test", knobs=constant(0.0, bad=1.0, bad_every=(5, 5)))
    plain.reset(options={"instance": "test-s7-t0"})
    _, info = env.reset(options={"instance": "test-s7-t0"}, seed=3)
    assert info["knobs"]["bad_every"] == 5
    extra = []  # steps the knobs made fail (the recorded run has bad batches of its own)
    for t in range(60):
        got = env.step_at(1.0)[4]["skipped"]  # the minimum scale
        was = plain.step_at(1.0)[4]["skipped"]
        assert got >= was
        if got and not was:
            assert math.isinf(env.last_stats.loss)
            extra.append(t)
    assert len(extra) >= 10 and {t % 5 for t in extra} == {extra[0] % 5}


def test_draws_follow_the_episode_rng_and_their_ranges():
    k = Knobs()
    draws = [k.draw(np.random.default_rng(s), 512) for s in range(200)]
    assert draws[7] == Knobs().draw(np.random.default_rng(7), 512)  # reproducible
    plain = sum(d is None for d in draws)
    assert 20 <= plain <= 60  # plain=0.2 of 200
    knobbed = [d for d in draws if d is not None]
    assert any("spike" in d.drawn for d in knobbed) and any("spike" not in d.drawn for d in knobbed)
    for d in knobbed:
        lo, hi = k.weight_bits
        assert lo <= d.gain[0] - _spike_at(d, 0) <= hi
        drift = d.gain[-1] - _spike_at(d, 511) - d.gain[0] + _spike_at(d, 0)
        assert k.drift_bits[0] - 1e-9 <= drift <= k.drift_bits[1] + 1e-9
        if "bad_every" in d.drawn:
            gaps = np.diff(np.flatnonzero(d.bad))
            assert set(gaps.tolist()) == {d.drawn["bad_every"]}
        else:
            assert not any(d.bad)


def _spike_at(d, t: int) -> float:
    s = d.drawn.get("spike")
    return 0.0 if s is None else s["bits"] * max(0.0, 1.0 - abs(t - s["at"]) / s["width"])


@pytest.mark.parametrize(
    "bad",
    [{"plain": 1.5}, {"drift_bits": (3.0, -3.0)}, {"bad_every": (2, 8)}, {"spike_width": (0, 4)}],
)
def test_bad_ranges_are_refused_in_one_line(bad):
    with pytest.raises(ConfigError, match="knobs: ") as e:
        Knobs(**bad)
    assert "\n" not in str(e.value)


def test_an_agent_trained_under_knobs_records_them(tiny_spec, tiny_trace, tmp_path):
    from autoscale.agents.train import train_agent
    from autoscale.scalers.policies import read_manifest

    knobs = Knobs(weight_bits=(-10.0, 0.0))
    result = train_agent(
        tiny_spec, "ppo", 64, replay=tiny_trace, knobs=knobs, seed=0,
        hyperparams={"n_steps": 32, "batch_size": 16}, export_name="knobbed",
        export_dir=str(tmp_path),
    )  # fmt: skip
    manifest = read_manifest(result.policy_dir)
    assert manifest.workload["knobs"] == knobs.to_dict()
    with pytest.raises(ConfigError, match="knobs apply to replayed episodes"):
        train_agent(tiny_spec, "ppo", 64, knobs=knobs)
