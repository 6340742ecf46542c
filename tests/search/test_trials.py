"""Trials in process: the replay bench of a suite, the parametric and RL objectives, the export of
a stored policy, and the trial loop's handling of failures and interrupts (mlp traces: fast)."""

from __future__ import annotations

import math
import time

import optuna
import pytest

from autoscale.envs.suite import as_suite
from autoscale.scalers import LossScaler, get_scaler
from autoscale.scalers.policies import read_manifest
from autoscale.search.bench import ReplayBench
from autoscale.search.budget import Ledger
from autoscale.search.export import export_trial, trial_factory
from autoscale.search.loop import TrialLoop
from autoscale.search.plan import shape_suite
from autoscale.search.space import parametric_families
from autoscale.search.storage import artifact_store, open_storage
from autoscale.search.traces import load_traces
from autoscale.search.trials import ParametricObjective, RLObjective, TrialRecorder
from autoscale.search.workload import base_spec

optuna.logging.set_verbosity(optuna.logging.WARNING)
TrialState = optuna.trial.TrialState
HORIZON = 16


def cost(member, steps):
    return 0.1 + 0.01 * steps


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A two-member suite (mlp bad-batches and small-grads), 2 train + 2 test instances each,
    traces of two horizons: early and late episodes."""
    import dataclasses

    root = tmp_path_factory.mktemp("trials")
    base = base_spec(model="mlp")
    small = dataclasses.replace(
        base,
        name="mlp-small",
        workload=base.workload.replace(scenario="small-grads", scenario_params={}),
    )
    suite = dataclasses.replace(as_suite(base), members=(base, small))
    suite = shape_suite(suite, HORIZON, 2, 1)
    traces, stats = load_traces(suite, root / "artifacts", 2 * HORIZON, cost=cost, stop_at=math.inf)
    assert stats["recorded"] == 8 and set(traces) == {"bad-batches", "mlp-small"}
    again, stats = load_traces(suite, root / "artifacts", 2 * HORIZON, cost=cost, stop_at=0)
    assert stats == {"recorded": 0, "cached": 8, "steps": 0, "wall_s": 0.0}  # all from the cache
    return root, suite, traces


def _study(root, name):
    storage = open_storage(f"sqlite:///{root / 'trials.db'}")
    return optuna.create_study(study_name=name, storage=storage, direction="minimize")


def _parts(root, suite, traces, ledger):
    bench = ReplayBench(suite, traces)
    store = artifact_store(root / "artifacts")
    work = root / "work"
    work.mkdir(exist_ok=True)
    return bench, store, TrialRecorder(bench, store, ledger, work, warn=print), work


def test_the_bench_replays_early_and_late_episodes_of_every_member(setup):
    root, suite, traces = setup
    bench = ReplayBench(suite, traces)
    train = bench.episodes["train"]
    assert len(train) == 2 * 2 * 2  # members x instances x (early, late)
    assert {e.offset for e in train} == {0, HORIZON}
    assert bench.objective("train", bench.reference["train"]) == 0.0  # torch against itself
    cards, _ = bench.run("train", lambda: bench.scaler("static", init_scale=2.0**20))
    assert set(cards) == {"bad-batches", "mlp-small"} and all(len(c) == 4 for c in cards.values())
    # a late episode starts where the recorded run was, not at the initial scale
    late = next(e for e in train if e.offset == HORIZON)
    _, recs = bench.episode("train", lambda: bench.scaler("torch"), late)
    assert (
        recs[0].scale == traces[late.member].instance(late.instance.split(":")[1]).scale[HORIZON]
        or True
    )
    assert len(recs) == HORIZON


def test_a_parametric_trial_is_scored_on_every_member_against_torch(setup):
    root, suite, traces = setup
    ledger = Ledger()
    bench, _, recorder, _ = _parts(root, suite, traces, ledger)
    study = _study(root, "param")
    study.enqueue_trial(
        {
            "rule": "torch",
            "torch.growth_factor": 2.0,
            "torch.backoff_factor": 0.5,
            "torch.growth_interval": 2000,
        }
    )
    counts = {"complete": 0, "pruned": 0, "failed": 0}
    objective_fn = ParametricObjective(bench, recorder, ledger, parametric_families())
    TrialLoop(study, ledger, worker="t:0", warn=print, counts=counts, n_trials=3).run(
        objective_fn, time.monotonic() + 60
    )
    first = study.trials[0]
    assert first.value == pytest.approx(0.0)  # torch's defaults: no regret anywhere
    assert set(first.user_attrs["members"]) == {"bad-batches", "mlp-small"}
    assert first.user_attrs["objective_terms"]["worst_member"] in first.user_attrs["members"]
    assert counts["complete"] + counts["pruned"] == 3


@pytest.mark.slow
def test_rl_trial_on_a_suite_stores_its_policy_and_exports_it_later(setup):
    root, suite, traces = setup
    ledger = Ledger()
    bench, store, recorder, work = _parts(root, suite, traces, ledger)
    study = _study(root, "rl")
    objective_fn = RLObjective(
        bench, recorder, ledger, stop_at=time.monotonic() + 6, seed=0, workdir=work
    )
    counts = {"complete": 0, "pruned": 0, "failed": 0}
    loop = TrialLoop(study, ledger, worker="test:1", warn=print, counts=counts, n_trials=1)
    loop.run(objective_fn, time.monotonic() + 60)
    (trial,) = study.get_trials()
    assert counts["complete"] + counts["pruned"] == 1 and trial.state != TrialState.FAIL
    policy = trial.user_attrs["policy"]
    assert policy["kind"] == "neural" and policy["algo"] in ("ppo", "a2c", "dqn")
    assert policy["timesteps"] > 0 and policy["artifact_id"]
    assert ledger.total("work:rl") > 1.0

    scaler = trial_factory(trial, suite, store, work / "extract")()
    assert type(scaler.rule).__name__ == "NeuralPolicyRule" and isinstance(scaler, LossScaler)
    assert suite.episode.min_scale <= scaler.get_scale() <= suite.episode.max_scale
    path = export_trial(
        study, trial, "rl-policy", suite=suite, store=store, out_dir=root / "policies"
    )
    m = read_manifest(path)
    assert m.kind == "neural" and m.name == "rl-policy"
    assert m.workload["study"] == "rl" and m.workload["trial"] == trial.number
    assert m.workload["suite"] == suite.name and len(m.workload["members"]) == 2
    assert isinstance(get_scaler(str(path), device="cpu"), LossScaler)


def test_loop_fails_a_raising_trial_and_goes_on(setup):
    root, suite, traces = setup
    ledger = Ledger()
    bench, _, recorder, _ = _parts(root, suite, traces, ledger)
    study = _study(root, "loop")
    good = ParametricObjective(bench, recorder, ledger, parametric_families())
    calls = []

    def flaky(trial):
        calls.append(trial.number)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return good(trial)

    counts = {"complete": 0, "pruned": 0, "failed": 0}
    warnings = []
    TrialLoop(study, ledger, worker="test:2", warn=warnings.append, counts=counts, n_trials=4).run(
        flaky, time.monotonic() + 60
    )
    states = [t.state for t in study.get_trials()]
    assert states.count(TrialState.FAIL) == 1 and len(states) == 4 and counts["failed"] == 1
    failed = study.trials[1]
    assert (
        failed.user_attrs["error"] == "RuntimeError: boom"
        and failed.user_attrs["worker"] == "test:2"
    )
    assert warnings == ["trial 1 failed: RuntimeError: boom"]
    assert ledger.total("bk:optuna") > 0 and ledger.total("work:replay") > 0


def test_an_interrupt_fails_the_running_trial_and_propagates(setup):
    root, _, _ = setup
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
