"""The no-harm check and the honest pick, on real clean runs of the mlp workload."""

from __future__ import annotations

import math

import optuna
import pytest

from autoscale.scalers import get_scaler
from autoscale.search.budget import Ledger
from autoscale.search.candidates import Candidate
from autoscale.search.choose import GATE_PREFIX, choose
from autoscale.search.export import rank
from autoscale.search.gate import NoHarmCheck, gate_proxy, gate_workloads
from autoscale.search.timing import GatePlan, Timing, Timings, workload_key
from autoscale.search.validate import Validated
from autoscale.search.workload import base_spec
from autoscale.training.scorecard import Scorecard

optuna.logging.set_verbosity(optuna.logging.WARNING)
STEPS = 400  # the search uses >= 1000; a short check keeps the test fast
SCALE = {"init_scale": 2.0**16, "min_scale": 1.0, "max_scale": 2.0**40}
EAGER = {"scale_window": 14, "scale_factor": 7.0, "tolerance": 0.32}  # grows every 14 steps


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    spec = base_spec(model="mlp")
    gate = GatePlan(gate_workloads([spec], STEPS), STEPS)
    return NoHarmCheck(gate, tmp_path_factory.mktemp("gate"), Ledger(), SCALE)


def scaler(name, **kw):
    return lambda: get_scaler(name, device="cpu", **SCALE, **kw)


def test_the_check_runs_long_clean_runs_of_mlp_with_a_schedule():
    (w,) = gate_workloads([base_spec(model="mlp")], 1000)
    assert w.model == "mlp" and w.scenario == "clean"
    assert w.scenario_params == {"warmup": 100, "decay": 900}
    models = [w.model for w in gate_workloads([base_spec(model="gpt2-tiny")], 1000)]
    assert models == ["mlp", "gpt2-tiny"]  # mlp and the searched model
    assert gate_proxy(base_spec(model="gpt2").workload).model == "gpt2-tiny"
    assert gate_proxy(w) is None


@pytest.mark.slow  # long clean runs of mlp
def test_an_eager_rule_is_refused_on_replay_and_in_real_runs(check):
    screened = check.screen(scaler("fairseq", **EAGER), "eager fairseq")
    assert not screened.passed and screened.screened
    assert "replay predicts" in screened.reasons[0] and "allowed" in screened.reasons[0]
    verdict = check.check(scaler("fairseq", **EAGER), "eager fairseq")
    assert not verdict.passed and not verdict.screened
    assert any("skipped" in r and "torch" in r for r in verdict.reasons), verdict.reasons
    mine = verdict.runs["mlp"]["candidate"][0]
    ref = verdict.runs["mlp"]["torch"][0]
    assert mine["skip_rate"] > ref["skip_rate"] + 0.005  # what the rule measures
    assert "fails the no-harm check in long clean runs" in verdict.summary()


@pytest.mark.slow  # long clean runs of mlp
def test_torch_itself_passes_and_its_runs_are_cached(check):
    assert all(check.cached(w, s) for w in check.gate.workloads for s in check.gate.seeds)
    verdict = check.check(scaler("torch"), "torch")
    assert verdict.passed and verdict.reasons == []
    timeless = [
        {k: v for k, v in c.items() if k not in ("wall_s", "useful_steps_per_s")}
        for who in ("candidate", "torch")
        for c in verdict.runs["mlp"][who]
    ]
    assert timeless[0] == timeless[1]  # the same run: CPU training is deterministic
    assert "passed the no-harm check" in verdict.summary()
    timings = Timings({workload_key(w): Timing(0.01, 0.1, 0.01, 4) for w in check.gate.workloads})
    assert check.cost(timings, 1) == pytest.approx(0.1 + STEPS * 0.01 + 0.01)  # candidates only


def card(skip_rate, precision, steps=64):
    return Scorecard(
        steps, round(skip_rate * steps), skip_rate, precision, 1.0, 1.0, 1.0, 2.0**16, False,
        False, 1.0, 64.0,
    )  # fmt: skip


def validated(key, skip, precision):
    key = Candidate.parse(key)
    return Validated(key, key.name, {"mlp/bad-batches": [card(skip, precision)] * 2})


def test_a_built_in_rule_that_beats_every_candidate_ranks_first():
    torch = validated("rule:torch", 0.125, 0.3)
    rows = {
        "rule:torch": torch,
        "trial:7": validated("trial:7", 0.125, 0.02),
        "rule:static": validated("rule:static", 0.125, 0.01),
        "trial:9": validated("trial:9", 0.3, 0.0),
        "rule:jmp": Validated(Candidate.rule("jmp"), "jmp", torch.cards, real=False),
    }
    order = [v.key for v in rank(rows, torch, base_spec(model="mlp").reward)]
    assert order == ["rule:static", "trial:7", "trial:9", "rule:torch", "rule:jmp"]
    tie = {**rows, "trial:8": validated("trial:8", 0.125, 0.01)}
    order = [v.key for v in rank(tie, torch, base_spec(model="mlp").reward)]
    assert order.index("rule:static") < order.index("trial:8")  # a tie goes to the rule


@pytest.mark.slow  # long clean runs of mlp
def test_the_pick_skips_what_fails_the_check_and_exports_the_next(check):
    study = optuna.create_study()
    torch = validated("rule:torch", 0.125, 0.3)
    eager = validated("trial:3", 0.125, 0.0)  # best on the short validation...
    static = validated("rule:static", 0.125, 0.01)
    factories = {
        "trial:3": scaler("fairseq", **EAGER),  # ...but harms a long clean run
        "rule:static": scaler("static"),
        "rule:torch": scaler("torch"),
    }
    said = []
    timings = Timings({workload_key(w): Timing(0.001, 0.1, 0.01, 4) for w in check.gate.workloads})
    choice = choose(
        study,
        rank({v.key: v for v in (torch, eager, static)}, torch, base_spec(model="mlp").reward),
        factories,
        check,
        timings,
        Ledger(),
        stop_at=math.inf,
        say=said.append,
    )
    assert choice.winner is not None and choice.winner.key == "rule:static"
    assert [v.passed for v in choice.verdicts] == [False, True]
    assert said[0].startswith("3 fails the no-harm check") and "static passed" in said[1]
    stored = study.user_attrs[GATE_PREFIX + "trial:3"]
    assert stored["passed"] is False and stored["reasons"]
    # a second pick reads the stored verdicts: no run, nothing said again
    again = choose(
        study,
        rank({v.key: v for v in (torch, eager, static)}, torch, base_spec(model="mlp").reward),
        factories,
        check,
        timings,
        Ledger(),
        stop_at=math.inf,
        say=said.append,
    )
    assert again.winner.key == "rule:static" and len(said) == 2


@pytest.mark.slow  # long clean runs of mlp
def test_no_time_for_the_check_means_no_export_of_that_candidate(check):
    study = optuna.create_study()
    torch = validated("rule:torch", 0.125, 0.3)
    best = validated("rule:static", 0.125, 0.0)
    timings = Timings({workload_key(w): Timing(10.0, 0.1, 0.01, 4) for w in check.gate.workloads})
    choice = choose(
        study,
        rank({v.key: v for v in (torch, best)}, torch, base_spec(model="mlp").reward),
        {"rule:static": scaler("static")},
        check,
        timings,
        Ledger(),
        stop_at=0.0,
        say=print,
    )
    assert choice.winner.key == "rule:torch"  # the reference, which passes by definition
    assert choice.unchecked and "no-harm check needs" in choice.unchecked[0]
