"""Trials in process: the RL objective and the export of its stored policy, and the trial loop's
handling of failures and interrupts (mlp traces: fast)."""

from __future__ import annotations

import math
import signal
import time

import optuna
import pytest
from optuna.samplers import BaseSampler

from autoscale.scalers import LossScaler, get_scaler
from autoscale.scalers.manifest import read_manifest
from autoscale.search.budget import Ledger
from autoscale.search.export import export_trial, trial_factory
from autoscale.search.loop import TrialLoop
from autoscale.search.plan import Timing, shape_spec
from autoscale.search.space import parametric_families
from autoscale.search.storage import artifact_store, open_storage
from autoscale.search.study import fail_worker_trials, study_kwargs
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
    assert type(scaler).__name__ == "PolicyScaler" and isinstance(scaler, LossScaler)
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


class InterruptAt(BaseSampler):
    """The search's own sampler (seeded TPE, timed), sending this process a SIGINT from inside
    ``study.ask()`` (``before_trial``: the trial row is written) or ``study.tell()``
    (``after_trial``: before its state is written) of trial ``number``."""

    def __init__(self, where: str, number: int) -> None:
        self.inner = study_kwargs(0, 0, Ledger())["sampler"]
        self.where, self.number = where, number

    def _maybe(self, where: str, trial) -> None:
        if where == self.where and trial.number == self.number:
            signal.raise_signal(signal.SIGINT)

    def infer_relative_search_space(self, study, trial):
        return self.inner.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self.inner.sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.inner.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial):
        self.inner.before_trial(study, trial)
        self._maybe("ask", trial)

    def after_trial(self, study, trial, state, values):
        self._maybe("tell", trial)
        self.inner.after_trial(study, trial, state, values)


@pytest.fixture
def sigint_raises():
    """Python's default SIGINT handler (KeyboardInterrupt), as in the CLI."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


K = 2  # the trial interrupted; trials 0..K-1 complete before it
# where the interrupt lands -> (state of trial K, its error attribute, objective calls)
INTERRUPTS = {
    "ask": (TrialState.FAIL, "KeyboardInterrupt: interrupted", K),
    "objective-signal": (TrialState.FAIL, "KeyboardInterrupt: interrupted", K + 1),
    "objective-raise": (TrialState.FAIL, "KeyboardInterrupt: interrupted", K + 1),
    "tell": (TrialState.COMPLETE, None, K + 1),
    "tell-of-a-failed-trial": (TrialState.FAIL, "RuntimeError: boom", K + 1),
}


@pytest.mark.parametrize("where", list(INTERRUPTS))
def test_an_interrupt_anywhere_leaves_no_trial_running_and_the_study_resumes(
    setup, sigint_raises, where
):
    root, spec, trace = setup
    ledger = Ledger()
    bench, _, recorder, _ = _parts(root, spec, trace, ledger)
    storage = open_storage(f"sqlite:///{root / 'interrupts.db'}")
    name = f"interrupt-{where}"
    sampler = InterruptAt(where.partition("-")[0], K)
    study = optuna.create_study(
        study_name=name, storage=storage, direction="minimize", sampler=sampler
    )
    real = ParametricObjective(bench, recorder, ledger, parametric_families())
    calls = []

    def objective_fn(trial):
        calls.append(trial.number)
        value = real(trial)
        if trial.number == K and where == "objective-signal":
            signal.raise_signal(signal.SIGINT)
        if trial.number == K and where == "objective-raise":
            raise KeyboardInterrupt
        if trial.number == K and where == "tell-of-a-failed-trial":
            raise RuntimeError("boom")
        return value

    counts = {"complete": 0, "pruned": 0, "failed": 0}
    loop = TrialLoop(study, ledger, worker="test:int", warn=lambda m: None, counts=counts)
    with pytest.raises(KeyboardInterrupt):
        loop.run(objective_fn, time.monotonic() + 120)

    state, error, n_calls = INTERRUPTS[where]
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(K + 1)) and calls == list(range(n_calls))
    assert [t.state for t in trials] == [TrialState.COMPLETE] * K + [state]  # none RUNNING
    assert trials[K].user_attrs["worker"] == "test:int"
    assert trials[K].user_attrs.get("error") == error
    assert counts == {
        "complete": K + (state == TrialState.COMPLETE),
        "pruned": 0,
        "failed": int(where == "tell-of-a-failed-trial"),
    }

    # the same study resumes: every trial kept as it was, numbering continues
    kept = {t.number: (t.state, t.value, t.params) for t in trials}
    resumed = optuna.load_study(study_name=name, storage=storage)
    counts = {"complete": 0, "pruned": 0, "failed": 0}
    TrialLoop(resumed, ledger, worker="test:int2", warn=print, counts=counts, n_trials=2).run(
        real, time.monotonic() + 120
    )
    after = resumed.get_trials()
    assert {t.number: (t.state, t.value, t.params) for t in after[: K + 1]} == kept
    assert [t.number for t in after[K + 1 :]] == [K + 1, K + 2]
    assert all(t.state == TrialState.COMPLETE for t in after[K + 1 :])


def test_fail_worker_trials_fails_only_that_workers_running_trials(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path / 'w.db'}")
    study = optuna.create_study(study_name="w", storage=storage)
    mine, theirs, done = study.ask(), study.ask(), study.ask()
    for trial, worker in ((mine, "me"), (theirs, "other"), (done, "me")):
        trial.set_user_attr("worker", worker)
    study.tell(done, 1.0)
    assert fail_worker_trials(study, "me") == 1
    assert [t.state for t in study.get_trials()] == [
        TrialState.FAIL,
        TrialState.RUNNING,
        TrialState.COMPLETE,
    ]
