"""Trials in process: the RL objective and the export of its stored policy, and the trial loop's
handling of failures and interrupts (mlp traces: fast)."""

from __future__ import annotations

import math
import time

import optuna
import pytest

from autoscale.scalers import LossScaler, get_scaler
from autoscale.scalers.policies import read_manifest
from autoscale.search.budget import Ledger
from autoscale.search.export import export_trial, trial_factory
from autoscale.search.loop import TrialLoop
from autoscale.search.plan import Timing, shape_spec
from autoscale.search.space import parametric_families
from autoscale.search.storage import artifact_store, open_storage
from autoscale.search.traces import load_traces
from autoscale.search.trials import ParametricObjective, ReplayBench, RLObjective, TrialRecorder
from autoscale.search.workload import base_spec

optuna.logging.set_verbosity(optuna.logging.WARNING)
TrialState = optuna.trial.TrialState


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("trials")
    spec = shape_spec(base_spec(model="mlp"), 16, 2, 1)
    trace, stats = load_traces(
        spec, root / "artifacts", timing=Timing(0.01, 0.1, 0.01, 4), stop_at=math.inf
    )
    assert stats["recorded"] == 4 and set(trace.instances) == {
        i.name for g in spec.instances.values() for i in g
    }
    again, stats = load_traces(
        spec, root / "artifacts", timing=Timing(0.01, 0.1, 0.01, 4), stop_at=0
    )
    assert stats == {"recorded": 0, "cached": 4, "steps": 0, "wall_s": 0.0}  # all from the cache
    return root, spec, trace


def _study(root, name):
    storage = open_storage(f"sqlite:///{root / 'trials.db'}")
    return optuna.create_study(study_name=name, storage=storage, direction="minimize")


def _parts(root, spec, trace, ledger):
    bench = ReplayBench(spec, trace)
    store = artifact_store(root / "artifacts")
    work = root / "work"
    work.mkdir(exist_ok=True)
    return bench, store, TrialRecorder(bench, store, ledger, work, warn=print), work


@pytest.mark.slow
def test_rl_trial_stores_its_policy_and_exports_it_later(setup):
    root, spec, trace = setup
    ledger = Ledger()
    bench, store, recorder, work = _parts(root, spec, trace, ledger)
    study = _study(root, "rl")
    objective_fn = RLObjective(
        bench, recorder, ledger, stop_at=time.monotonic() + 6, seed=0, workdir=work
    )
    counts = {"complete": 0, "pruned": 0, "failed": 0}
    loop = TrialLoop(study, ledger, worker="test:1", warn=print, counts=counts, n_trials=1)
    loop.run(objective_fn, time.monotonic() + 60)
    (trial,) = study.get_trials()
    assert (
        counts == {"complete": 1, "pruned": 0, "failed": 0} and trial.state == TrialState.COMPLETE
    )
    policy = trial.user_attrs["policy"]
    assert policy["kind"] == "neural" and policy["algo"] in ("ppo", "a2c", "dqn")
    assert policy["timesteps"] > 0 and policy["artifact_id"]
    assert ledger.total("work:rl") > 1.0

    scaler = trial_factory(trial, spec, store, work / "extract")()
    assert type(scaler.rule).__name__ == "NeuralPolicyRule" and isinstance(scaler, LossScaler)
    assert spec.episode.min_scale <= scaler.get_scale() <= spec.episode.max_scale
    path = export_trial(
        study, trial, "rl-policy", spec=spec, store=store, out_dir=root / "policies"
    )
    m = read_manifest(path)
    assert m.kind == "neural" and m.name == "rl-policy"
    assert m.workload["study"] == "rl" and m.workload["trial"] == trial.number
    assert isinstance(get_scaler(str(path), device="cpu"), LossScaler)


def test_loop_fails_a_raising_trial_and_goes_on(setup):
    root, spec, trace = setup
    ledger = Ledger()
    bench, _, recorder, _ = _parts(root, spec, trace, ledger)
    study = _study(root, "loop")
    good = ParametricObjective(bench, recorder, ledger, parametric_families())
    calls = []

    def flaky(trial):
        calls.append(trial.number)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return good(trial)

    counts = {"complete": 0, "pruned": 0, "failed": 0}
    TrialLoop(study, ledger, worker="test:2", warn=lambda m: None, counts=counts, n_trials=4).run(
        flaky, time.monotonic() + 60
    )
    states = [t.state for t in study.get_trials()]
    assert states.count(TrialState.FAIL) == 1 and len(states) == 4 and counts["failed"] == 1
    failed = study.trials[1]
    assert (
        failed.user_attrs["error"] == "RuntimeError: boom"
        and failed.user_attrs["worker"] == "test:2"
    )
    assert ledger.total("bk:optuna") > 0 and ledger.total("work:replay") > 0


def test_an_interrupt_fails_the_running_trial_and_propagates(setup):
    root, spec, trace = setup
    study = _study(root, "interrupt")

    def interrupted(trial):
        trial.suggest_float("x", 0, 1)
        raise KeyboardInterrupt

    counts = {"complete": 0, "pruned": 0, "failed": 0}
    loop = TrialLoop(study, Ledger(), worker="test:3", warn=print, counts=counts)
    with pytest.raises(KeyboardInterrupt):
        loop.run(interrupted, time.monotonic() + 60)
    (trial,) = study.get_trials()
    assert trial.state == TrialState.FAIL  # none is left running
