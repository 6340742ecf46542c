import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import autoscale
from autoscale.agents.evaluate import evaluate_scalers
from autoscale.agents.train import train_agent
from autoscale.envs import LossScaleEnv, ReplayEnv
from autoscale.errors import ConfigError, PolicyError, UnknownNameError
from autoscale.scalers.neural import NeuralPolicyRule
from autoscale.scalers.policies import read_manifest, write_manifest


@pytest.fixture(scope="module")
def agents(tiny_spec, tiny_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("policies")
    trained = {
        algo: train_agent(
            tiny_spec, algo, 600, replay=tiny_trace, export_name=f"tiny-{algo}", export_dir=str(out)
        )
        for algo in ("ppo", "dqn")
    }
    return out, trained


def _recorded_observations(tiny_spec, tiny_trace, n=1000):
    env = ReplayEnv(tiny_spec, tiny_trace)
    rng = np.random.default_rng(0)
    obs, _ = env.reset(seed=0)
    seen = [obs]
    while len(seen) < n:
        obs, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
        seen.append(obs)
        if term or trunc:
            obs, _ = env.reset()
            seen.append(obs)
    return np.stack(seen[:n])


@pytest.mark.parametrize("algo", ["ppo", "dqn"])
def test_exported_policy_acts_like_sb3(agents, tiny_spec, tiny_trace, algo):
    out, trained = agents
    model = trained[algo].model
    scaler = autoscale.get_scaler(str(out / f"tiny-{algo}"), device="cpu")
    assert isinstance(scaler.rule, NeuralPolicyRule)
    obs = _recorded_observations(tiny_spec, tiny_trace)
    expected, _ = model.predict(obs, deterministic=True)
    got = np.array([scaler.rule.act(o.tolist()) for o in obs])
    assert len(obs) == 1000 and len(np.unique(obs, axis=0)) > 20
    np.testing.assert_array_equal(got, expected)


def test_manifest_records_workload_and_test_scorecard(agents):
    out, _ = agents
    m = read_manifest(out / "tiny-ppo")
    assert m.kind == "neural" and m.feature_version == 1
    assert m.workload["scenario"] == "bad-batches" and m.workload["trained_on"] == "replay"
    assert m.scorecard["steps"] == 8 and 0 <= m.scorecard["skip_rate"] <= 1
    assert len(m.weights_sha256) == 64


def test_features_in_env_equal_features_in_deployed_scaler(agents, tiny_spec):
    """Observation parity: the env and a deployed policy in a plain training loop see the same."""
    from autoscale.training import TrainingRun

    out, _ = agents
    name = str(out / "tiny-ppo")
    env = LossScaleEnv(tiny_spec, instances="test")
    in_env = autoscale.get_scaler(name, device="cpu")
    env_features = []
    _, info = env.reset(options={"instance": "test-s5-t0"})
    scale = in_env.controller.start(info["scale"], env.features.state_dict())
    for _ in range(tiny_spec.episode.steps):
        obs, *_ = env.step_at(scale)
        env_features.append(obs.tolist())
        scale = in_env.controller.step(env.last_stats)
    deployed = autoscale.get_scaler(name, device="cpu")
    run = TrainingRun(tiny_spec.workload.replace(seed=5), deployed)
    loop_features = []
    for _ in range(tiny_spec.episode.steps):
        run.step()
        loop_features.append(deployed.rule.features.features(deployed.last_stats.scale))
    np.testing.assert_array_equal(np.float32(loop_features), np.float32(env_features))
    assert [r.scale for r in run.records] == [r.scale for r in env.records]


@pytest.mark.slow
def test_policy_in_plain_loop_without_learning_libraries(agents, tmp_path):
    out, _ = agents
    code = """
import sys, torch, autoscale
scaler = autoscale.get_scaler("tiny-ppo", device="cpu")
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(5):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
assert scaler.steps == 5, scaler.steps
print(sorted(m for m in ("stable_baselines3", "gymnasium", "optuna") if m in sys.modules))
"""
    env = {"AUTOSCALE_POLICY_PATH": str(out), "PATH": "/usr/bin:/bin"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_and_incompatible_policies_are_refused(agents, tmp_path):
    out, _ = agents
    corrupt = _copy(out / "tiny-ppo", tmp_path / "corrupt")
    data = bytearray((corrupt / "weights.pt").read_bytes())
    data[-20] ^= 0xFF
    (corrupt / "weights.pt").write_bytes(bytes(data))
    with pytest.raises(PolicyError, match="checksum .* does not match"):
        autoscale.get_scaler(str(corrupt), device="cpu")
    other = _copy(out / "tiny-ppo", tmp_path / "other")
    write_manifest(other, dataclasses.replace(read_manifest(other), feature_version=0))
    with pytest.raises(
        PolicyError, match="reads feature spec version 0, this autoscale computes version 1"
    ):
        autoscale.get_scaler(str(other), device="cpu")
    missing = _copy(out / "tiny-ppo", tmp_path / "missing")
    (missing / "weights.pt").unlink()
    with pytest.raises(PolicyError, match="has no weights.pt"):
        autoscale.get_scaler(str(missing), device="cpu")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "policy.yaml").write_text("name: [unclosed\n")
    with pytest.raises(PolicyError, match="cannot read"):
        autoscale.get_scaler(str(broken), device="cpu")


def test_export_never_overwrites_without_force(agents, tiny_spec, tiny_trace):
    out, _ = agents
    before = (out / "tiny-ppo" / "weights.pt").read_bytes()
    with pytest.raises(
        ConfigError, match=r"already exists; choose another name \(--out NAME\) or pass --force"
    ):
        train_agent(
            tiny_spec, "ppo", 64, replay=tiny_trace, export_name="tiny-ppo", export_dir=str(out)
        )
    assert (out / "tiny-ppo" / "weights.pt").read_bytes() == before


def test_unknown_or_unfit_algorithm(tiny_spec):
    with pytest.raises(UnknownNameError, match="unknown algorithm 'ppo2'; did you mean 'ppo'"):
        train_agent(tiny_spec, "ppo2", 64)
    with pytest.raises(ConfigError, match="sac cannot use discrete actions"):
        train_agent(tiny_spec, "sac", 64)


def test_policy_scaler_checkpoint_round_trip(agents):
    out, _ = agents
    a = autoscale.get_scaler(str(out / "tiny-dqn"), device="cpu")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # a positive loss: the features keep it (a negative one leaves them NaN)
        a.scale(model(torch.randn(2, 4)).pow(2).sum()).backward()
        a.step(opt)
        a.update()
    state = a.state_dict()
    torch.save(state, out / "s.pt")
    b = autoscale.get_scaler(str(out / "tiny-dqn"), device="cpu")
    b.load_state_dict(torch.load(out / "s.pt", weights_only=True))
    assert b.get_scale() == a.get_scale()
    assert math.isfinite(a.rule.features.state_dict()["loss_ema"])
    assert b.rule.features.state_dict() == a.rule.features.state_dict()


@pytest.mark.slow
def test_evaluate_and_cli(agents, tiny_spec, tiny_trace, tmp_path, monkeypatch, capsys):
    from autoscale.cli import main

    out, _ = agents
    cards = evaluate_scalers(tiny_spec, ["torch", str(out / "tiny-ppo")], seeds=2)
    assert len(cards["torch"]) == 4  # 2 test instances x 2 seeds
    spec_file = tmp_path / "tiny.yaml"
    import yaml

    spec_file.write_text(yaml.safe_dump(tiny_spec.to_dict()))
    monkeypatch.setenv("AUTOSCALE_POLICY_PATH", str(out))
    code = main(
        [
            "eval",
            "--policy",
            "tiny-ppo",
            "--env",
            str(spec_file),
            "--replay",
            str(tiny_trace),
            "--against",
            "torch,amax-history",
            "--json",
            str(tmp_path / "e.json"),
            "--plot",
            str(tmp_path / "e.png"),
            "--quiet",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "tiny-ppo" in printed and "amax-history" in printed
    data = json.loads((tmp_path / "e.json").read_text())
    assert set(data["scalers"]) == {"tiny-ppo", "torch", "amax-history"}
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "--policy", "nope", "--env", str(spec_file), "--quiet"]) == 2
    assert "unknown scaler 'nope'" in capsys.readouterr().err
    code = main(
        [
            "train-agent",
            "--env",
            str(spec_file),
            "--replay",
            str(tiny_trace),
            "--timesteps",
            "64",
            "--out",
            "cli-agent",
            "--policy-dir",
            str(tmp_path / "pol"),
            "--quiet",
        ]
    )
    assert code == 0 and (tmp_path / "pol" / "cli-agent" / "weights.pt").is_file()


def test_a_policy_with_history_sees_in_deployment_the_stack_it_was_trained_on(tiny_spec, tmp_path):
    """Frame stacking: the env's observation is the last 3 feature vectors; the exported policy
    stacks the same way, so SB3's action on each env observation is the deployed scaler's."""
    from autoscale.envs import record_trace
    from autoscale.scalers.features import N_FEATURES
    from autoscale.training import TrainingRun

    spec = dataclasses.replace(tiny_spec, episode=dataclasses.replace(tiny_spec.episode, history=3))
    trace = record_trace(spec, 16, tmp_path / "t.npz")
    result = train_agent(
        spec, "ppo", 512, replay=trace, export_name="stacked", export_dir=str(tmp_path)
    )
    m = read_manifest(tmp_path / "stacked")
    assert m.parameters["history"] == 3 and m.parameters["layers"][0] == 3 * N_FEATURES
    env = LossScaleEnv(spec, instances="test")
    assert env.observation_space.shape == (3 * N_FEATURES,)
    obs, info = env.reset(options={"instance": "test-s5-t0"})
    assert np.array_equal(obs[:N_FEATURES], obs[-N_FEATURES:])  # the first vector fills the stack
    deployed = autoscale.get_scaler(str(tmp_path / "stacked"), device="cpu")
    run = TrainingRun(spec.workload.replace(seed=5), deployed)
    for _ in range(spec.episode.steps):
        expected, _ = result.model.predict(obs, deterministic=True)
        # the scale the deployed policy chose for its next step is the one SB3's action asks for
        assert deployed.get_scale() == env.bounds.clamp(
            env.scale * 2.0 ** spec.episode.action.delta(expected)
        )
        obs, *_ = env.step(expected)
        run.step()
        np.testing.assert_array_equal(
            np.float32(deployed.rule.stack.vector()), obs
        )  # the same stacked observation after each step


def test_training_leaves_nothing_in_the_temporary_folder(tiny_spec, tiny_trace, tmp_path):
    """SB3's default logger makes an empty ``SB3-<time>`` folder in the temporary folder on every
    training run; without a TensorBoard folder, training runs with no log folder at all."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    before, tempfile.tempdir = tempfile.tempdir, str(scratch)
    try:
        train_agent(tiny_spec, "ppo", 64, replay=tiny_trace, export_name="tiny-tmp",
                    export_dir=str(tmp_path / "out"))  # fmt: skip
    finally:
        tempfile.tempdir = before
    assert list(scratch.iterdir()) == []
