"""Pins what replayed episodes produce, bit for bit: scale sequences, scorecards, observations and
rewards of long episodes (at offset 0 and late) driven by every built-in rule, tuned rules, a
neural policy and raw actions, on a fixed synthetic trace.

The replay hot path is tuned for speed; this test says that tuning changed no result. The pinned
values are in ``fixtures/replay_pin.json``; regenerate them (``python tests/envs/test_replay_pin.py``)
only for a change meant to alter replay results, and say so in the commit.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from autoscale.envs import ReplayEnv, load_env_spec
from autoscale.envs.suite_env import SuiteEnv
from autoscale.envs.traces import Trace, instance_trace
from autoscale.scalers.controller import StepStats
from autoscale.scalers.features import FEATURE_VERSION, FeatureExtractor

FIXTURE = Path(__file__).parent / "fixtures" / "replay_pin.json"
NEURAL = Path(__file__).parents[1] / "scalers" / "fixtures" / "policies" / "fixture-neural"
STEPS, TRACE_STEPS = 300, 700
TUNED = {
    "torch-gi20": ("torch", {"growth_interval": 20}),
    "megatron-tuned": (
        "megatron",
        {"growth_interval": 33, "growth_factor": 1.3, "backoff_factor": 0.094, "hysteresis": 2},
    ),
    "fairseq-tuned": ("fairseq", {"scale_window": 14, "scale_factor": 7.0, "tolerance": 0.32}),
    "amax-history-tuned": (
        "amax-history",
        {"history_len": 1, "margin": 4.38, "backoff_factor": 0.88},
    ),
}


def pin_spec():
    return load_env_spec(
        {
            "name": "pin",
            "workload": {"model": "mlp", "scenario": "bad-batches", "dtype": "fp16"},
            "episode": {
                "steps": STEPS,
                "init_scale": 65536,
                "min_scale": 1.0,
                "max_scale": 2**40,
            },
            "instances": {"train": [{"seed": 0}], "test": [{"seed": 7}, {"seed": 8, "start": 5}]},
        }
    )


class _Rec:
    """The fields :func:`instance_trace` reads from a recorded step."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def pin_trace(spec) -> Trace:
    """A synthetic trace whose thresholds wander, with non-finite losses, overflows at the recorded
    scale, gradients spread over many bits and a warmed-up start state."""
    from autoscale.training import HIST_EDGES

    rng = np.random.default_rng(2024)
    bins = len(HIST_EDGES) - 1
    traced = {}
    for k, inst in enumerate(spec.instances["train"] + spec.instances["test"]):
        wander = np.zeros(TRACE_STEPS)  # mean-reverting, about 2 bits either way
        for i in range(1, TRACE_STEPS):
            wander[i] = 0.97 * wander[i - 1] + rng.normal(0.0, 0.5)
        thr = 16.5 + wander + 3.0 * np.sin(np.arange(TRACE_STEPS) / (40.0 + 10 * k))
        scale, recs = 2.0**16, []
        for i in range(TRACE_STEPS):
            bad = i % 13 == 12
            over = bad or math.log2(scale) > thr[i]
            amax = 65504.0 / 2.0 ** thr[i]
            center = int(rng.integers(30, 56))
            hist = np.zeros(bins)
            hist[center - 8 : center + 8] = rng.dirichlet(np.ones(16))
            recs.append(
                _Rec(
                    overflow_threshold_log2=None if over else float(thr[i]),
                    scale=scale,
                    found_inf=over,
                    loss_nonfinite=bad,
                    loss=math.inf if bad else float(3.0 * math.exp(-i / 400) + rng.random() * 0.1),
                    grad_amax=amax,
                    grad_rms=amax * 2.0 ** -float(rng.uniform(5, 12)),
                    grad_log2_hist=hist.tolist(),
                )
            )
            scale = scale / 2 if over else min(scale * 2, 2.0**40) if i % 7 == 6 else scale
        fx = FeatureExtractor()
        for i in range(inst.start):  # a warmed-up start point
            fx.observe(StepStats(i, 2.0**16, False, 1e-3, 1e-5, 3.0, True))
        traced[inst.name] = instance_trace(
            inst.name,
            inst.seed,
            inst.start,
            recs,
            eval_loss=2.5,
            start_scale=2.0**16,
            start_features=fx.state_dict(),
        )
    return Trace(spec.to_dict(), traced, np.asarray(HIST_EDGES, dtype=np.float64), FEATURE_VERSION)


def _hex(x) -> str:
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x))
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    return float(x).hex()


def _digest(values) -> str:
    h = hashlib.sha256()
    for v in values:
        h.update(_hex(v).encode())
        h.update(b",")
    return h.hexdigest()[:24]


def factories(spec):
    from autoscale.envs.episodes import scaler_for
    from autoscale.scalers import list_scalers

    out = {
        i.name: (lambda n=i.name: scaler_for(n, spec)) for i in list_scalers() if i.kind == "rule"
    }
    for name, (base, kw) in TUNED.items():
        out[name] = lambda b=base, k=kw: scaler_for(b, spec, **k)
    out["neural"] = lambda: scaler_for(str(NEURAL), spec)  # reads the features
    return out


def episode_digest(env, card, records) -> dict:
    return {
        "scorecard": {
            k: _hex(v)
            for k, v in card.to_dict().items()
            if k not in ("wall_s", "useful_steps_per_s")
        },
        "records": _digest(
            x
            for r in records
            for x in (
                r.step,
                r.scale,
                r.found_inf,
                r.loss,
                r.loss_nonfinite,
                r.grad_amax,
                r.grad_rms,
                r.precision_loss,
                r.stats.scale,
                r.stats.step,
            )
        ),
        "features": _digest(env.features.features(env.scale)),
        "feature_state": _digest(
            x
            for v in env.features.state_dict().values()
            for x in (v if isinstance(v, list) else [v])
        ),
        "hit_min": env.hit_min,
    }


def compute() -> dict:
    from autoscale.envs.episodes import drive_episode

    spec = pin_spec()
    trace = pin_trace(spec)
    env = ReplayEnv(spec, trace, instances="test")
    out: dict = {"drive": {}, "actions": {}}
    for name, factory in factories(spec).items():
        for inst in ("test-s7-t0", "test-s8-t5"):
            for offset in (0, TRACE_STEPS - STEPS):
                card, records = drive_episode(env, factory(), inst, offset)
                out["drive"][f"{name}|{inst}|{offset}"] = episode_digest(env, card, records)
    # the same through a suite env (the search's path), and raw actions (an agent's path)
    suite_env = SuiteEnv(spec, "test", traces={"pin": trace})
    card, records = drive_episode(
        suite_env, factories(spec)["torch"](), "pin:test-s8-t5", TRACE_STEPS - STEPS
    )
    out["drive"]["suite|torch"] = episode_digest(suite_env.current, card, records)
    for offset in (0, 123):
        obs, info = env.reset(options={"instance": "test-s8-t5", "offset": offset})
        seq = [*obs.tolist(), info["scale"], info["offset"]]
        rng = np.random.default_rng(offset)
        for _ in range(STEPS):
            obs, reward, term, trunc, info = env.step(int(rng.integers(5)))
            seq += [*obs.tolist(), reward, term, trunc, info["scale"], info["skipped"]]
            seq += [info["precision_loss"], info["loss"]]
        out["actions"][str(offset)] = {"digest": _digest(seq), "obs_dtype": str(obs.dtype)}
    return out


@pytest.mark.parametrize("part", ["drive", "actions"])
def test_replayed_episodes_are_pinned(part):
    expected = json.loads(FIXTURE.read_text())[part]
    got = compute()[part]
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key] == expected[key], f"replay of {key} changed"


def test_pin_covers_overflows_nonfinite_losses_and_moving_scales():
    """The pinned episodes are not trivial: they skip, hit non-finite losses and move the scale."""
    from autoscale.envs.episodes import drive_episode, scaler_for

    spec = pin_spec()
    env = ReplayEnv(spec, pin_trace(spec), instances="test")
    card, records = drive_episode(env, scaler_for("torch", spec), "test-s7-t0", 0)
    assert STEPS // 13 < card.skipped < STEPS // 2
    assert any(r.loss_nonfinite for r in records) and any(
        r.found_inf and not r.loss_nonfinite for r in records
    )
    assert len({r.scale for r in records}) > 5
    assert card.precision_loss > 0


def test_replayed_records_are_plain_step_records():
    """Records and stats made on replay's fast path are the objects their constructors make."""
    import dataclasses

    from autoscale.envs.episodes import drive_episode, scaler_for
    from autoscale.training import StepRecord

    spec = pin_spec()
    env = ReplayEnv(spec, pin_trace(spec), instances="test")
    _, records = drive_episode(env, scaler_for("torch", spec), "test-s7-t0", 0)
    for r in records[:40]:
        s = r.stats
        assert type(r) is StepRecord and type(s) is StepStats
        assert repr(s) == repr(
            StepStats(s.step, s.scale, s.found_inf, s.grad_amax, s.grad_rms, s.loss, s.loss_seen)
        )
        made = StepRecord(
            step=s.step,
            scale=s.scale,
            found_inf=s.found_inf,
            loss=s.loss,
            loss_nonfinite=s.loss_nonfinite,
            grad_amax=s.grad_amax,
            grad_rms=s.grad_rms,
            precision_loss=r.precision_loss,
            lr=r.lr,
            wall_s=0.0,
            stats=s,
        )
        assert repr(r) == repr(made) and hash(r) == hash(made)
        assert dataclasses.replace(r, wall_s=1.0).wall_s == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        records[0].scale = 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        records[0].stats.scale = 2.0
    assert env.episode_records() is not records
    assert [repr(r) for r in env.episode_records()] == [repr(r) for r in records]


def test_late_starts_are_the_same_from_kept_points():
    """A start reached from a kept features state equals one carried from the trace's start."""
    spec = pin_spec()
    trace = pin_trace(spec)
    fresh = ReplayEnv(spec, trace, instances="test")
    warmed = ReplayEnv(spec, trace, instances="test")
    warmed.reset(options={"instance": "test-s8-t5", "offset": 300})  # keeps 128 and 256
    for offset in (400, 256, 130, 0):
        a, ia = fresh.reset(options={"instance": "test-s8-t5", "offset": offset})
        b, ib = warmed.reset(options={"instance": "test-s8-t5", "offset": offset})
        np.testing.assert_array_equal(a, b)
        assert ia == ib
        assert repr(fresh.features.state_dict()) == repr(warmed.features.state_dict())
        fresh = ReplayEnv(spec, trace, instances="test")


def test_advance_at_keeps_the_books_of_step_at():
    """advance_at takes the step step_at takes, without building its observation."""
    spec = pin_spec()
    trace = pin_trace(spec)
    a, b = (ReplayEnv(spec, trace, instances="test") for _ in range(2))
    with pytest.raises(RuntimeError, match="reset"):
        a.advance_at(1.0)
    for env in (a, b):
        env.reset(options={"instance": "test-s7-t0", "offset": 17})
    rng = np.random.default_rng(0)
    for t in range(STEPS):
        scale = 2.0 ** float(rng.uniform(-2, 44))  # beyond both bounds too
        if t % 13 == 8:  # below the minimum on the trace's non-finite losses: overflows there
            scale = 0.25
        _, _, term, trunc, _ = a.step_at(scale)
        assert b.advance_at(scale) == (term or trunc) == (t == STEPS - 1)
        assert repr(a.last_stats) == repr(b.last_stats)  # repr: NaN fields compare equal
        assert a.scale == b.scale and a.hit_min == b.hit_min
        assert repr(a.features.state_dict()) == repr(b.features.state_dict())
    assert a.hit_min
    assert repr(a.scorecard()) == repr(b.scorecard())


def test_feature_windows_follow_their_deques():
    """The running overflow counts equal the windows' sums through updates and state loads."""
    fx = FeatureExtractor()
    rng = np.random.default_rng(3)
    for i in range(100):
        over, bad = bool(rng.random() < 0.3), bool(rng.random() < 0.2)
        fx.update(StepStats(i, 2.0**10, over, 1e-3, 1e-5, math.inf if bad else 1.0, True))
        if i % 17 == 0:
            other = FeatureExtractor()
            other.load_state_dict(fx.state_dict())
            fx = other
        feats = fx.features(2.0**10)
        assert feats[2] == sum(fx.overflows) / len(fx.overflows)
        assert feats[8] == sum(fx.nonfinite) / len(fx.nonfinite)
        assert fx.observe(fx_last := StepStats(i, 2.0**10, over, 1e-3, 1e-5, 1.0, True)) == (
            fx.features(fx_last.scale)
        )


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
