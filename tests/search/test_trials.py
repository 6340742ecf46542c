"""Trials in process: the replay bench of a suite, the parametric and RL objectives, the export of
a stored policy, and the trial loop's handling of failures and interrupts (mlp traces: fast)."""

from __future__ import annotations

import math
import signal
import time

import optuna
import pytest
from optuna.samplers import BaseSampler

from autoscale.envs.suite import as_suite
from autoscale.scalers import LossScaler, make_scaler
from autoscale.scalers.policies import read_manifest
from autoscale.search.agent_trials import RLObjective
from autoscale.search.bench import ReplayBench
from autoscale.search.budget import Ledger
from autoscale.search.candidates import Candidate
from autoscale.search.export import export_candidate, top_candidates, trial_factory
from autoscale.search.loop import TrialLoop
from autoscale.search.plan import shape_suite
from autoscale.search.space import parametric_families
from autoscale.search.storage import artifact_store, open_storage
from autoscale.search.study import fail_worker_trials, study_kwargs
from autoscale.search.traces import load_traces
from autoscale.search.trials import ParametricObjective, TrialRecorder
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
    # all from the cache: nothing recorded, nothing planned
    assert stats == {
        "recorded": 0,
        "cached": 8,
        "steps": 0,
        "wall_s": 0.0,
        "planned_s": 0.0,
        "dropped": [],
        "shortened": [],
        "shortest": 2 * HORIZON,
    }
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


def test_export_writes_auto_a_rule_and_a_parametric_trial_as_loadable_policies(setup, tmp_path):
    """The one export step, for each kind of candidate a search picks: ``auto`` copied as it
    ships, a built-in rule with its defaults and the episode's scale bounds, a parametric trial
    with its parameters; each manifest names what it holds and its study, and each loads."""
    _, suite, _ = setup
    study = _study(tmp_path, "kinds")
    policy = {"kind": "parametric", "rule": "torch", "params": {"growth_interval": 7}}
    study.add_trial(optuna.trial.create_trial(value=0.0, user_attrs={"policy": policy}))
    ep = suite.episode
    out = tmp_path / "policies"
    kinds = {
        "a": (Candidate.parse("policy:auto"), "auto, the shipped general policy, unchanged"),
        "b": (Candidate.rule("deepspeed"), "the built-in rule deepspeed with its defaults"),
        "c": (Candidate.trial(0), "torch, trial 0"),
    }
    for name, (key, said) in kinds.items():
        path, how = export_candidate(
            study, key, name, suite=suite, out_dir=out, provenance={"p": 1}
        )
        m = read_manifest(path)
        assert how == said and path == out / name and m.name == name
        assert m.workload["study"] == "kinds" and m.workload["p"] == 1
        assert isinstance(make_scaler(str(path), device="cpu"), LossScaler)
    assert read_manifest(out / "a").workload["exported_policy"] == "auto"
    assert read_manifest(out / "a").workload["built"]  # what auto was built on, kept
    rule = read_manifest(out / "b")
    assert rule.workload["builtin_rule"] == "deepspeed" and rule.family == "deepspeed"
    assert rule.parameters == {
        "init_scale": ep.init_scale, "min_scale": ep.min_scale, "max_scale": ep.max_scale,
    }  # fmt: skip
    trial = read_manifest(out / "c")
    assert trial.workload["trial"] == 0 and trial.parameters["growth_interval"] == 7
    assert trial.parameters["max_scale"] == ep.max_scale


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
    recorded = traces[late.member].instance(late.instance.split(":")[1]).scale
    assert recorded[HORIZON - 1] < suite.episode.init_scale  # torch halved on the bad batches
    assert recs[0].scale == recorded[HORIZON - 1]  # the scale the run had there, carried on
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
    scores = first.user_attrs["scores"]
    assert set(scores["members"]) == {"bad-batches", "mlp-small"}
    assert scores["objective_terms"]["worst_member"] in scores["members"]
    assert counts["complete"] + counts["pruned"] == 3


@pytest.mark.slow
@pytest.mark.paced
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
    # a trained agent is scored whole, never pruned: pruning then would save only its replay
    assert counts["complete"] == 1 and trial.state == TrialState.COMPLETE
    policy = trial.user_attrs["policy"]
    assert policy["kind"] == "residual" and policy["algo"] in ("ppo", "a2c", "dqn")
    assert policy["base"] == "auto" and policy["window"] == RLObjective.WINDOW
    assert policy["timesteps"] > 0 and policy["artifact_id"]
    assert ledger.total("work:rl") > 1.0

    scaler = trial_factory(trial, suite, store, work / "extract")()
    assert type(scaler.rule).__name__ == "ResidualRule" and isinstance(scaler, LossScaler)
    assert scaler.rule.base.name == "amax-loss"  # on auto's rule, with auto's guard
    assert suite.episode.min_scale <= scaler.get_scale() <= suite.episode.max_scale
    path, how = export_candidate(study, Candidate.trial(trial.number), "rl-policy", suite=suite,
                                 store=store, out_dir=root / "policies")  # fmt: skip
    assert how == f"residual {policy['algo']} agent, trial {trial.number}"
    m = read_manifest(path)
    assert m.kind == "residual" and m.name == "rl-policy"
    assert m.workload["study"] == "rl" and m.workload["trial"] == trial.number
    assert m.workload["suite"] == suite.name and len(m.workload["members"]) == 2
    assert isinstance(make_scaler(str(path), device="cpu"), LossScaler)

    # beside better parametric trials, the best agent still reaches validation (one_of)
    params = ParametricObjective(bench, recorder, ledger, parametric_families())
    for rule in ("amax-history", "amax-loss", "torch"):
        study.enqueue_trial({"rule": rule})
    TrialLoop(study, ledger, worker="test:1", warn=print, counts=counts, n_trials=4).run(
        params, time.monotonic() + 60
    )
    done = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(done) >= 3
    plain = top_candidates(done, suite, store, work / "c1", 1, print)
    picked = top_candidates(done, suite, store, work / "c2", 1, print, one_of="residual")
    assert trial.number in [t.number for t, _ in picked]
    assert [t.number for t, _ in picked][: len(plain)] == [t.number for t, _ in plain]
    # a better agent among the k: the warm-started one (it starts at auto) is still added
    import copy

    better = copy.deepcopy(trial)
    better.number, better.value = 99, -1e9
    better.user_attrs = {**trial.user_attrs, "policy": {**policy, "timesteps": 1}}
    warm = copy.deepcopy(trial)
    warm.user_attrs = {**trial.user_attrs, "warm_start": "rl-res-ppo-k16"}
    pool = [t for t in done if t.number != trial.number] + [better, warm]
    picked = top_candidates(pool, suite, store, work / "c3", 1, print, one_of="residual")
    assert [t.number for t, _ in picked] == [99, trial.number]


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


def test_the_sampler_and_pruner_are_optunas_own_with_their_calls_timed():
    ledger = Ledger()
    kwargs = study_kwargs(0, 0, ledger)
    assert type(kwargs["sampler"]) is optuna.samplers.TPESampler
    assert type(kwargs["pruner"]) is optuna.pruners.MedianPruner
    study = optuna.create_study(**kwargs)

    def objective(trial):
        x = trial.suggest_float("x", -1.0, 1.0)
        trial.report(x, 0)
        trial.should_prune()
        return x * x

    study.optimize(objective, n_trials=12)
    assert ledger.total("alg:sampler") > 0 and ledger.total("alg:pruner") > 0
    assert len(study.trials) == 12


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
    root, suite, traces = setup
    ledger = Ledger()
    bench, _, recorder, _ = _parts(root, suite, traces, ledger)
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


@pytest.mark.slow
def test_vectorised_parametric_trials_report_what_scalar_ones_do(setup):
    """The same parameters of vectorised families give the same trial values, reports and
    stored scores with and without the vectorised replay."""
    from autoscale.envs.vector_replay import VECTOR_RULES

    root, suite, traces = setup
    ledger = Ledger()
    bench, _, recorder, _ = _parts(root, suite, traces, ledger)
    from autoscale.search.bench import VECTOR_MIN_LANES

    # few episodes: the scalar replay (faster there) unless told otherwise
    assert len(bench.episodes["train"]) < VECTOR_MIN_LANES == bench.vector_min_lanes
    assert bench.vector_cards("train", "torch", {}) is None
    bench.vector_min_lanes = 1  # this bench's few episodes: vectorised too
    used = []
    vector_cards = bench.vector_cards
    bench.vector_cards = lambda *a: used.append(a[1]) or vector_cards(*a)

    def knobs(rule, **values):
        return {"rule": rule, **{f"{rule}.{k}": v for k, v in values.items()}}

    params = [  # every knob given: the sampler draws none
        knobs("torch", growth_factor=1.7, backoff_factor=0.3, growth_interval=2000),
        knobs("torch", growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
        knobs("amax-history", history_len=3, margin=0.5, backoff_factor=0.5),
        knobs("amax-cap", history_len=16, margin=2.0, backoff_factor=0.7, growth_interval=4),
        knobs(
            "amax-loss",
            history_len=4,
            margin=1.0,
            backoff_factor=0.6,
            growth_interval=9,
            guard_floor=6.0,
        ),
        knobs("static", log2_init_scale=12),
        knobs(
            "deepspeed",
            scale_factor=2.0,
            loss_scale_window=5,
            hysteresis=2,
            consecutive_hysteresis=True,
        ),
        knobs("megatron", growth_factor=1.5, backoff_factor=0.4, growth_interval=7, hysteresis=3),
        knobs("jmp", period=6, factor=3.0),
        knobs("fairseq", scale_factor=2.0, scale_window=8, tolerance=0.2),
        knobs("metaseq", scale_factor=2.5, scale_window=4, tolerance=0.0),
    ]
    assert {p["rule"] for p in params} == set(VECTOR_RULES)
    seen = {}
    for vectorised in (False, True):
        study = _study(root, f"vector-{vectorised}")
        for p in params:
            study.enqueue_trial(p, skip_if_exists=False)
        fn = ParametricObjective(
            bench, recorder, ledger, parametric_families(), vectorised=vectorised
        )
        counts = {"complete": 0, "pruned": 0, "failed": 0}
        loop = TrialLoop(
            study, ledger, worker="t:0", warn=print, counts=counts, n_trials=len(params)
        )
        loop.run(fn, time.monotonic() + 120)
        assert counts["failed"] == 0
        seen[vectorised] = [
            (t.params, t.value, t.intermediate_values, t.user_attrs.get("scores"))
            for t in study.trials
        ]
    assert repr(seen[True]) == repr(seen[False])
    assert len({v for _, v, _, _ in seen[True]}) > 1
    assert set(used) == set(VECTOR_RULES)  # every family went through the vectorised replay


@pytest.mark.slow
def test_a_lead_must_hold_over_the_horizons_replay(setup):
    """A lead over auto on short real-step episodes counts only where it holds on the replay of
    the same held-out runs: here auto leads torch there (torch ratchets down on bad batches), so
    auto's lead over torch would hold and torch's over auto would not."""
    from autoscale.search.choose import horizon_refusal

    root, suite, traces = setup
    bench = ReplayBench(suite, traces)
    auto, torch = (lambda: bench.scaler("auto")), (lambda: bench.scaler("torch"))
    assert horizon_refusal(bench, auto, torch) is None
    why = horizon_refusal(bench, torch, auto)
    assert why.startswith(
        f"its lead does not hold on the {HORIZON}-step replay of the same held-out runs (objective +"
    ), why
    assert horizon_refusal(bench, auto, auto) is not None  # no lead at all


@pytest.mark.slow
def test_the_horizons_replay_of_auto_runs_once_for_many_leads(setup, monkeypatch):
    """A search weighs many leads over auto against the same replay of auto: it runs once a
    bench, and the answers are those of a fresh replay."""
    from autoscale.search.choose import horizon_refusal

    root, suite, traces = setup
    bench = ReplayBench(suite, traces)
    auto, torch = (lambda: bench.scaler("auto")), (lambda: bench.scaler("torch"))
    runs, depth = [], [0]
    real = bench.run

    def run(kind, f):  # the outer calls only (a run may call run again)
        if not depth[0]:
            runs.append(f)
        depth[0] += 1
        try:
            return real(kind, f)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(bench, "run", run)
    replays: dict = {}
    first = [horizon_refusal(bench, f, auto, replays) for f in (torch, auto, torch)]
    assert runs.count(auto) == 2  # once as the bar, once as the candidate weighed against it
    assert first == [horizon_refusal(bench, f, auto) for f in (torch, auto, torch)]
