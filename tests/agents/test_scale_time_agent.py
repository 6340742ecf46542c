"""An agent that acts when the loss is scaled (``episode.scale_time``): it sees this step's loss
beside the after-step features, changes the base scale or drops this step's scale only, and the
exported policy decides in the scaler at the same moment, as it did in the environment."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import autoscale
from autoscale.agents.train import train_agent
from autoscale.envs import LossScaleEnv, ReplayEnv, record_trace
from autoscale.envs.episodes import drive_episode
from autoscale.envs.spec import load_env_spec
from autoscale.errors import ConfigError, PolicyError
from autoscale.scalers.actions import ActionMap
from autoscale.scalers.controller import StepStats
from autoscale.scalers.features import N_FEATURES
from autoscale.scalers.policies import read_manifest, write_manifest
from autoscale.scalers.scale_time import N_SCALE_TIME, LossNow
from autoscale.training import TrainingRun

SPEC = {
    "name": "spiky-now",
    "workload": {"model": "mlp", "scenario": "preference", "dtype": "fp16"},
    "episode": {
        "steps": 12, "init_scale": 2**10, "min_scale": 1.0, "max_scale": 2**30,
        "scale_time": True, "action": {"drops": [4, 8, 12, 16]},
    },
    "instances": {"train": [{"seed": 0}, {"seed": 1, "start": 4}], "test": [{"seed": 5}]},
    "reward": {"skip": 1.0, "precision": 4.0, "progress": 0.1, "divergence": 10.0},
}  # fmt: skip


def _episode(**changes):
    return {**SPEC, "episode": {**SPEC["episode"], **changes}}


def test_scale_time_and_drops_are_parsed_and_checked():
    spec = load_env_spec(SPEC)
    assert spec.episode.scale_time and spec.episode.action.drops == (4.0, 8.0, 12.0, 16.0)
    assert spec.to_dict()["episode"]["scale_time"] is True
    assert load_env_spec(spec.to_dict()).episode == spec.episode
    bad = (
        (_episode(scale_time=False), "need episode.scale_time"),
        (_episode(guard=True), "give one"),
        (_episode(scale_time="yes"), "true or false"),
        (_episode(action={"drops": [2]}), "exceed the largest downward delta"),
        (_episode(action={"drops": [-4]}), "positive numbers"),
        (_episode(action={"mode": "continuous", "drops": [4]}), "need discrete actions"),
    )
    for data, match in bad:
        with pytest.raises(ConfigError, match=match):
            load_env_spec(data)


def test_an_episode_turned_to_scale_time_gets_default_drops_and_refuses_a_guard():
    plain = {
        **SPEC,
        "episode": {k: v for k, v in SPEC["episode"].items() if k not in ("scale_time", "action")},
    }
    ep = load_env_spec(plain).episode
    assert not ep.scale_time and not ep.action.drops
    now = ep.at_scale_time()
    assert now.scale_time and now.action.drops == (4, 8, 12, 16) and now.steps == ep.steps
    cont = dataclasses.replace(ep, action=ActionMap(mode="continuous")).at_scale_time()
    assert cont.scale_time and not cont.action.drops  # continuous actions have no drops
    kept = dataclasses.replace(ep, scale_time=True, action=ActionMap(drops=(6,))).at_scale_time()
    assert kept.action.drops == (6,)  # a spec's own drops stay
    guarded = load_env_spec({**plain, "episode": {**plain["episode"], "guard": True}}).episode
    with pytest.raises(ConfigError, match="under a guard cannot act at scale time"):
        guarded.at_scale_time()


def test_a_drop_is_this_step_only_and_is_told_from_the_scale_used():
    a = ActionMap(drops=(4.0, 8.0))
    assert a.n == 7 and [a.delta(i) for i in range(7)] == [-2, -1, 0, 1, 2, -4, -8]
    with pytest.raises(ConfigError, match="out of range 0..6"):
        a.delta(7)
    base = 2.0**10
    assert a.base_after(2.0**8, base) == 2.0**8  # a delta of -2 carries on
    assert a.base_after(2.0**12, base) == 2.0**12
    assert a.base_after(2.0**6, base) == base  # a drop of 4 does not
    assert ActionMap().base_after(2.0**6, base) == 2.0**6  # without drops, every scale carries
    assert ActionMap.from_dict(a.to_dict()) == a


def test_loss_now_features_on_the_host_and_on_a_device_agree():
    now = LossNow()
    assert now.features(3.0, 2.0**10) == [0.0, 0.0, 0.0]  # nothing known yet
    for i, loss in enumerate([1.0, 1.2, 0.9, 1.1]):
        now.update(StepStats(i, 2.0**10, False, 0.01 * loss, 1e-3, loss, True))
    now.update(StepStats(4, 2.0**10, True, math.inf, math.inf, 50.0, True))  # skipped: no ratio
    assert len(now.ratios) == 4
    for loss in (1.0, 40.0, 1e-3, 0.0, math.inf, -math.inf, math.nan, -7.5):
        host = now.features(loss, 2.0**12)
        dev = now.device_features(torch.tensor(loss, dtype=torch.float32), 2.0**12)
        assert dev.dtype == torch.float64
        np.testing.assert_allclose(dev.tolist(), host, rtol=0, atol=1e-6, err_msg=str(loss))
    jump, room, bad = now.features(40.0, 2.0**12)
    assert jump > 0.5 and bad == 0.0  # a spike: 40x the first losses, 7x their average with 50
    # bits of room the amax a loss this big foresees leaves at 2^12: fp16 max / (0.01 * 40 * 2^12)
    assert room == pytest.approx(math.log2(65504.0 / (0.01 * 40.0 * 2.0**12)) / 16, abs=1e-9)
    again = LossNow()
    again.load_state_dict(now.state_dict())
    assert again.features(40.0, 2.0**12) == now.features(40.0, 2.0**12)
    with pytest.raises(ConfigError, match="ratios"):
        again.load_state_dict({"loss_ema": 1.0, "ratios": [-1.0]})


def test_a_peeked_forward_is_the_step_it_continues():
    spec = load_env_spec(SPEC)
    plain = TrainingRun(spec.workload.replace(seed=3), "amax-loss")
    peeked = TrainingRun(spec.workload.replace(seed=3), "amax-loss")
    for _ in range(3):
        loss = peeked.peek_loss()
        assert peeked.peek_loss() == loss  # a second peek runs no second forward
        with pytest.raises(RuntimeError, match="peek_loss"):
            peeked.snapshot()
        a, b = plain.step(), peeked.step()
        fields = ("loss", "scale", "found_inf", "grad_amax", "precision_loss")
        np.testing.assert_equal([getattr(b, f) for f in fields], [getattr(a, f) for f in fields])
        assert b.stats.loss == loss  # the loss the scaler saw is the peeked one
    for x, y in zip(plain.model.parameters(), peeked.model.parameters(), strict=True):
        assert torch.equal(x, y)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    spec = load_env_spec(SPEC)
    folder = tmp_path_factory.mktemp("scale-time")
    trace = folder / "spiky.npz"
    record_trace(spec, 24, trace)
    train_agent(spec, "ppo", 300, replay=trace, export_name="now-ppo", export_dir=str(folder))
    return spec, trace, folder / "now-ppo"


def _randomised(path, tmp_path, seed):
    """A copy of the exported policy with random weights large enough to pick varied actions
    (drops included), so that the parity checks below see every kind of step."""
    import shutil

    from autoscale.scalers.policies import sha256_file

    copy = tmp_path / f"random-{seed}"
    shutil.copytree(path, copy)
    blob = torch.load(copy / "weights.pt", weights_only=True)
    gen = torch.Generator().manual_seed(seed)
    blob["actor"] = {k: torch.randn(v.shape, generator=gen) * 2 for k, v in blob["actor"].items()}
    torch.save(blob, copy / "weights.pt")
    manifest = read_manifest(copy)
    write_manifest(
        copy, dataclasses.replace(manifest, weights_sha256=sha256_file(copy / "weights.pt"))
    )
    return copy


@pytest.mark.slow
def test_the_exported_policy_reads_the_loss_at_scale_time(trained):
    spec, trace, path = trained
    p = read_manifest(path).parameters
    assert p["scale_time"] is True and p["action"]["drops"] == [4.0, 8.0, 12.0, 16.0]
    assert p["layers"][0] == N_FEATURES + N_SCALE_TIME and p["layers"][-1] == 9
    env = ReplayEnv(spec, trace, instances="test")
    obs, _ = env.reset(options={"instance": "test-s5-t0"})
    assert obs.shape == (N_FEATURES + N_SCALE_TIME,)
    rule = autoscale.get_scaler(str(path), device="cpu").rule
    assert rule.scale_time and rule.has_guard and rule.guard_limit() is None


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_the_agent_in_the_env_and_the_exported_policy_pick_the_same_scales(trained, tmp_path, seed):
    """Replay: the agent's actions in the env and the exported policy driving the env give one
    trajectory; real steps: the agent in the env, the policy driving the env and the policy in a
    plain training loop give the same scales."""
    spec, trace, path = trained
    path = _randomised(path, tmp_path, seed)
    env = ReplayEnv(spec, trace, instances="test")
    agent_rule = autoscale.get_scaler(str(path), device="cpu").rule
    obs, _ = env.reset(options={"instance": "test-s5-t0"})
    agent, kinds = [], set()
    for _ in range(spec.episode.steps):
        action = int(agent_rule.act(obs.tolist()))
        kinds.add("drop" if action >= 5 else "delta")
        obs, *_ = env.step(action)
        agent.append(env.last_stats.scale)
    _, records = drive_episode(env, autoscale.get_scaler(str(path), device="cpu"), "test-s5-t0")
    assert [r.stats.scale for r in records] == agent
    assert len(set(agent)) > 1 and kinds == {"drop", "delta"}

    real = LossScaleEnv(spec, instances="test")
    obs, _ = real.reset(options={"instance": "test-s5-t0"})
    for _ in range(spec.episode.steps):
        obs, *_ = real.step(int(agent_rule.act(obs.tolist())))
    in_env = [r.scale for r in real.records]
    driven, _ = drive_episode(real, autoscale.get_scaler(str(path), device="cpu"), "test-s5-t0")
    assert [r.scale for r in real.records] == in_env
    deployed = autoscale.get_scaler(str(path), device="cpu")
    run = TrainingRun(spec.workload.replace(seed=5), deployed)
    for _ in range(spec.episode.steps):
        run.step()
    assert [r.scale for r in run.records] == in_env
    # its checkpoint carries the loss memory and the base scale
    state = deployed.state_dict()["autoscale"]["rule_state"]
    again = autoscale.get_scaler(str(path), device="cpu")
    again.load_state_dict(deployed.state_dict())
    assert (
        again.rule.loss_now.state_dict() == state["loss_now"] and again.rule.base == state["base"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_device_path_decides_as_the_host_path(trained, tmp_path, seed):
    """The device path (a CUDA scaler's: first layer split, the loss's half on the device) picks
    what the host path picks, here run on CPU tensors along a real episode."""
    spec, _, path = trained
    path = _randomised(path, tmp_path, seed)
    scaler = autoscale.get_scaler(str(path), device="cpu")
    rule, bounds = scaler.rule, scaler.controller.bounds
    run = TrainingRun(spec.workload.replace(seed=seed), scaler)
    picked = []
    for _ in range(spec.episode.steps):
        base = scaler.get_scale()
        for loss in (run.peek_loss(), 1e3, 1e-6, math.nan):
            host = rule.step_scale(base, loss, bounds)
            tensor = torch.tensor(1.0)
            out = rule.apply_step_scale(tensor, torch.tensor(loss), bounds, base, group=None)
            assert out is None and tensor.item() == host  # the CPU scaler's host path
            dev_bits = rule.device_bits(base, torch.tensor(abs(loss), dtype=torch.float64))
            assert bounds.clamp(base * 2.0 ** float(dev_bits)) == host
            picked.append(host / base)
        run.step()
    assert len(set(picked)) > 1


@pytest.mark.slow
def test_a_scale_time_manifest_that_does_not_fit_is_refused(trained, tmp_path):
    import shutil

    _, _, path = trained
    for change, match in (
        ({"scale_time": "yes"}, "scale_time"),
        ({"scale_time": False}, "inputs"),
        ({"guard": {"guard_history": 16, "guard_margin": 1.0}}, "both a guard and scale_time"),
        ({"action": {"mode": "discrete"}}, "picks among 9 actions"),
    ):
        copy = tmp_path / f"broken-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(path, copy)
        m = read_manifest(copy)
        write_manifest(copy, dataclasses.replace(m, parameters={**m.parameters, **change}))
        with pytest.raises(PolicyError, match=match):
            autoscale.get_scaler(str(copy), device="cpu")


@pytest.mark.slow
def test_train_agent_scale_time_flag(trained, tmp_path, capsys):
    import yaml

    from autoscale.cli import main

    _, trace, _ = trained
    plain = _episode(scale_time=False, action={})
    spec_file = tmp_path / "spiky.yaml"
    spec_file.write_text(yaml.safe_dump(plain))
    args = ["train-agent", "--env", str(spec_file), "--replay", str(trace), "--timesteps", "64"]
    args += ["--policy-dir", str(tmp_path / "pol"), "--quiet"]
    assert main([*args, "--out", "now", "--scale-time"]) == 0
    p = read_manifest(tmp_path / "pol" / "now").parameters
    assert p["scale_time"] is True and p["action"]["drops"] == [4.0, 8.0, 12.0, 16.0]
    capsys.readouterr()
    assert main([*args, "--out", "both", "--scale-time", "--guard"]) == 2
    err = capsys.readouterr().err
    assert "give one" in err and "Traceback" not in err


FIXTURE_NOW = Path(__file__).parents[1] / "scalers" / "fixtures" / "policies" / "fixture-neural-now"


def _train_step(model, opt, scaler, x, y, as_list=False):
    from tests.scalers.helpers import forward_loss

    opt.zero_grad()
    loss = forward_loss(model, x, y)
    scaled = scaler.scale([loss] if as_list else loss)
    (scaled[0] if as_list else scaled).backward()
    scaler.step(opt)
    scaler.update()
    return loss.item()


def test_a_scale_set_from_outside_is_the_base_the_policy_continues_from():
    """set_scale and update(new_scale) between steps move the base the next decision starts
    from and the step's scale is decoded against (not the base the policy set before)."""
    from tests.scalers.helpers import adamw, batches, tiny_model

    model = tiny_model()
    opt = adamw(model)
    scaler = autoscale.get_scaler(str(FIXTURE_NOW), device="cpu", init_scale=2.0**20)
    action = scaler.rule.action_map
    for i, (x, y) in enumerate(batches(12)):
        if i % 2:
            scaler.set_scale(2.0**8)
        set_to = scaler.get_scale()
        _train_step(model, opt, scaler, x, y)
        used = scaler.last_stats.scale
        assert scaler.get_scale() == scaler.controller.bounds.clamp(action.base_after(used, set_to))
        if i % 2:
            assert scaler.get_scale() <= 2.0**10  # from 2^8, at most +2 bits: never back to 2^20
    scaler.update(new_scale=2.0**6)  # no step: the next one starts from 2^6
    assert scaler.rule.base == 2.0**6


def test_a_step_without_a_single_element_loss_keeps_its_scale_and_says_why():
    from tests.scalers.helpers import adamw, batches, tiny_model

    model = tiny_model()
    opt = adamw(model)
    scaler = autoscale.get_scaler(str(FIXTURE_NOW), device="cpu", init_scale=2.0**10)
    (x, y), (x2, y2) = batches(2)
    with pytest.warns(UserWarning, match=r"pass the loss tensor itself: scaler.scale\(loss\)"):
        _train_step(model, opt, scaler, x, y, as_list=True)
    assert scaler.last_stats.scale == 2.0**10 and scaler.get_scale() == 2.0**10
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        _train_step(model, opt, scaler, x2, y2, as_list=True)


def test_a_delta_rounded_to_float32_is_not_read_as_a_drop():
    a = ActionMap(deltas=(-1.5, -0.5, 0.0, 0.5, 1.5), drops=(4.0,))
    from autoscale.scalers.controller import ScaleBounds

    bounds = ScaleBounds.of(1.0, 2.0**40)
    for k in range(200):
        base = bounds.clamp(2.0 ** (k / 7.0))
        used = bounds.clamp(base * 2.0**-1.5)
        assert a.base_after(used, base) == used, base
        dropped = bounds.clamp(base * 2.0**-4)
        if dropped > 1.0:
            assert a.base_after(dropped, base) == base


@pytest.mark.slow
def test_replay_shows_the_loss_the_scaler_sees_on_a_weighted_loss(tmp_path):
    """The `moving` scenario multiplies the loss by a weight that spikes 4096x: the scaler (and
    so a deployed policy) sees the weighted loss. Replay reads that loss from the trace
    (``step_loss``), not the training loss, so an agent trained on replay sees the jump it
    will see deployed; the scorecard keeps the training loss."""
    data = _episode(steps=10)
    data["workload"] = {
        "model": "mlp", "scenario": "moving", "dtype": "fp16",
        "scenario_params": {"at": 5, "width": 3, "peak": 4096.0},
    }  # fmt: skip
    spec = load_env_spec(data)
    trace = record_trace(spec, 12, None, instances=("test",))
    t = trace.instance("test-s5-t0")
    weight = t.step_loss / t.loss
    assert weight[5] == pytest.approx(4096.0, rel=1e-3) and weight[0] == pytest.approx(1.0)
    jumps = {}
    for env in (ReplayEnv(spec, trace, instances="test"), LossScaleEnv(spec, instances="test")):
        obs, _ = env.reset(options={"instance": "test-s5-t0"})
        seen = []
        for _ in range(spec.episode.steps - 1):
            obs, *_ = env.step(2)  # keep the scale
            seen.append(float(obs[N_FEATURES]))  # loss_jump of the next step's loss
        jumps[type(env).__name__] = seen
        records = env.episode_records()
        assert records[5].loss == pytest.approx(float(t.loss[5]), rel=0.2)  # training loss
    replay, real = jumps["ReplayEnv"], jumps["LossScaleEnv"]
    # the weight ramps 16x, 256x, 4096x into step 5: each step's loss jumps above the average
    assert min(replay[2:5]) > 0.9 and min(real[2:5]) > 0.9
    np.testing.assert_allclose(replay, real, atol=0.1)
