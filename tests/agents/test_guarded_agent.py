"""An agent that sets the base scale under a per-step loss guard (``episode.guard``): the
environment lowers each spike's scale as ``amax-loss`` does and learns the guard from every
step; the exported policy carries the guard and acts in a training loop as it did in the
environment."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import autoscale
from autoscale.agents.train import train_agent
from autoscale.envs import LossScaleEnv, ReplayEnv, record_trace
from autoscale.envs.episodes import drive_episode
from autoscale.envs.spec import GuardSpec, load_env_spec
from autoscale.errors import ConfigError, PolicyError
from autoscale.scalers.policies import read_manifest, write_manifest
from autoscale.training import TrainingRun

pytestmark = pytest.mark.slow  # trains an agent, then real steps: seconds

SPEC = {
    "name": "spiky",
    "workload": {"model": "mlp", "scenario": "preference", "dtype": "fp16"},
    "episode": {
        "steps": 12, "init_scale": 2**10, "min_scale": 1.0, "max_scale": 2**30, "guard": True,
    },
    "instances": {"train": [{"seed": 0}, {"seed": 1, "start": 4}], "test": [{"seed": 5}]},
    "reward": {"skip": 1.0, "precision": 4.0, "progress": 0.1, "divergence": 10.0},
}  # fmt: skip


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    spec = load_env_spec(SPEC)
    folder = tmp_path_factory.mktemp("guarded")
    trace = folder / "spiky.npz"
    record_trace(spec, 24, trace)
    train_agent(spec, "ppo", 300, replay=trace, export_name="guarded-ppo", export_dir=str(folder))
    return spec, trace, folder / "guarded-ppo"


def test_episode_guard_is_parsed_and_checked():
    assert load_env_spec(SPEC).episode.guard == GuardSpec(16, 1.0)
    custom = {**SPEC, "episode": {**SPEC["episode"], "guard": {"guard_history": 4}}}
    assert load_env_spec(custom).episode.guard == GuardSpec(4, 1.0)
    assert load_env_spec(custom).to_dict()["episode"]["guard"]["guard_history"] == 4
    off = {**SPEC, "episode": {**SPEC["episode"], "guard": False}}
    assert load_env_spec(off).episode.guard is None
    for bad, match in (({"guard_history": 0}, "guard_history"), ({"x": 1}, "x"), (3, "guard")):
        with pytest.raises(ConfigError, match=match):
            load_env_spec({**SPEC, "episode": {**SPEC["episode"], "guard": bad}})


def test_an_agent_acts_under_the_guard_and_a_driven_rule_does_not(guarded):
    spec, trace, _ = guarded
    env = ReplayEnv(spec, trace)
    env.reset(seed=0, options={"instance": "train-s0-t0"})
    assert env.agent_guard is not None and env.guard_rule is env.agent_guard
    guarded_steps = 0
    for t in range(spec.episode.steps):
        # clean steps first (the guard learns from them), then the agent asks for the most: the
        # guard holds each step down to what its loss allows
        env.step_at(2.0**8 if t < 4 else 2.0**30)
        guarded_steps += env.last_stats.guarded
        if env.last_stats.guarded:
            assert env.last_stats.scale < 2.0**30
    assert env.agent_guard.ratios and guarded_steps > 0
    # a rule driven in the same env brings its own guard (torch: none), not the agent's
    card, _ = drive_episode(env, autoscale.get_scaler("torch", device="cpu"), "train-s0-t0")
    plain = dataclasses.replace(spec, episode=dataclasses.replace(spec.episode, guard=None))
    ref, _ = drive_episode(
        ReplayEnv(plain, trace), autoscale.get_scaler("torch", device="cpu"), "train-s0-t0"
    )
    assert card.skip_rate == ref.skip_rate and card.max_scale == ref.max_scale


def test_the_exported_policy_carries_the_guard_and_acts_as_in_the_env(guarded):
    spec, trace, path = guarded
    manifest = read_manifest(path)
    assert manifest.parameters["guard"] == {"guard_history": 16, "guard_margin": 1.0}
    scaler = autoscale.get_scaler(str(path), device="cpu")
    assert scaler.rule.has_guard
    # real steps: the env and a plain training loop see the same features and take the same
    # scales, guarded steps included
    env = LossScaleEnv(spec, instances="test")
    in_env = autoscale.get_scaler(str(path), device="cpu")
    env.set_guard(in_env.rule)
    _, info = env.reset(options={"instance": "test-s5-t0"})
    env.set_guard(in_env.rule)
    scale = in_env.controller.start(info["scale"], env.features.state_dict())
    for _ in range(spec.episode.steps):
        env.step_at(scale)
        scale = in_env.controller.step(env.last_stats)
    deployed = autoscale.get_scaler(str(path), device="cpu")
    run = TrainingRun(spec.workload.replace(seed=5), deployed)
    for _ in range(spec.episode.steps):
        run.step()
    assert [r.scale for r in run.records] == [r.scale for r in env.records]
    assert [r.stats.guarded for r in run.records] == [r.stats.guarded for r in env.records]
    assert any(r.stats.guarded for r in run.records)  # the guard took spikes in this run
    # its checkpoint carries the guard's memory and the scale it set last
    state = deployed.state_dict()["autoscale"]["rule_state"]
    assert state["ratios"] and state["base"] == deployed.get_scale()
    again = autoscale.get_scaler(str(path), device="cpu")
    again.load_state_dict(deployed.state_dict())
    assert list(again.rule.guard.ratios) == state["ratios"] and again.rule.base == state["base"]


def test_the_agent_in_the_env_and_the_exported_policy_pick_the_same_scales(guarded):
    """The agent's own actions in the replay env (its guard applied by the env) and the exported
    policy driving the same env (its guard applied from the policy) give one trajectory."""
    spec, trace, path = guarded
    env = ReplayEnv(spec, trace, instances="test")
    policy = autoscale.get_scaler(str(path), device="cpu")
    obs, _ = env.reset(options={"instance": "test-s5-t0"})
    agent = []
    for _ in range(spec.episode.steps):
        obs, *_ = env.step(int(policy.rule.act(obs.tolist())))
        agent.append((env.last_stats.scale, env.last_stats.guarded))
    _, records = drive_episode(env, autoscale.get_scaler(str(path), device="cpu"), "test-s5-t0")
    assert [(r.stats.scale, r.stats.guarded) for r in records] == agent
    assert any(g for _, g in agent) or len({s for s, _ in agent}) > 1


def test_a_malformed_guard_in_a_manifest_is_refused(guarded, tmp_path):
    _, _, path = guarded
    import shutil

    copy = tmp_path / "broken"
    shutil.copytree(path, copy)
    manifest = read_manifest(copy)
    write_manifest(
        copy,
        dataclasses.replace(manifest, parameters={**manifest.parameters, "guard": {"oops": 1}}),
    )
    with pytest.raises(PolicyError, match="guard"):
        autoscale.get_scaler(str(copy), device="cpu")
    np.testing.assert_equal(read_manifest(path).parameters["guard"]["guard_history"], 16)


def test_train_agent_guard_flag(guarded, tmp_path):
    import yaml

    from autoscale.cli import main

    spec, trace, _ = guarded
    plain = {**SPEC, "episode": {**SPEC["episode"], "guard": False}}
    spec_file = tmp_path / "spiky.yaml"
    spec_file.write_text(yaml.safe_dump(plain))
    args = ["train-agent", "--env", str(spec_file), "--replay", str(trace), "--timesteps", "64"]
    args += ["--policy-dir", str(tmp_path / "pol"), "--quiet"]
    assert main([*args, "--out", "unguarded"]) == 0
    assert main([*args, "--out", "guarded", "--guard"]) == 0
    assert "guard" not in read_manifest(tmp_path / "pol" / "unguarded").parameters
    assert read_manifest(tmp_path / "pol" / "guarded").parameters["guard"]["guard_history"] == 16
    assert autoscale.get_scaler(str(tmp_path / "pol" / "guarded"), device="cpu").rule.has_guard
