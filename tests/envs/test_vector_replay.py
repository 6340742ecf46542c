"""The vectorised replay of parametric rules gives the scalar replay's scorecards, field by field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autoscale.agents.evaluate import drive_episode, scaler_for
from autoscale.envs import ReplayEnv
from autoscale.envs.suite_env import SuiteEnv
from autoscale.envs.vector_replay import VECTOR_RULES, replay_rule, replay_windows
from autoscale.search.space import KNOBS, Knob, parametric_families
from tests.envs.test_replay_pin import STEPS, TRACE_STEPS, pin_spec, pin_trace

# knobs the search leaves at their defaults, drawn here too so that every branch is compared
UNSEARCHED = {"amax-cap": {"probe_after": Knob("int", 1, 80), "capped_margin": Knob("float", 0, 3)}}
EPISODES = [(i, o) for i in ("test-s7-t0", "test-s8-t5") for o in (0, 123, TRACE_STEPS - STEPS)]


def random_params(rule: str, rng: np.random.Generator, n: int) -> list[dict]:
    """n draws of the rule's searched knobs, over the search's ranges (ints, floats, log)."""
    defaults = parametric_families()[rule]
    out = []
    for _ in range(n):
        params = {}
        extra = UNSEARCHED.get(rule, {})
        for knob in defaults:
            k = KNOBS.get(knob, extra.get(knob))
            if k is None:
                continue
            if k.kind == "bool":
                params[knob] = bool(rng.random() < 0.5)
                continue
            lo, hi = (math.log(k.low), math.log(k.high)) if k.log else (k.low, k.high)
            x = rng.uniform(lo, hi)
            x = math.exp(x) if k.log else x
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
    moved = 0
    for k, params in enumerate(candidates):
        for e, (instance, offset) in enumerate(EPISODES):
            want, _ = drive_episode(env, scaler_for(rule, spec, **params), instance, offset)
            assert card_fields(got[k][e]) == card_fields(want), (params, instance, offset)
            moved += want.min_scale < want.max_scale
    assert moved > len(candidates)  # the scales move: the rule's updates are exercised


def test_windows_of_a_suite_env_and_diverged_episodes():
    """Episodes named MEMBER:INSTANCE through a SuiteEnv; one that diverges (three non-finite
    losses in a row) ends where the scalar one does."""
    spec = pin_spec()
    trace = pin_trace(spec)
    bad = trace.instance("test-s7-t0")
    bad.loss[40:43] = math.inf  # three in a row
    bad.nonfinite[40:43] = True
    env = SuiteEnv(spec, "test", traces={"pin": trace})
    episodes = [("pin:test-s7-t0", 0), ("pin:test-s8-t5", 400)]
    scalers = [scaler_for("torch", spec, growth_interval=3)]
    got = replay_rule("torch", scalers, replay_windows(env, episodes))
    for e, (instance, offset) in enumerate(episodes):
        want, _ = drive_episode(env, scaler_for("torch", spec, growth_interval=3), instance, offset)
        assert card_fields(got[0][e]) == card_fields(want)
    assert got[0][0].steps == 43 and got[0][1].steps == STEPS


def test_rules_outside_the_family_are_refused():
    spec = pin_spec()
    env = ReplayEnv(spec, pin_trace(spec), instances="test")
    with pytest.raises(ValueError, match="rule 'megatron'"):
        replay_rule("torch", [scaler_for("megatron", spec)], replay_windows(env, EPISODES[:1]))
