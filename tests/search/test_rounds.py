"""How a search's rounds spend what the earlier phases left: a slow model's proxied no-harm check,
a first round that still searches after recording overran, the re-plan after a slow recording,
what is validated where no check fits, the warm agent in a search of both spaces. Each decides
on injected timings, clocks and recordings, the same on any machine; the real-clock searches
are the end-to-end tier (test_search_cli.py, test_workers.py, test_faults.py)."""

from __future__ import annotations

import dataclasses

import pytest

from autoscale.search import runner as runner_mod
from autoscale.search.budget import Budget
from autoscale.search.runner import SearchConfig, SearchRunner
from autoscale.search.workload import base_spec
from autoscale.training.scorecard import Scorecard
from tests.search.test_trials import setup  # noqa: F401  (a fixture: recorded mlp traces)


class _StopAtRecord(Exception):
    pass


@pytest.mark.slow
@pytest.mark.paced  # SearchRunner.run(): it measures and plans from the pace it sees
def test_a_slow_models_search_checks_no_harm_on_the_proxy_the_plan_chose(tmp_path, monkeypatch):
    """A language model whose 1000-step runs the budget cannot afford is checked on gpt2-tiny:
    the runner's check (whose cost decides what each round leaves time for) is the plan's, not
    the unfitted one, which would leave no time for anything after recording."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "lm"
    GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=128)
    ).save_pretrained(folder)
    real = runner_mod.measure_all

    def slow_lm(workloads, **kw):  # the local model measured as a 5 s step (GPT-2 on a CPU)
        t = real(workloads, **kw)
        return dataclasses.replace(
            t,
            by_key={
                k: dataclasses.replace(v, step_s=5.0, record_step_s=5.0)
                if k.startswith(str(folder))
                else v
                for k, v in t.by_key.items()
            },
        )

    def stop(*a, **kw):
        raise _StopAtRecord

    monkeypatch.setattr(runner_mod, "measure_all", slow_lm)
    monkeypatch.setattr(runner_mod, "load_traces", stop)
    spec = base_spec(model=str(folder))
    cfg = SearchConfig(
        spec,
        study="slow",
        export="slow",
        storage=f"sqlite:///{tmp_path / 'db.sqlite'}",
        policy_dir=str(tmp_path / "policies"),
        progress=False,
    )
    runner = SearchRunner(cfg, Budget.from_process_start(7200.0), out=lambda s: None)
    with pytest.raises(_StopAtRecord):
        runner.run()
    plan = runner.result.plan
    assert [w.model for w in plan.no_harm.workloads] == [
        "mlp",
        "gpt2-tiny",
        "mlp",
    ]  # mlp drifts too
    assert runner.no_harm.no_harm == plan.no_harm
    assert runner.no_harm.cost(plan.timings) < 0.3 * 7200


def _decider(n_trials=None, done=0):
    """A runner whose round costs are round numbers: validating n scalers 100 n s, checking n
    picks 50 n s, a 4000 s budget ending at 4000, 60 s of search at least."""
    from types import SimpleNamespace

    cfg = SearchConfig(base_spec(model="mlp"), study="s", export="s", n_trials=n_trials)
    said: list[str] = []
    runner = SearchRunner(cfg, Budget(4000.0, 0.0, 0.0), out=said.append)
    runner.plan = SimpleNamespace(
        rules=("torch", "a", "b"), all_rules_real=True, timings=None, space="parametric"
    )
    runner.validator = SimpleNamespace(cost=lambda n: 100.0 * n, names=["e1", "e2"])
    runner.study = SimpleNamespace(user_attrs={})
    runner.no_harm = SimpleNamespace(cost=lambda timings, n=1: 50.0 * n)
    runner.min_search_s = 60.0
    runner.counts["complete"] = done
    return runner, said


def _validating(runner, rules: tuple[str, ...]) -> list:
    """Give ``runner`` a validator that validates nothing and records each call: (the keys, the
    time it may run until), in order; the list of those calls."""
    from types import SimpleNamespace

    calls: list = []

    def run(scalers, stop_at, on_done=None):
        calls.append(([k for k, _, _ in scalers], stop_at))
        return {}

    runner.validator = SimpleNamespace(run=run, skipped=[], names=["e"])
    runner.plan = SimpleNamespace(rules=rules, steps=8)
    return calls


@pytest.mark.parametrize(
    "now, expected",
    [
        (0.0, 3180.0),  # time enough: the search stops where the round's 820 s share begins
        (3150.0, 3210.0),  # recording overran: the first round still searches 60 s
        # then as much of the 60 s as leaves the 360 s least a round does (torch, the bar and
        # a candidate validated, one check)
        (3600.0, 3640.0),
        (3900.0, 3640.0),  # not even that fits: no search (the stop has passed)
    ],
)
def test_the_first_round_searches_a_minimum_after_overrunning_phases(now, expected):
    runner, _ = _decider()
    assert runner._next_round(None, False, now).search_until == pytest.approx(expected)


def test_a_first_round_whose_plan_cut_the_rules_keeps_time_for_what_the_plan_priced():
    """Where every rule's validation did not fit, the plan priced torch, auto and one candidate
    (plan.validated_scalers): the first round keeps time for those three, not for three
    candidates (its other candidates are validated until check_at, as time allows)."""
    from autoscale.search.plan import validated_scalers

    runner, _ = _decider()
    runner.plan.all_rules_real = False
    # torch, the bar, one candidate validated (3 x 100 s), 2 picks checked (1.2 x 100 s)
    assert validated_scalers(3, False) == 3
    assert runner._next_round(None, False, 0.0).search_until == 4000.0 - (300.0 + 120.0)


def test_the_creator_records_until_the_plans_later_phases_with_their_margin(monkeypatch):
    """Recording bends to the machine's pace: the creator's traces stop where validation and
    the check keep the time the plan gave them, with its MARGIN (plan_search reserves
    MARGIN x their estimate), at the pace measured while recording."""
    from types import SimpleNamespace

    from autoscale.search import runner as runner_mod

    runner, _ = _decider()
    runner.plan = SimpleNamespace(
        validate_s=300.0, no_harm_s=200.0, suite=None, trace_steps=64, timings=None
    )
    runner.no_harm = SimpleNamespace(cached=lambda *a: False)
    runner.creator, runner.folder = True, None
    seen = {}

    def load_traces(*args, **kw):
        seen.update(kw)
        raise _StopAtRecord

    monkeypatch.setattr(runner_mod, "load_traces", load_traces)
    monkeypatch.setattr(runner_mod, "least_after_record", lambda plan, cached: 150.0)
    with pytest.raises(_StopAtRecord):
        runner._record()
    assert seen["stop_at"](1.0) == pytest.approx(4000.0 - 1.2 * 500.0)
    assert seen["stop_at"](2.0) == pytest.approx(4000.0 - 2.0 * 1.2 * 500.0)  # twice as slow
    assert seen["floor_at"] == 4000.0 - (150.0 + 60.0)  # the least, at the measured times


def test_the_stop_rule_in_order():
    """:meth:`SearchRunner._next_round`: the first round always runs; a round without torch's
    validation, or after one that learned nothing with --n-trials spent, stops the search (the
    latter says so); so do the last round and the tail; a later round runs where its share and
    a minimal search fit, else the tail validates more and searches only after."""
    from autoscale.search.candidates import TORCH
    from autoscale.search.runner import MAX_ROUNDS, Round

    runner, said = _decider()
    # 3 candidates + 3 rules + the bar validated, 2 picks checked: 820 s before the end
    first = runner._next_round(None, False, 0.0)
    assert first == Round(1, 3, 3180.0, 4000.0 - 1.4 * 50)
    assert runner._next_round(first, True, 1000.0) is None  # no torch: no reference
    runner.validated[TORCH] = None
    # one candidate, one check: 160 s; with 60 s of search, a round needs 220 s
    assert runner._next_round(first, False, 1000.0) == Round(2, 1, 3840.0, 3930.0)
    tail = runner._next_round(first, False, 3781.0)
    assert tail == Round(2, 3, None, 3930.0, tail_before=4000.0 - 0.05 * 4000)
    assert runner._next_round(tail, True, 3790.0) is None
    last = Round(MAX_ROUNDS, 1, 0.0, 0.0)
    assert runner._next_round(last, True, 1000.0) is None
    assert said == [] and runner.result.stopped_early is None

    # a resumed study holds torch's, a's and auto's real-step cards of every test episode (b's of
    # one): the validator reads them back, and the first round keeps time for b and the
    # candidates only
    from autoscale.search.validate import PREFIX

    runner, said = _decider()
    card = Scorecard(8, 0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0**16, False, False, 1.0, 8.0).to_dict()
    whole, one = {"e1": card, "e2": card}, {"e1": card}
    runner.study.user_attrs = {
        PREFIX + "rule:torch": {"cards": whole},
        PREFIX + "rule:a": {"cards": whole},
        PREFIX + "rule:b": {"cards": one},
        PREFIX + "policy:auto": {"cards": whole},
    }
    assert runner._next_round(None, False, 0.0).search_until == 4000.0 - (400.0 + 120.0)
    runner.study.user_attrs[PREFIX + "rule:a"]["on"] = "replay"  # replayed rows: not real steps
    assert runner._next_round(None, False, 0.0).search_until == 4000.0 - (500.0 + 120.0)

    # an agent in the race reaches real steps beside the candidates, in any time left: where
    # none has yet, each round's share counts one more scaler validated
    runner, said = _decider()
    runner.plan.space = "both"
    assert runner._next_round(None, False, 0.0).search_until == 3080.0
    runner.validated[TORCH] = None
    assert runner._next_round(first, False, 1000.0).search_until == 3740.0

    runner, said = _decider(n_trials=2, done=2)
    runner.validated[TORCH] = None
    assert runner._next_round(first, True, 1000.0) is not None  # it validated something new
    assert runner._next_round(first, False, 1000.0) is None
    assert runner.result.stopped_early.endswith("nothing left to learn")
    assert said == [f"[6/6 export] stopping with 50m left: {runner.result.stopped_early}"]


def test_the_rounds_agent_is_validated_in_any_time_left_after_the_best_candidate(monkeypatch):
    """torch and auto, then the best candidate until the round's check_at, then the agent (where
    none reached real steps yet) in any time left, then the rest until check_at; once check_at
    has passed, everything in any time left."""
    import time

    from autoscale.search.candidates import AUTO, TORCH, Candidate
    from autoscale.search.runner import Round

    runner, said = _decider()
    best, agent, other = Candidate.trial(3), Candidate.trial(7), Candidate.trial(9)
    rule = Candidate.rule("a")
    order = [(k, str(k), None) for k in (TORCH, AUTO, best, agent, rule, other)]
    monkeypatch.setattr(runner, "_to_validate", lambda k: (order, [], {}, agent))
    calls = _validating(runner, ("torch", "a"))
    end, check_at = runner.budget.end, time.monotonic() + 10_000.0
    runner._validate(Round(2, 3, None, check_at))
    assert calls == [
        ([TORCH, AUTO], end),
        ([best], check_at),
        ([agent], end),
        ([rule, other], check_at),
    ]
    calls.clear()
    runner._validate(Round(2, 3, None, 0.0))  # check_at long past: all in any time left
    assert calls == [([TORCH, AUTO], end), ([best], end), ([agent], end), ([rule, other], end)]
    # no agent to bring (one reached real steps before): the rest until check_at, in order
    calls.clear()
    monkeypatch.setattr(runner, "_to_validate", lambda k: (order, [], {}, None))
    runner._validate(Round(2, 3, None, check_at))
    assert calls == [([TORCH, AUTO], end), ([best, agent, rule, other], check_at)]


def test_the_agent_brought_to_real_steps_is_the_warm_started_one(monkeypatch):
    """Where no agent reached real steps yet, the warm-started agent (it starts at auto) goes
    right after the best candidate and is the one validated in any time left, even where a
    cold agent did better on the replay."""
    from types import SimpleNamespace

    from autoscale.search.candidates import AUTO, TORCH, Candidate

    def trial(number, kind, warm=False):
        attrs = {"policy": {"kind": kind}, **({"warm_start": "rl-res-ppo-k16"} if warm else {})}
        return SimpleNamespace(number=number, user_attrs=attrs)

    best, cold, other, warm = (
        trial(4, "parametric"), trial(17, "residual"), trial(5, "parametric"),
        trial(9, "residual", warm=True),
    )  # fmt: skip
    ranked = [best, cold, other, warm]  # as top_candidates returns them, best first
    monkeypatch.setattr(runner_mod, "top_candidates", lambda *a, **k: [(t, None) for t in ranked])
    monkeypatch.setattr(runner_mod, "policy_label", lambda t: f"trial {t.number}")
    runner, _ = _decider()
    runner.plan = SimpleNamespace(rules=("torch", "a"), space="both", suite=None)
    runner.study = SimpleNamespace(get_trials=lambda **k: [], trials=[])
    runner.factories = {Candidate.rule("torch"): None, Candidate.rule("a"): None, AUTO: None}
    runner.store = runner.workdir = None
    order, _, _, agent = runner._to_validate(3)
    keys = [k for k, _, _ in order]
    assert agent == Candidate.trial(9)
    assert keys == [TORCH, AUTO, *map(Candidate.trial, (4, 9)), Candidate.rule("a"),
                    *map(Candidate.trial, (17, 5))]  # fmt: skip
    # no warm-started agent: the best one
    ranked.remove(warm)
    assert runner._to_validate(3)[3] == Candidate.trial(17)


def test_a_creator_that_recorded_slower_than_measured_re_plans_says_so_and_stores_it(
    tmp_path, monkeypatch
):
    """The worker that created the study recorded at half the pace it measured (another job
    started) and left instances out: it plans what is left again at the pace it saw, says what
    it traded, keeps the traces of the new plan and stores that plan for good, the trades in the
    study's note, for every worker to adopt. Injected: the measured timings, the recording's
    pace and what it recorded, a quarter of the budget left; that a real search bent this way
    still ends in its budget with an export is the end-to-end test below."""
    import time

    import optuna
    from optuna_dashboard import get_note

    from autoscale.search.export import study_suites
    from autoscale.search.study import PLANNING, describe_new_study
    from tests.search.test_plan import plan_for
    from tests.search.test_replan import _recorded, _stats

    plan, _ = plan_for(base_spec(model="mlp"), 0.01, 600)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    cfg = SearchConfig(
        base_spec(model="mlp"), study="bent", export="bent", storage=storage, progress=False
    )
    said: list[str] = []
    runner = SearchRunner(cfg, Budget(600.0, time.monotonic() - 450.0, 0.0), out=said.append)
    runner.folder, runner.creator, runner.min_search_s = tmp_path, True, 12.0
    runner._use(plan)
    study = runner.study = optuna.create_study(study_name="bent", storage=storage)
    budget = {"text": "10m", "seconds": 600.0}
    describe_new_study(
        study, plan, command="", budget=budget, planner=runner.worker, until=time.time() + 150
    )
    kept = []

    def keep_planned(suite, traces, folder, steps):
        kept.append((suite, steps))
        return traces

    monkeypatch.setattr(runner_mod, "keep_planned", keep_planned)
    traces, dropped = _recorded(plan, 1)
    runner._replan(traces, _stats(2.0, dropped, plan.trace_steps))
    new = runner.plan
    assert new is not plan and runner.result.replanned == list(new.cuts[len(plan.cuts) :])
    (line,) = [x for x in said if x.startswith("[2/6 plan] re-planned: ")]
    assert "2.0x slower than measured" in line and "instances unrecorded" in line
    assert kept == [(new.suite, new.trace_steps)]  # the new plan's traces, under its keys
    assert study_suites(study)[0] == new.suite and study.user_attrs[PLANNING] is None
    note = get_note(study)
    assert "slower than measured" in note and "traded: " in note  # the study says so too


@pytest.mark.slow
@pytest.mark.paced  # a real 60-second search: the end-to-end tier
def test_a_machine_that_turns_slower_after_measuring_gets_a_re_planned_search_in_budget(
    tmp_path, monkeypatch
):
    """Steps measured at several times the pace the machine then runs them at (another job
    started): the search records the least first, leaves out what no longer fits, plans the rest
    again at the pace it saw, says what it traded, and still ends within its budget with a
    validated export.

    The measured costs are quartered, not the later steps slowed by a sleep: the recording then
    runs 2-4x slower than measured on an idle machine and on a loaded one alike (a sleep
    proportional to each step adds to a measurement that the load already moved). Halved, they
    were not enough: the measure phase's few steps can run over 2x slower than recording's many
    (a README run at 613ff6e recorded in 17 s what the halved measure estimated at 23 s: no
    re-plan)."""
    from autoscale.scalers import make_scaler

    real_measure = runner_mod.measure_all

    def measured(workloads, **kw):
        return real_measure(workloads, **kw).scaled(0.25)

    monkeypatch.setattr(runner_mod, "measure_all", measured)
    said: list[str] = []
    cfg, budget, result = _mlp_search_in_60s(tmp_path, "bent", said)
    text = "\n".join(said)
    assert result.replanned, text
    assert any(line.startswith("[2/6 plan] re-planned: ") for line in said), text
    assert "x slower than measured" in text
    assert result.exported is not None, text
    make_scaler(str(result.exported), device="cpu")
    import optuna
    from optuna_dashboard import get_note

    study = optuna.load_study(study_name="bent", storage=cfg.storage)
    note = get_note(study)
    assert "slower than measured" in note and "traded: " in note  # the study says so too
    from autoscale.search.choose import CHECK_SHAPE

    # the pick kept the shape of the check it ran, for `autoscale export --trial best`
    assert study.user_attrs[CHECK_SHAPE].startswith("mlp,mlp/drift|"), study.user_attrs
    elapsed = budget.elapsed()
    assert elapsed <= 1.05 * 60, f"{elapsed:.1f} s\n{text}"


def test_with_a_check_dearer_than_the_budget_torch_auto_and_the_rules_are_still_validated(
    monkeypatch,
):
    """The no-harm check turns out dearer than the whole budget (a machine far slower than
    measured): no check fits after the first round's validation. That round does not search
    (its stop has passed), and torch, auto, the rules and the candidates are all validated in
    any time left: without torch and auto there is no answer, exporting auto needs no check, and
    a lead over auto on the user's held-out steps is worth knowing even where it cannot be
    exported unchecked (the pick then exports auto and says why:
    test_no_harm.py::test_no_time_for_the_check_means_no_export_of_that_candidate). Injected:
    the round is decided at ``now`` of a budget that ends at 4000 (its check time is then long
    past on any clock), and the order to validate is given (``_to_validate``'s own is tested
    beside: test_the_agent_brought_to_real_steps_is_the_warm_started_one)."""
    from types import SimpleNamespace

    from autoscale.search.candidates import AUTO, TORCH, Candidate

    runner, _ = _decider()
    runner.no_harm = SimpleNamespace(cost=lambda timings, n=1: 1e6 * n)
    first = runner._next_round(None, False, 100.0)
    assert first.number == 1 and first.search_until < 100.0 and first.check_at < 0.0
    best, rule_a, rule_b = Candidate.trial(3), Candidate.rule("a"), Candidate.rule("b")
    order = [(k, str(k), None) for k in (TORCH, AUTO, best, rule_a, rule_b)]
    monkeypatch.setattr(runner, "_to_validate", lambda k: (order, [], {}, None))
    calls = _validating(runner, ("torch", "a", "b"))
    runner._validate(first)
    end = runner.budget.end
    assert calls == [([TORCH, AUTO], end), ([best, rule_a, rule_b], end)]


@pytest.mark.slow  # an agent trained briefly to ship, then trials: seconds
def test_in_a_search_of_both_spaces_the_warm_agent_reaches_validation(setup, tmp_path, monkeypatch):  # noqa: F811
    """The first round of a search of both spaces, on a machine that left it no time to search
    (the stop has passed): the rules' defaults the study enqueued are scored by the parametric
    objective before the warm RL trial, so no agent trial takes one (it would carry their
    ``baseline`` mark and never be validated); the warm trial is the shipped agent as it came,
    and it is the agent the round brings to real steps (where it goes in the order beside
    better candidates: test_the_agent_brought_to_real_steps_is_the_warm_started_one).
    Injected: the stop, the study and the replay bench of recorded mlp traces."""
    import time
    from types import SimpleNamespace

    import optuna

    from autoscale.agents import warm as warm_mod
    from autoscale.search.candidates import AUTO, TORCH, Candidate
    from autoscale.search.runner import rules_torch_first
    from autoscale.search.space import default_trial_params, parametric_families
    from tests.search.test_agent_trials import _ship
    from tests.search.test_trials import _parts, _study

    root, suite, traces = setup
    _ship(suite, traces, tmp_path / "warm")
    monkeypatch.setattr(warm_mod, "WARM_DIR", tmp_path / "warm")
    cfg = SearchConfig(
        base_spec(model="mlp"), study="both", export="both", space="both", progress=False
    )
    runner = SearchRunner(cfg, Budget(4000.0, 0.0, 0.0), out=lambda s: None)
    runner.bench, runner.store, runner.recorder, runner.workdir = _parts(
        root, suite, traces, runner.ledger
    )
    rules, families = rules_torch_first(), parametric_families()
    runner.families = {r: families[r] for r in rules}
    runner.plan = SimpleNamespace(space="both", suite=suite, rules=rules)
    study = runner.study = _study(tmp_path, "both")
    for r in rules:  # as describe_new_study enqueues them
        study.enqueue_trial(
            default_trial_params(r, families[r], suite.episode), user_attrs={"baseline": True}
        )
    runner._search(time.monotonic() - 1.0, first=True)
    trials = study.get_trials(deepcopy=False)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    baselines = [t for t in trials if t.user_attrs.get("baseline")]
    assert sorted(t.user_attrs["policy"]["rule"] for t in baselines) == sorted(rules)
    (warm,) = [t for t in trials if t.user_attrs.get("warm_start")]
    assert not warm.user_attrs.get("baseline") and warm.user_attrs["policy"]["timesteps"] == 0
    assert len(trials) == len(rules) + 1  # no other trial: no time was left to search
    runner.factories = {Candidate.rule(r): None for r in rules} | {AUTO: None}
    order, _, _, agent = runner._to_validate(3)
    keys = [k for k, _, _ in order]
    assert agent == Candidate.trial(warm.number)
    assert keys[:2] == [TORCH, AUTO] and agent in keys  # the only candidate: no time to search


def _mlp_search_in_60s(tmp_path, study: str, said: list[str], space: str = "parametric"):
    """A 60-second search of mlp in ``tmp_path``; (its config, budget, result)."""
    import time

    cfg = SearchConfig(
        base_spec(model="mlp"),
        study=study,
        export=study,
        storage=f"sqlite:///{tmp_path / 'db.sqlite'}",
        policy_dir=str(tmp_path / "policies"),
        progress=False,
        space=space,
    )
    budget = Budget.from_process_start(0.0)
    budget = dataclasses.replace(budget, seconds=60.0, start=time.monotonic(), reserve=3.0)
    return cfg, budget, SearchRunner(cfg, budget, out=said.append).run()
