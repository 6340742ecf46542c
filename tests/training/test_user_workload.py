"""A user's own workload (``module:factory``) wherever a model goes: the protocol, its errors,
real fp16 steps, scenarios, snapshots, and the commands."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autoscale.cli import main
from autoscale.errors import ConfigError
from autoscale.training import TrainingRun, WorkloadSpec

ROOT = Path(__file__).resolve().parents[2]
CNN = str(ROOT / "experiments" / "workloads" / "cnn.py") + ":make"
DENOISE = str(ROOT / "experiments" / "workloads" / "denoise.py") + ":make"

MODULE = textwrap.dedent(
    """
    import torch

    def make(seed, device):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(seed)
        data = [(torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)) for _ in range(6)]
        return {
            "model": model,
            "optimizer": opt,
            "batches": data,
            "loss": lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).float(), b[1]),
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        }

    def no_model(seed, device):
        return {"optimizer": None, "batches": [], "loss": None}

    def raises(seed, device):
        raise RuntimeError("dataset not found")

    def fp32_only(seed, device):
        m = torch.nn.Sequential(torch.nn.ReLU())
        m.w = torch.nn.Parameter(torch.ones(3))
        return {"model": m, "optimizer": torch.optim.SGD(m.parameters(), lr=0.1),
                "batches": [torch.ones(2, 3)] * 8, "loss": lambda mm, b: (mm(b) * mm.w).sum()}

    def vector_loss(seed, device):
        m = torch.nn.Linear(3, 2)
        return {"model": m, "optimizer": torch.optim.SGD(m.parameters(), lr=0.1),
                "batches": [torch.ones(2, 3)] * 8, "loss": lambda mm, b: mm(b).float()}

    def foreign_optimizer(seed, device):
        m = torch.nn.Linear(3, 2)
        return {"model": m, "optimizer": torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1),
                "batches": [torch.ones(2, 3)] * 8, "loss": lambda mm, b: mm(b).float().sum()}
    """
)


@pytest.fixture()
def module(tmp_path, monkeypatch):
    (tmp_path / "userwl.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "userwl"
    sys.modules.pop("userwl", None)


def test_real_fp16_steps_with_the_scenario_and_the_users_schedule(module):
    run = TrainingRun(
        WorkloadSpec(model=f"{module}:make", scenario="bad-batches", scenario_params={"every": 3}),
        "torch",
    )
    assert run.built.kind == "user" and run.optimizer is run.user.optimizer
    records = [run.step() for _ in range(6)]
    assert [r.found_inf for r in records] == [False, False, True, False, False, True]
    # StepLR halves after every applied step only: 0.05, 0.025, (skipped) 0.0125, 0.0125, ...
    assert [r.lr for r in records] == pytest.approx(
        [0.05, 0.025, 0.0125, 0.0125, 0.00625, 0.003125]
    )
    assert all(math.isfinite(r.loss) for r in records if not r.found_inf)
    assert math.isfinite(run.eval_loss())  # on the held-out first batches (no eval callable)


def test_a_snapshot_restores_model_optimizer_schedule_and_batches(module):
    run = TrainingRun(WorkloadSpec(model=f"{module}:make", scenario="clean"), "torch")
    run.step()
    snap = run.snapshot()
    first = [(r.loss, r.lr) for r in (run.step() for _ in range(5))]  # past the 6 batches: cycled
    run.restore(snap)
    again = [(r.loss, r.lr) for r in (run.step() for _ in range(5))]
    assert first == again


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("no_model", "the factory's value has no model"),
        ("raises", "the factory raised RuntimeError: dataset not found"),
        ("fp32_only", "ran no op in fp16 under autocast"),
        ("vector_loss", r"loss must return a scalar tensor, got \(2, 2\)"),
        ("foreign_optimizer", "the optimizer must hold the model's own parameters"),
        ("missing", "has no callable 'missing' \\(it defines"),
    ],
)
def test_a_broken_workload_is_one_line(module, factory, message):
    with pytest.raises(ConfigError, match=message):
        run = TrainingRun(WorkloadSpec(model=f"{module}:{factory}"), "torch")
        run.step()


def test_module_errors_and_preference_are_refused(module):
    with pytest.raises(ConfigError, match="'nosuchmodule' does not import \\(ModuleNotFoundError"):
        TrainingRun(WorkloadSpec(model="nosuchmodule:make"), "torch")
    with pytest.raises(ConfigError, match="no file 'missing/file.py'"):
        TrainingRun(WorkloadSpec(model="missing/file.py:make"), "torch")
    with pytest.raises(ConfigError, match="preference scenario needs a language-model preset"):
        TrainingRun(WorkloadSpec(model=f"{module}:make", scenario="preference"), "torch")


def test_commands_take_workload_and_refuse_in_one_line_writing_nothing(module, tmp_path, capsys):
    assert (
        main(["run", "--workload", f"{module}:make", "--scenario", "bad-batches", "--steps", "10"])
        == 0
    )
    assert "skipped            1 (10.00%)" in capsys.readouterr().out
    assert main(["search", "--workload", f"{module}:raises", "--budget", "1m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "autoscale search: error: workload 'userwl:raises': the factory raised RuntimeError: "
        "dataset not found (called with seed=0, device='cpu')"
    ]
    assert not (tmp_path / "autoscale.db").exists() and not (tmp_path / "policies").exists()
    assert (
        main(["record", "--workload", f"{module}:no_model", "--steps", "4", "--out", "t.npz"]) == 2
    )
    assert not (tmp_path / "t.npz").exists()


@pytest.mark.slow
def test_the_example_workloads_train(tmp_path):
    """experiments/workloads/: a CNN classifier and a denoising autoencoder, as the README runs them."""
    cnn = TrainingRun(WorkloadSpec(model=CNN, scenario="clean", lr=2e-3), "torch")
    before = cnn.eval_loss()
    cnn.run(60)
    assert cnn.eval_loss() < before  # it learns
    den = TrainingRun(WorkloadSpec(model=DENOISE, scenario="small-grads"), "torch")
    card = den.run(10)
    assert card.precision_loss > 0  # a loss weighted down: gradients lost at torch's scale


@pytest.mark.slow
def test_module_form_on_pythonpath_and_env_yaml(tmp_path):
    """``PYTHONPATH=experiments/workloads autoscale record --workload cnn:make`` and an env YAML
    naming the workload."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "experiments" / "workloads"),
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoscale",
            "record",
            "--workload",
            "cnn:make",
            "--steps",
            "16",
            "--out",
            str(tmp_path / "cnn.npz"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    from autoscale.envs.traces import Trace

    trace = Trace.load(tmp_path / "cnn.npz")
    assert trace.spec["workload"]["model"] == "cnn:make" and len(trace.instances) == 6
    (tmp_path / "cnn.yaml").write_text(
        "name: cnn-bad\nworkload:\n  model: cnn:make\n  scenario: bad-batches\n"
        "episode: {steps: 8}\ninstances:\n  train: [{seed: 0}]\n  test: [{seed: 5}]\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoscale",
            "eval",
            "--policy",
            "auto",
            "--env",
            str(tmp_path / "cnn.yaml"),
            "--against",
            "torch",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "auto" in out.stdout and "torch" in out.stdout
