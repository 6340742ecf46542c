"""The rule interface and what the scaler adds to it: one controller, the minimum, checkpoints,
policy kinds, and the example of docs/rules.md."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import autoscale
from autoscale.errors import ConfigError, MinimumLossScaleError, PolicyError
from autoscale.scalers import (
    LossScaler,
    ScaleBounds,
    ScaleController,
    ScaleRule,
    StepStats,
    policies,
    registry,
)
from autoscale.scalers.rules import MegatronRule
from tests.scalers.helpers import adamw, batches, run, tiny_model

RULES_PAGE = Path(__file__).resolve().parents[2] / "docs" / "rules.md"  # "Register a rule"


def overflow(scale: float, step: int = 0) -> StepStats:
    return StepStats(step, scale, True)


# ---------------------------------------------------------------- raise_at_min follows the rule
def test_megatron_hysteresis_absorbs_an_overflow_at_the_minimum_before_raising():
    """An overflow that megatron's hysteresis absorbs leaves the scale where it is: no abort."""
    scaler = autoscale.get_scaler("megatron", device="cpu", init_scale=1.0, raise_at_min=True)
    model = tiny_model()
    trace = run(model, adamw(model), scaler, batches(1), [0])  # spends the hysteresis
    assert trace.skipped == [0] and scaler.get_scale() == 1.0 and scaler.min_hits == 1
    with pytest.raises(MinimumLossScaleError, match="already at minimum.*'megatron'"):
        run(model, adamw(model), scaler, batches(1), [0])  # hysteresis used up: would halve


def test_fairseq_tolerance_absorbs_an_overflow_at_the_minimum_before_raising():
    rule_kw = {"scale_window": 1000, "tolerance": 0.5, "init_scale": 1.0, "min_scale": 1.0}
    scaler = autoscale.get_scaler("fairseq", device="cpu", raise_at_min=True, **rule_kw)
    c = scaler.controller
    for i in range(3):  # clean steps: 1 overflow in 4 steps since the start is under 0.5
        c.step(StepStats(i, 1.0, False))
    assert c.step(overflow(1.0, 3)) == 1.0  # 1 overflow in 4 steps < 0.5: absorbed, no raise
    assert c.step(overflow(1.0, 4)) == 1.0  # 2 in 5: absorbed
    with pytest.raises(MinimumLossScaleError, match="'fairseq'"):
        c.step(overflow(1.0, 5))  # 3 in 6 = 0.5: it would rescale below the minimum
    assert scaler.min_hits == 3


@pytest.mark.parametrize("name", ["torch", "jmp", "amax-history"])
def test_rules_without_hysteresis_raise_on_the_first_overflow_at_the_minimum(name):
    scaler = autoscale.get_scaler(
        name, device="cpu", init_scale=4.0, min_scale=4.0, max_scale=4.0, raise_at_min=True
    )
    with pytest.raises(MinimumLossScaleError):
        scaler.controller.step(overflow(4.0))


def test_backs_off_on_overflow_matches_what_the_rule_then_does():
    """For every rule, ``backs_off_on_overflow()`` predicts whether the next overflow lowers the
    scale, in every state a random sequence of steps reaches."""
    import random

    rng = random.Random(0)
    for name in registry.rule_names():
        cls = registry.rule_class(name)
        rule = cls(**({"hysteresis": 3} if "hysteresis" in cls().params() else {}))
        bounds = ScaleBounds.of(2.0**-24, 2.0**64)
        scale = 2.0**20
        for i in range(400):
            if rng.random() < 0.3:
                predicted = rule.backs_off_on_overflow()
                state = rule.state()
                probe = cls(**rule.params())
                probe.load_state(state)
                lowered = probe.next_scale(scale, StepStats(i, scale, True)) < scale
                assert lowered == predicted, f"{name} at step {i}: state {state}"
            found = rng.random() < 0.2
            scale = bounds.clamp(rule.next_scale(scale, StepStats(i, scale, found, 1e-3, 1e-4)))


# ---------------------------------------------------------------- one controller
def test_controller_clamps_rounds_and_counts():
    class Wild(ScaleRule):
        name = "wild"

        def next_scale(self, scale, stats):
            return math.nan if stats.found_inf else scale * 1e30

    c = ScaleController(Wild(), ScaleBounds.of(1e-4, 2.0**20))
    assert c.bounds.min_scale >= 1e-4 and c.bounds.clamp(1e-4) >= 1e-4  # rounded inwards
    assert c.step(StepStats(0, 8.0, False)) == 2.0**20
    assert c.step(overflow(2.0**20, 1)) == c.bounds.min_scale  # NaN -> the minimum
    assert c.step(overflow(c.bounds.min_scale, 2)) == c.bounds.min_scale
    assert (c.steps, c.skipped, c.min_hits, c.hit_min) == (3, 2, 1, True)


def test_the_env_and_the_scaler_share_the_controller(tiny_spec):
    """A scaler driving the env, and the same rule in a scaler's own update(), take the same
    scales: both go through ScaleController.step."""
    from autoscale.envs import LossScaleEnv
    from autoscale.envs.episodes import drive_episode, scaler_for
    from autoscale.training import TrainingRun

    env = LossScaleEnv(tiny_spec, instances="test")
    card, records = drive_episode(
        env, scaler_for("torch", tiny_spec, growth_interval=2), "test-s5-t0"
    )
    ep = tiny_spec.episode
    scaler = autoscale.get_scaler(
        "torch",
        device="cpu",
        growth_interval=2,
        init_scale=ep.init_scale,
        min_scale=ep.min_scale,
        max_scale=ep.max_scale,
    )
    real = TrainingRun(tiny_spec.workload.replace(seed=5), scaler)
    real.run(ep.steps)
    assert [r.scale for r in records] == [r.scale for r in real.records]
    assert card.hit_min == scaler.hit_min


# ---------------------------------------------------------------- checkpoints
def _trained(name: str = "torch", **kw) -> LossScaler:
    scaler = autoscale.get_scaler(name, device="cpu", growth_interval=3, init_scale=64.0, **kw)
    model = tiny_model()
    run(model, adamw(model), scaler, batches(4), [1])
    return scaler


def test_load_state_dict_clamps_the_scale_into_this_scalers_bounds():
    state = _trained().state_dict()
    state["scale"] = 2.0**30
    narrow = autoscale.get_scaler("torch", device="cpu", growth_interval=3, max_scale=2.0**10)
    with pytest.warns(UserWarning) as seen:
        narrow.load_state_dict(state)
    messages = " | ".join(str(w.message) for w in seen)
    assert "lies outside this scaler's" in messages and "continuing from 1024" in messages
    assert "keeps its own" in messages  # the checkpoint's bounds differ and are not adopted
    assert narrow.get_scale() == 2.0**10 and narrow.max_scale == 2.0**10


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s.update(scale=math.nan), r"scale nan, not a positive finite number"),
        (lambda s: s.update(scale=0.0), r"scale 0.0, not a positive"),
        (lambda s: s.update(scale="big"), r"scale 'big'"),
        (lambda s: s.pop("scale"), r"scale None"),
        (lambda s: s["autoscale"].update(rule=7), r"names no rule \(got 7\)"),
        (lambda s: s["autoscale"].update(version=99), r"format 99.*upgrade autoscale"),
        (lambda s: s["autoscale"].pop("steps"), r"lacks \['steps'\]"),
        (lambda s: s["autoscale"].update(skipped=-1), r"counters \{'skipped': -1\}"),
        (
            lambda s: s["autoscale"].update(rule_state={"growth_tracker": "x"}),
            r"'growth_tracker' must be an integer",
        ),
        (lambda s: s["autoscale"].update(rule_state=[1]), r"state must be a mapping"),
        (lambda s: s.update(autoscale=3), r"'autoscale' entry must be a mapping"),
    ],
)
def test_load_state_dict_says_what_is_incompatible(change, match):
    state = _trained().state_dict()
    change(state)
    fresh = autoscale.get_scaler("torch", device="cpu", growth_interval=3)
    before = fresh.get_scale()
    with pytest.raises(ConfigError, match=match):
        fresh.load_state_dict(state)
    assert fresh.get_scale() == before


def test_amax_history_state_is_validated():
    scaler = autoscale.get_scaler("amax-history", device="cpu")
    state = scaler.state_dict()
    state["autoscale"]["rule_state"] = {"history": ["a"]}
    with pytest.raises(ConfigError, match="'history' must be a list of numbers"):
        scaler.load_state_dict(state)


def test_a_plain_gradscaler_checkpoint_still_loads():
    plain = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=3)
    model = tiny_model()
    run(model, adamw(model), plain, batches(2))
    ours = autoscale.get_scaler("torch", device="cpu", growth_interval=3)
    ours.load_state_dict(plain.state_dict())
    assert ours.get_scale() == 512.0 and ours.rule.state() == {"growth_tracker": 2}


def test_gradscaler_knob_setters_act_on_the_rule():
    scaler = autoscale.get_scaler("torch", device="cpu")
    scaler.set_growth_interval(7)
    assert scaler.get_growth_interval() == 7 == scaler.rule.growth_interval
    with pytest.raises(ConfigError, match="growth_interval must be a positive integer"):
        scaler.set_growth_interval(0)
    with pytest.raises(ConfigError, match="rule 'amax-history' has no growth_interval"):
        autoscale.get_scaler("amax-history", device="cpu").set_growth_interval(5)
    assert isinstance(autoscale.get_scaler("megatron", device="cpu").rule, MegatronRule)


# ---------------------------------------------------------------- policy kinds
def test_a_registered_policy_kind_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(policies, "_KINDS", dict(policies._KINDS))

    def constant(path, manifest, device, overrides):
        return registry.build_scaler(
            registry.rule_class("static"),
            device,
            {"init_scale": manifest.parameters["scale"], **overrides},
            name=manifest.name,
        )

    (tmp_path / "fixed").mkdir()
    (tmp_path / "fixed" / "policy.yaml").write_text(
        "name: fixed\nkind: constant\nfamily: static\nparameters: {scale: 512}\n"
    )
    monkeypatch.setenv(policies.POLICY_PATH_ENV, str(tmp_path))
    with pytest.raises(PolicyError, match=r"kind 'constant'.*known: neural, parametric"):
        autoscale.get_scaler("fixed", device="cpu")
    policies.register_policy_kind("constant", constant)
    scaler = autoscale.get_scaler("fixed", device="cpu")
    assert scaler.name == "fixed" and scaler.get_scale() == 512.0
    assert "constant" in policies.policy_kinds()


def test_staged_publish_leaves_nothing_on_failure_and_refuses_to_overwrite(tmp_path):
    with pytest.raises(RuntimeError), policies.staged_policy("half", tmp_path) as tmp:
        (tmp / "policy.yaml").write_text("name: half\n")
        raise RuntimeError("interrupted mid-export")
    assert list(tmp_path.iterdir()) == []  # no half-written folder, no staging left behind
    with policies.staged_policy("whole", tmp_path) as tmp:
        (tmp / "policy.yaml").write_text("x: 1\n")
    assert (tmp_path / "whole" / "policy.yaml").stat().st_mode & 0o044  # readable by others
    with (
        pytest.raises(
            ConfigError,
            match=r"policy folder '.*whole' already exists; choose another name or pass --force",
        ),
        policies.staged_policy("whole", tmp_path),
    ):
        pass
    with pytest.raises(ConfigError, match="is a built-in rule's name"):
        policies.check_policy_name("torch")
    # the shipped auto: not shadowed by an export elsewhere; its own folder may be rebuilt
    with pytest.raises(ConfigError, match="'auto' is a policy shipped with autoscale"):
        policies.check_export_dest("auto", tmp_path)
    from autoscale.resources import shipped_dir

    policies.check_not_shipped("auto", shipped_dir("policies"))
    assert policies.check_export_dest("mine", tmp_path) == tmp_path / "mine"
    with pytest.raises(ConfigError, match="letters, digits"):
        policies.check_policy_name("../escape")


# ---------------------------------------------------------------- the example of docs/rules.md
def test_readme_register_a_rule_example_runs(monkeypatch):
    monkeypatch.setattr(registry, "_RULES", dict(registry._RULES))
    text = RULES_PAGE.read_text()
    section = text[text.index("## Register a rule") :]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    namespace: dict = {}
    exec(compile(code, "docs/rules.md", "exec"), namespace)
    scaler = namespace["scaler"]
    assert isinstance(scaler, LossScaler) and scaler.name == "halve-then-wait"
    assert scaler.get_scale() == 2.0**12 and scaler.rule.params() == {"patience": 50}
    model = tiny_model()
    trace = run(model, adamw(model), scaler, batches(3), [1])
    assert trace.after == [2.0**12, 2.0**11, 2.0**11]
    assert scaler.state_dict()["autoscale"]["rule_state"] == {"clean": 1}
    with pytest.raises(ConfigError, match="did you mean 'patience'"):
        autoscale.get_scaler("halve-then-wait", device="cpu", patiense=3)
