"""Residual agents: an offset on ``auto``'s scale, once a window, ``auto``'s guard and backoff as a
shield, trained to the bar (torch's replay of the same episode, Lagrange multipliers), exported as
``kind: residual`` and run by ``get_scaler`` as they ran in the environment."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import autoscale
from autoscale.envs import LossScaleEnv, ReplayEnv, record_trace
from autoscale.envs.episodes import drive_episode, scaler_for
from autoscale.envs.limit import hindsight_limit, limit_share
from autoscale.envs.residual_env import Multipliers, ResidualEnv
from autoscale.envs.spec import load_env_spec
from autoscale.envs.traces import Trace
from autoscale.errors import PolicyError
from autoscale.scalers.controller import StepStats
from autoscale.scalers.policies import read_manifest, write_manifest
from autoscale.scalers.residual import N_OBSERVATION, ResidualRule
from autoscale.scalers.scaler import LossScaler

SPEC = {
    "name": "spiky",
    "workload": {"model": "mlp", "scenario": "preference", "dtype": "fp16"},
    "episode": {"steps": 48, "horizon": 48, "init_scale": 2**10, "min_scale": 1.0,
                "max_scale": 2**30},
    "instances": {"train": [{"seed": 0}, {"seed": 1, "start": 4}], "test": [{"seed": 5}]},
}  # fmt: skip
BOUNDS = {"init_scale": 2**10, "min_scale": 1.0, "max_scale": 2**30}


@pytest.fixture(scope="module")
def spec():
    return load_env_spec(SPEC)


@pytest.fixture(scope="module")
def trace(spec, tmp_path_factory):
    path = tmp_path_factory.mktemp("residual") / "spiky.npz"
    record_trace(spec, 64, path)
    return path


def residual_scaler(spec, decide=None, window=8) -> LossScaler:
    rule = ResidualRule(scaler_for("auto", spec).controller.rule, window=window, decide=decide)
    return LossScaler(rule, "cpu", name="residual", **BOUNDS)


def test_offset_zero_is_auto_exactly_on_real_steps(spec):
    env = LossScaleEnv(spec, instances="test")
    _, mine = drive_episode(env, residual_scaler(spec, decide=lambda obs: 4), "test-s5-t0")
    _, ref = drive_episode(env, scaler_for("auto", spec), "test-s5-t0")
    assert [r.scale for r in mine] == [r.scale for r in ref]
    assert [r.found_inf for r in mine] == [r.found_inf for r in ref]
    assert any(r.stats.guarded for r in ref)  # the guard acted: the identity covers it


def test_offset_zero_in_the_env_is_auto_exactly_on_replay(spec, trace):
    ref_env = ReplayEnv(spec, trace)
    _, ref = drive_episode(ref_env, scaler_for("auto", spec), "train-s0-t0")
    env = ResidualEnv(spec, "train", trace, window=8)
    env.reset(seed=0, options={"instance": "train-s0-t0"})
    scales, done = [], False
    while not done:
        _, _, term, trunc, _ = env.step(4)  # offset 0
        scales += [s.scale for s, _ in env.inner.records[len(scales) :]]
        done = term or trunc
    assert scales == [r.scale for r in ref]


def _stats(step, scale, found_inf=False, amax=1.0, loss=1.0, guarded=False):
    return StepStats(step, scale, found_inf, math.inf if found_inf else amax, 0.1, loss, True,
                     guarded)  # fmt: skip


def test_the_shield_no_rise_over_an_overflow_and_the_guard_stays():
    from autoscale.scalers.rules.amax import AmaxLossRule

    rule = ResidualRule(AmaxLossRule(probe_after=8), window=2, decide=lambda obs: 0)  # -4 bits
    scale = rule.start(2.0**10)
    assert scale == 2.0**6  # the first decision, from the start
    rule.decide = lambda obs: 8  # +4 bits at the next window's end
    scale = rule.next_scale(scale, _stats(0, scale, amax=2.0**-4))
    base = rule.rule_scale
    # the window ends on an overflow: the offset may not rise over it; the rule backs off
    scale2 = rule.next_scale(scale, _stats(1, scale, found_inf=True))
    assert rule.offset == -4.0 and scale2 == rule.rule_scale * 2.0**-4
    assert rule.rule_scale <= base * 2.0**-4 * 0.5 * 2.0**4  # the rule's own backoff
    # a clean window later the rise goes through
    scale3 = rule.next_scale(scale2, _stats(2, scale2, amax=2.0**-4))
    scale4 = rule.next_scale(scale3, _stats(3, scale3, amax=2.0**-4))
    assert rule.offset == 4.0 and scale4 == rule.rule_scale * 2.0**4
    assert rule.guard_limit() == rule.base.guard_limit() is not None  # the base's guard


def test_the_guard_lowers_steps_under_any_offset(spec, trace):
    env = ReplayEnv(spec, trace)
    _, recs = drive_episode(env, residual_scaler(spec, decide=lambda obs: 8), "train-s0-t0")
    guarded = [r for r in recs if r.stats.guarded]
    assert guarded, "a +4 bit offset on the preference loss must meet the guard"
    rule_ref = scaler_for("auto", spec).controller.rule
    assert all(r.scale < 2.0**30 for r in guarded) and rule_ref.has_guard


def test_the_constraint_pays_for_skips_beyond_torch_and_the_multipliers_move(spec, trace):
    env = ResidualEnv(spec, "train", trace, window=8, multipliers=Multipliers(rate=100.0))
    env.reset(seed=0, options={"instance": "train-s0-t0"})
    done, info = False, {}
    while not done:
        _, _, term, trunc, info = env.step(8)  # +4 bits everywhere: overflows
        done = term or trunc
    c = info["constraint"]
    assert c["skip_rate"] > c["torch_skip_rate"] + 0.005
    assert c["skip_violation"] == pytest.approx(c["skip_rate"] - c["torch_skip_rate"] - 0.005)
    assert env.multipliers.skip == pytest.approx(1.0 + 100.0 * c["skip_violation"])
    env.reset(seed=0, options={"instance": "train-s0-t0"})
    before, done = env.multipliers.skip, False
    while not done:
        _, _, term, trunc, info = env.step(4)  # auto itself: no skip beyond torch's
        done = term or trunc
    assert info["constraint"]["skip_violation"] <= 0 and env.multipliers.skip < before
    m = Multipliers(skip=0.5, rate=10.0)
    m.update(-0.2, 0.0)
    assert m.skip == 0.0  # never below 0


def test_under_knobs_torchs_reference_replays_the_same_draw(spec, trace):
    from autoscale.envs.knobs import Knobs

    knobs = Knobs(plain=0.0, weight_bits=(4.0, 4.0), drift_bits=(0.0, 0.0), spike=1.0,
                  spike_bits=(12.0, 12.0), spike_width=(4, 4), bad=0.0)  # fmt: skip
    env = ResidualEnv(spec, "train", trace, window=8, knobs=knobs)
    _, info = env.reset(seed=3, options={"instance": "train-s0-t0"})
    draw = env.inner.episode_knobs
    assert info["knobs"] is not None and draw is not None and max(draw.gain) >= 12.0
    # torch on the same draw, driven apart: the very reference the constraint pays against
    _, same = drive_episode(ReplayEnv(spec, trace), scaler_for("torch", spec), "train-s0-t0",
                            knobs=draw)  # fmt: skip
    _, plain = drive_episode(ReplayEnv(spec, trace), scaler_for("torch", spec), "train-s0-t0")
    assert env._ref[0] == [r.found_inf for r in same]
    assert sum(env._ref[0]) > sum(r.found_inf for r in plain)  # the spike costs torch skips too
    done = False
    while not done:
        _, _, term, trunc, info = env.step(4)  # auto under the same spike
        done = term or trunc
    assert info["constraint"]["torch_skip_rate"] == sum(env._ref[0]) / len(env._ref[0])
    with pytest.raises(Exception, match="knobs apply to replayed steps"):
        ResidualEnv(spec, "train", None, knobs=knobs)


def test_the_limit_is_what_a_hindsight_driver_reaches(spec, trace):
    t = Trace.load(trace)
    lim = hindsight_limit(t.instance("train-s0-t0"), t.hist_edges, 0, 48, min_scale=1.0,
                          max_scale=2.0**30)  # fmt: skip
    env = ReplayEnv(spec, t)
    env.reset(options={"instance": "train-s0-t0"})
    kept, skipped = [], 0
    for s in lim.log2_scale:
        stats, precision, _ = env._take(1.0 if math.isnan(s) else 2.0**s)
        skipped += stats.found_inf and not stats.loss_nonfinite
        if not stats.found_inf:
            kept.append(precision)
    assert skipped == 0
    assert float(np.mean(kept)) == pytest.approx(lim.mean_precision_loss, abs=1e-9)
    torch_card, _ = drive_episode(env, scaler_for("torch", spec), "train-s0-t0")
    assert lim.mean_precision_loss <= torch_card.precision_loss
    assert limit_share(0.4, 0.1, 0.0) == pytest.approx(0.75)
    assert limit_share(0.4, 0.5, 0.0) < 0
    assert limit_share(0.1, 0.1, 0.1) is None and limit_share(math.nan, 0.1, 0.0) is None


@pytest.mark.slow
def test_an_exported_residual_agent_runs_as_it_ran_in_the_env(spec, trace, tmp_path):
    from autoscale.agents.residual import train_residual

    result = train_residual(spec, "ppo", 128, replay=trace, window=8, export_name="res",
                            export_dir=str(tmp_path), eval_freq=64)  # fmt: skip
    path = result.policy_dir
    m = read_manifest(path)
    assert m.kind == "residual" and m.parameters["layers"][0] == N_OBSERVATION
    assert m.parameters["base"]["family"] == "amax-loss"
    # the same episode driven by the SB3 model in the env and by the exported scaler
    env = ResidualEnv(spec, "test", trace, window=8, constrained=False)
    obs, _ = env.reset(seed=0, options={"instance": "test-s5-t0"})
    done = False
    while not done:
        action, _ = result.model.predict(obs, deterministic=True)
        obs, _, term, trunc, _ = env.step(int(action))
        done = term or trunc
    in_env = [s.scale for s, _ in env.inner.records]
    _, recs = drive_episode(ReplayEnv(spec, trace, instances="test"), scaler_for(str(path), spec),
                            "test-s5-t0")  # fmt: skip
    assert [r.scale for r in recs] == in_env
    # a plain loop, checkpointed mid-run, continues identically
    scaler = autoscale.get_scaler(str(path), device="cpu")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def steps(s, n, seed):
        g = torch.Generator().manual_seed(seed)
        out = []
        for i in range(n):
            x = torch.randn(8, 4, generator=g) * (1000.0 if i % 5 == 4 else 1.0)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            s.scale(loss).backward()
            s.step(opt)
            s.update()
            out.append(s.get_scale())
        return out

    steps(scaler, 12, 0)
    state = scaler.state_dict()
    params = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    a = steps(scaler, 12, 1)
    model.load_state_dict(params)
    opt.load_state_dict(opt_state)
    resumed = autoscale.get_scaler(str(path), device="cpu")
    resumed.load_state_dict(state)
    assert steps(resumed, 12, 1) == a


def test_a_corrupt_or_foreign_residual_policy_is_refused(spec, trace, tmp_path):
    from autoscale.agents.residual import train_residual

    result = train_residual(spec, "dqn", 32, replay=trace, window=8, export_name="res",
                            export_dir=str(tmp_path), eval_freq=32)  # fmt: skip
    path = result.policy_dir
    autoscale.get_scaler(str(path), device="cpu")
    m = read_manifest(path)
    base = {**m.parameters["base"], "family": "no-such-rule"}
    write_manifest(
        path, m.__class__(**{**m.to_dict(), "parameters": {**m.parameters, "base": base}})
    )
    with pytest.raises(PolicyError, match="no-such-rule"):
        autoscale.get_scaler(str(path), device="cpu")
    write_manifest(path, m)
    (path / "weights.pt").write_bytes(b"not weights")
    with pytest.raises(PolicyError, match="checksum"):
        autoscale.get_scaler(str(path), device="cpu")


def test_eval_on_replay_gives_the_limit_and_each_share(spec, trace, tmp_path, capsys):
    import yaml

    from autoscale.cli import main

    path = tmp_path / "spiky.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    out_json = tmp_path / "eval.json"
    args = ["eval", "--policy", "auto", "--env", str(path), "--replay", str(trace),
            "--against", "torch", "--quiet", "--json", str(out_json)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    import json

    data = json.loads(out_json.read_text())
    p_limit = data["limit"]["precision_loss"]
    t = Trace.load(trace)
    lim = hindsight_limit(t.instance("test-s5-t0"), t.hist_edges, 0, 48, min_scale=1.0,
                          max_scale=2.0**30)  # fmt: skip
    assert p_limit == pytest.approx(lim.mean_precision_loss)
    mean = {k: v["summary"]["precision_loss"]["mean"] for k, v in data["scalers"].items()}
    share = limit_share(mean["torch"], mean["auto"], p_limit)
    assert f"hindsight limit: precision loss {100 * p_limit:.2f}%" in out
    assert re.search(rf"^  auto +{share:.3f}$", out, re.M)


def test_train_agent_residual_from_the_command_line(spec, trace, tmp_path, capsys):
    import yaml

    from autoscale.cli import main

    path = tmp_path / "spiky.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    args = ["train-agent", "--env", str(path), "--replay", str(trace), "--residual", "--window",
            "8", "--timesteps", "64", "--out", "res-cli", "--policy-dir", str(tmp_path), "--quiet"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "trained a residual ppo agent on auto for 64 decisions of 8 steps" in out
    assert "selected on the held-out train instance(s)" in out
    m = read_manifest(tmp_path / "res-cli")
    assert m.kind == "residual" and m.parameters["window"] == 8
    assert main(["train-agent", "--env", str(path), "--residual", "--out", "x"]) == 2
    assert "--residual trains on replay: give --replay TRACE" in capsys.readouterr().err
