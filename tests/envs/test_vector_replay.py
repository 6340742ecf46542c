"""The vectorised replay of parametric rules gives the scalar replay's scorecards, field by field."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from autoscale.envs import ReplayEnv
from autoscale.envs.episodes import drive_episode, scaler_for
from autoscale.envs.suite_env import SuiteEnv
from autoscale.envs.vector_replay import VECTOR_RULES, replay_rule, replay_windows
from autoscale.errors import MinimumLossScaleError
from autoscale.search.space import KNOBS, RULE_KNOBS, Knob, parametric_families
from tests.envs.test_replay_pin import STEPS, TRACE_STEPS, pin_spec, pin_trace

# knobs the search leaves at their defaults, drawn here too so that every branch is compared
_CAP = {"probe_after": Knob("int", 1, 80), "capped_margin": Knob("float", 0, 3)}
UNSEARCHED = {
    "amax-cap": _CAP,
    "amax-loss": {
        **_CAP,
        "guard_history": Knob("int", 1, 64, log=True),
        "guard_margin": Knob("float", 0, 3),
    },
}
EPISODES = [(i, o) for i in ("test-s7-t0", "test-s8-t5") for o in (0, 123, TRACE_STEPS - STEPS)]


def random_params(rule: str, rng: np.random.Generator, n: int) -> list[dict]:
    """n draws of the rule's searched knobs, over the search's ranges (ints, floats, log)."""
    defaults = parametric_families()[rule]
    out = []
    for _ in range(n):
        params = {}
        knobs = {**UNSEARCHED.get(rule, {}), **KNOBS, **RULE_KNOBS.get(rule, {})}
        for knob in defaults:
            k = knobs.get(knob)
            if k is None:
                continue
            if k.kind == "bool":
                params[knob] = bool(rng.random() < 0.5)
                continue
            lo, hi = (math.log(k.low), math.log(k.high)) if k.log else (k.low, k.high)
            x = rng.uniform(lo, hi)
            x = math.exp(x) if k.log else x
            if k.kind == "log2":  # an exponent: the value is 2**k
                params[knob] = 2.0 ** int(round(x))
            else:
                params[knob] = int(round(x)) if k.kind == "int" else float(x)
        out.append(params)
    return out


def card_fields(card) -> dict:
    return {k: repr(v) for k, v in card.to_dict().items()}  # repr: NaNs equal, -0.0 apart


@pytest.mark.parametrize("rule", sorted(VECTOR_RULES))
def test_vectorised_scorecards_equal_the_scalar_replay(rule):
    spec = pin_spec()
    env = ReplayEnv(spec, pin_trace(spec), instances="test")
    rng = np.random.default_rng(sum(map(ord, rule)))
    candidates = [{}, *random_params(rule, rng, 11)]  # the defaults and 11 random draws
    windows = replay_windows(env, EPISODES)
    got = replay_rule(rule, [scaler_for(rule, spec, **p) for p in candidates], windows)
    moved, differ = 0, set()
    for k, params in enumerate(candidates):
        for e, (instance, offset) in enumerate(EPISODES):
            want, _ = drive_episode(env, scaler_for(rule, spec, **params), instance, offset)
            assert card_fields(got[k][e]) == card_fields(want), (params, instance, offset)
            moved += want.min_scale < want.max_scale
            differ.add(want.precision_loss)
    assert len(differ) > 3  # the candidates differ
    if rule != "static":
        assert moved > len(candidates)  # the scales move: the rule's updates are exercised


@pytest.mark.parametrize("rule", sorted(VECTOR_RULES))
def test_windows_of_a_suite_env_and_diverged_episodes(rule):
    """Episodes named MEMBER:INSTANCE through a SuiteEnv; one that diverges (three non-finite
    losses in a row) ends where the scalar one does."""
    spec = pin_spec()
    trace = pin_trace(spec)
    bad = trace.instance("test-s7-t0")
    bad.loss[40:43] = math.inf  # three in a row
    bad.step_loss[40:43] = math.inf  # the loss the scaler saw: what the books read
    bad.nonfinite[40:43] = True
    env = SuiteEnv(spec, "test", traces={"pin": trace})
    episodes = [("pin:test-s7-t0", 0), ("pin:test-s8-t5", 400), ("pin:test-s7-t0", 50)]
    candidates = [{}, *random_params(rule, np.random.default_rng(len(rule)), 3)]
    scalers = [scaler_for(rule, spec, **p) for p in candidates]
    got = replay_rule(rule, scalers, replay_windows(env, episodes))
    for k, params in enumerate(candidates):
        for e, (instance, offset) in enumerate(episodes):
            want, _ = drive_episode(env, scaler_for(rule, spec, **params), instance, offset)
            assert card_fields(got[k][e]) == card_fields(want), (params, instance, offset)
    assert [c.steps for c in got[0]] == [43, STEPS, STEPS]


# an overflow at the minimum: aborts under raise_at_min unless hysteresis or tolerance absorbs it
ABORTS = {
    "torch": {},
    "static": {},
    "deepspeed": {"hysteresis": 3},
    "megatron": {"hysteresis": 4, "growth_interval": 5},
    "fairseq": {"tolerance": 0.5, "scale_window": 3},
    "metaseq": {"tolerance": 0.3, "scale_window": 2},
    "amax-loss": {},
}


def first_steps(windows, n: int):
    """``windows`` cut to their first ``n`` steps."""
    cut = {k: getattr(windows, k)[:, :n] for k in ("nonfinite", "threshold", "loss", "amax")}
    return dataclasses.replace(
        windows, **cut, table=windows.table[:, :n], steps=np.minimum(windows.steps, n)
    )


@pytest.mark.parametrize("rule", sorted(ABORTS))
def test_raise_at_min_aborts_where_the_scalar_replay_does(rule):
    """The same step raises (a replay cut just before it does not), with the same message."""
    spec = pin_spec()
    env = ReplayEnv(spec, pin_trace(spec), instances="test")
    params = {**ABORTS[rule], "min_scale": 2.0**17, "raise_at_min": True}  # thresholds near it
    at = []
    for instance, offset in EPISODES:
        windows = replay_windows(env, [(instance, offset)])
        scaler = scaler_for(rule, spec, **params)
        try:
            want, _ = drive_episode(env, scaler, instance, offset)
        except MinimumLossScaleError as err:
            n = scaler.controller.steps  # the step that raised, counted
            with pytest.raises(MinimumLossScaleError, match=re.escape(str(err))):
                replay_rule(rule, [scaler_for(rule, spec, **params)], first_steps(windows, n))
            if n > 1:
                replay_rule(rule, [scaler_for(rule, spec, **params)], first_steps(windows, n - 1))
            at.append(n)
            continue
        (got,) = replay_rule(rule, [scaler_for(rule, spec, **params)], windows)
        assert card_fields(got[0]) == card_fields(want)
        assert want.skipped  # overflows that did not abort: a static scale's, at any scale
        at.append(None)
    if rule == "static":
        assert at == [None] * len(EPISODES)  # a static scale never aborts
    else:
        assert any(at) and max(n or 0 for n in at) > 1, at


def spiky_trace(spec):
    """The pin trace with preference-like spikes: on one step in eight the loss grows by 2^u
    and the gradients by about as much (the overflow threshold falls by u, give or take a bit,
    so the guard's foresight sometimes falls short)."""
    trace = pin_trace(spec)
    rng = np.random.default_rng(5)
    for name in ("test-s7-t0", "test-s8-t5"):
        t = trace.instance(name)
        spikes = np.flatnonzero((rng.random(len(t.loss)) < 0.125) & np.isfinite(t.loss))
        u = rng.uniform(1.0, 8.0, len(spikes))
        t.loss[spikes] *= 2.0**u
        t.threshold[spikes] -= u + rng.choice([-1.0, 0.0, 0.5, 1.5], len(spikes))
        t.amax[spikes] = 65504.0 / 2.0 ** t.threshold[spikes]
    return trace


def test_amax_loss_guard_on_spiky_losses():
    """amax-loss's guard lowers the spikes' scales, and guarded steps that still overflow feed
    its ratios, as in the scalar replay."""
    spec = pin_spec()
    env = ReplayEnv(spec, spiky_trace(spec), instances="test")
    rng = np.random.default_rng(11)
    candidates = [{}, {"probe_after": 8}, *random_params("amax-loss", rng, 10)]
    windows = replay_windows(env, EPISODES)
    got = replay_rule(
        "amax-loss", [scaler_for("amax-loss", spec, **p) for p in candidates], windows
    )
    guarded = missed = 0
    for k, params in enumerate(candidates):
        for e, (instance, offset) in enumerate(EPISODES):
            scaler = scaler_for("amax-loss", spec, **params)
            want, records = drive_episode(env, scaler, instance, offset)
            assert card_fields(got[k][e]) == card_fields(want), (params, instance, offset)
            guarded += sum(r.stats.guarded for r in records)
            missed += sum(r.stats.guarded and r.found_inf for r in records)
    assert guarded > 100 and missed > 5  # both branches of the guard are exercised


def test_amax_loss_guard_floor_on_losses_that_cancel():
    """Every third step's loss sits near zero while its gradients do not (a loss of terms of
    both signs, as in RL fine-tuning): without a floor the guard learns a huge amax per loss
    there and drops the next steps' scales; with one it does not. The vectorised replay agrees
    with the scalar one, floor or not."""
    spec = pin_spec()
    trace = pin_trace(spec)
    for name in ("test-s7-t0", "test-s8-t5"):
        t = trace.instance(name)
        t.scaler_loss[::3] *= 1e-7  # the loss the scaler sees
    env = ReplayEnv(spec, trace, instances="test")
    rng = np.random.default_rng(5)
    candidates = [{}, {"guard_floor": 12.0}, {"guard_floor": 4.0, "probe_after": 8}]
    candidates += random_params("amax-loss", rng, 6)
    windows = replay_windows(env, EPISODES)
    got = replay_rule(
        "amax-loss", [scaler_for("amax-loss", spec, **p) for p in candidates], windows
    )
    guarded = {}
    for k, params in enumerate(candidates):
        for e, (instance, offset) in enumerate(EPISODES):
            scaler = scaler_for("amax-loss", spec, **params)
            want, records = drive_episode(env, scaler, instance, offset)
            assert card_fields(got[k][e]) == card_fields(want), (params, instance, offset)
            guarded[k] = guarded.get(k, 0) + sum(r.stats.guarded for r in records)
    # no floor: the near-zero losses' lessons guard many steps; a 12-bit floor: almost none
    assert guarded[0] > 100 and guarded[1] < guarded[0] / 10, guarded


def test_a_guard_that_skips_spikes_is_refused_not_replayed_without_them():
    """The lanes have no spike test: a candidate with spike_bits is refused (the search's bench
    replays it with the scalar replay instead), never replayed as if it had none."""
    spec = pin_spec()
    env = ReplayEnv(spec, pin_trace(spec), instances="test")
    windows = replay_windows(env, EPISODES[:1])
    with pytest.raises(ValueError, match="spike_bits"):
        replay_rule("amax-loss", [scaler_for("amax-loss", spec, spike_bits=8.0)], windows)
