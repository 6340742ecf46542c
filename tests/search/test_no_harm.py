"""The no-harm check and the honest pick, on real clean runs of the mlp workload."""

from __future__ import annotations

import dataclasses
import math

import optuna
import pytest

from autoscale.scalers import make_scaler
from autoscale.search.budget import Ledger
from autoscale.search.candidates import Candidate
from autoscale.search.choose import (
    StoredPick,
    choose,
    stored_verdict,
    unchecked_lines,
    verdict_key,
)
from autoscale.search.export import rank
from autoscale.search.no_harm import (
    NoHarmCheck,
    Verdict,
    no_harm_label,
    no_harm_proxy,
    no_harm_workloads,
)
from autoscale.search.timing import REFERENCE_FACTOR, NoHarmPlan, Timing, Timings, workload_key
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
    no_harm = NoHarmPlan(no_harm_workloads([spec], STEPS), STEPS)
    return NoHarmCheck(no_harm, tmp_path_factory.mktemp("no_harm"), Ledger(), SCALE)


def scaler(name, **kw):
    return lambda: make_scaler(name, device="cpu", **SCALE, **kw)


def test_the_check_runs_long_clean_runs_and_a_drifting_one_with_a_schedule():
    w, drift = no_harm_workloads([base_spec(model="mlp")], 1000)
    assert w.model == "mlp" and w.scenario == "clean"
    assert w.scenario_params == {"warmup": 100, "decay": 900}
    assert drift.model == "mlp" and drift.scenario == "drift"
    assert drift.scenario_params == {
        "warmup": 100,
        "decay": 900,
        "down": 20.0,
        "up": 8.0,
        "length": 1000,
    }
    assert [no_harm_label(x) for x in (w, drift)] == ["mlp", "mlp/drift"]
    models = [w.model for w in no_harm_workloads([base_spec(model="gpt2-tiny")], 1000)]
    assert models == ["mlp", "gpt2-tiny", "mlp"]  # mlp and the searched model, mlp drifting
    assert no_harm_proxy(base_spec(model="gpt2").workload).model == "gpt2-tiny"
    assert no_harm_proxy(w) is None


@pytest.mark.slow  # long clean runs of mlp
@pytest.mark.paced
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
    assert "fails the no-harm check in long runs" in verdict.summary()


@pytest.mark.slow  # long clean runs of mlp
@pytest.mark.paced
def test_torch_itself_passes_and_its_runs_are_cached(check):
    verdict = check.check(scaler("torch"), "torch")  # (alone, or after the tests above)
    assert all(check.cached(w, s) for w in check.no_harm.workloads for s in check.no_harm.seeds)
    assert verdict.passed and verdict.reasons == []
    timeless = [
        {k: v for k, v in c.items() if k not in ("wall_s", "useful_steps_per_s")}
        for who in ("candidate", "torch")
        for c in verdict.runs["mlp"][who]
    ]
    assert timeless[0] == timeless[1]  # the same run: CPU training is deterministic
    assert "passed the no-harm check" in verdict.summary()
    timings = Timings(
        {workload_key(w): Timing(0.01, 0.1, 0.01, 4) for w in check.no_harm.workloads}
    )
    # candidates only: a clean and a drifting run of mlp, each step with its share of the fp32
    # reference backward (the build and the evaluation have none)
    run_s = 0.1 + STEPS * 0.01 * REFERENCE_FACTOR + 0.01
    assert check.cost(timings, 1) == pytest.approx(2 * run_s)


def test_torchs_uncached_runs_are_priced_at_the_recorded_step_time():
    """torch's runs record their traces (the screen replays them): a recorded step costs more than
    a plain one (1.5-1.6x measured here for mlp and gpt2-tiny), and pricing them as plain steps
    left the check of a fresh machine's first export short of time (it stopped at the budget's
    end, unchecked). Candidates' runs record nothing: plain steps."""
    plan = NoHarmPlan(no_harm_workloads([base_spec(model="mlp")], STEPS), STEPS)
    timings = Timings(
        {workload_key(w): Timing(0.01, 0.1, 0.01, 4, record_step_s=0.03) for w in plan.workloads}
    )
    recorded = 0.1 + STEPS * 0.03 * REFERENCE_FACTOR + 0.01
    plain = 0.1 + STEPS * 0.01 * REFERENCE_FACTOR + 0.01
    runs = len(plan.workloads)  # mlp clean and drifting
    assert plan.cost(timings, 0, lambda w, s: False) == pytest.approx(2 * runs * recorded)
    assert plan.cost(timings, 1, lambda w, s: False) == pytest.approx(runs * (2 * recorded + plain))
    assert plan.cost(timings, 1, lambda w, s: True) == pytest.approx(runs * plain)


def card(skip_rate, precision, steps=64, eval_loss=1.0):
    return Scorecard(
        steps, round(skip_rate * steps), skip_rate, precision, eval_loss, eval_loss, eval_loss,
        2.0**16, False, False, 1.0, 64.0,
    )  # fmt: skip


def validated(key, skip, precision, second=None, eval_loss=(1.0, 1.0)):
    """Two held-out episodes of one member: the same card twice, or ``second`` for the other."""
    key = Candidate.parse(key)
    cards = [
        card(skip, precision, eval_loss=eval_loss[0]),
        card(*(second or (skip, precision)), eval_loss=eval_loss[1]),
    ]
    return Validated(key, key.name, {"mlp/bad-batches": cards})


REWARD = base_spec(model="mlp").reward


def pick(check, rows, factories, *, study=None, step_s=0.001, stop_at=math.inf, **kw):
    """``choose`` on ``rows`` (torch first), with what it said."""
    study = study or optuna.create_study()
    said = []
    timings = Timings(
        {workload_key(w): Timing(step_s, 0.1, 0.01, 4) for w in check.no_harm.workloads}
    )
    ranked = rank({v.key: v for v in rows}, rows[0], REWARD)
    choice = choose(
        study, ranked, factories, check, timings, Ledger(), weights=REWARD, stop_at=stop_at,
        say=said.append, **kw,
    )  # fmt: skip
    return choice, said, study


def study_with(auto_passed: bool, reasons=(), shape: str = ""):
    """A study holding ``auto``'s verdict already, reached by a check of ``shape`` (a resumed
    search): no long runs for it here."""
    study = optuna.create_study()
    verdict = Verdict("auto", auto_passed, list(reasons), shape=shape)
    study.set_user_attr(verdict_key("policy:auto", shape), verdict.to_dict())
    return study


def test_a_built_in_rule_that_beats_every_candidate_ranks_first_and_auto_wins_ties():
    torch = validated("rule:torch", 0.125, 0.3)
    rows = {
        "rule:torch": torch,
        "trial:7": validated("trial:7", 0.125, 0.02),
        "rule:static": validated("rule:static", 0.125, 0.01),
        "trial:9": validated("trial:9", 0.3, 0.0),
        "rule:jmp": Validated(Candidate.rule("jmp"), "jmp", torch.cards, real=False),
    }
    order = [v.key for v in rank(rows, torch, REWARD)]
    assert order == ["rule:static", "trial:7", "trial:9", "rule:torch", "rule:jmp"]
    tie = {**rows, "trial:8": validated("trial:8", 0.125, 0.01)}
    order = [v.key for v in rank(tie, torch, REWARD)]
    assert order.index("rule:static") < order.index("trial:8")  # a tie goes to the rule
    tie["policy:auto"] = validated("policy:auto", 0.125, 0.01)
    assert [v.key for v in rank(tie, torch, REWARD)][0] == "policy:auto"  # and to auto first


def test_rules_that_tie_rank_the_same_whatever_order_they_were_validated_in():
    # the search ranks in the order it validated, `autoscale export` in the study's order: a
    # tie between rules (torch and deepspeed on steps where both keep one scale) goes to torch
    # both times, and between other rules by name
    torch = validated("rule:torch", 0.125, 0.3)
    rows = [validated(f"rule:{r}", 0.0, 0.05) for r in ("deepspeed", "megatron")]
    rows.append(validated("rule:torch", 0.0, 0.05))
    orders = {
        tuple(v.key for v in rank({v.key: v for v in group}, torch, REWARD))
        for group in (rows, rows[::-1], rows[1:] + rows[:1])
    }
    assert orders == {("rule:torch", "rule:deepspeed", "rule:megatron")}


def test_a_lead_within_the_seed_noise_exports_auto_and_says_why(check):
    torch = validated("rule:torch", 0.125, 0.3)
    auto = validated("policy:auto", 0.0, 0.05)
    noisy = validated("trial:3", 0.0, 0.02, second=(0.0, 0.07))  # better on average, by noise
    choice, said, _ = pick(
        check, [torch, auto, noisy], {}, study=study_with(True, shape=check.shape)
    )
    assert choice.winner.key == "policy:auto"
    # auto's verdict is the study's (a resumed search): not said here, handed back to be said
    # once as the earlier run's (runner._choose)
    assert [v.label for v in choice.reused] == ["auto"] and choice.reused[0].passed
    ld = choice.leads["trial:3"]
    assert ld.lead == pytest.approx(0.04) and ld.noise == pytest.approx(0.4) and not ld.clear
    assert choice.why.startswith(
        "auto is the best found for this run: the best (3) led it by 0.0400"
    )
    assert "within the seed noise (0.4000 on 2 episodes)" in choice.why
    assert said == []  # auto's verdict was stored: nothing ran, nothing said


def test_a_lead_on_one_episode_a_member_says_it_cannot_be_told_from_noise(check):
    def one(key, skip, precision):  # one held-out episode: no spread to measure
        key = Candidate.parse(key)
        return Validated(key, key.name, {"mlp/bad-batches": [card(skip, precision)]})

    torch, auto, better = (
        one("rule:torch", 0.125, 0.3),
        one("policy:auto", 0.0, 0.05),
        one("rule:jmp", 0.0, 0.02),
    )
    study = study_with(True, shape=check.shape)
    choice, _, _ = pick(check, [torch, auto, better], {}, study=study)
    assert choice.winner.key == "policy:auto"
    assert choice.leads["rule:jmp"].noise == math.inf
    assert "led it by 0.2400 on 1 held-out episode, one a member: too few" in choice.why
    assert "inf" not in choice.why
    # and `autoscale export --trial` of it says the same in its warning
    rows = {v.key: v for v in (torch, auto, better)}
    stored = StoredPick(choice, rows, torch, ("torch", "jmp"), REWARD)
    said = stored.objections(study, "rule:jmp")
    assert "its lead over auto (+0.2400) is on one held-out episode a member" in said[0], said
    assert not any("inf" in line for line in said), said


def test_a_clear_lead_of_a_fixed_scale_is_refused_unless_asked_for(check):
    torch = validated("rule:torch", 0.125, 0.3)
    auto = validated("policy:auto", 0.0, 0.05)
    static = validated("rule:static", 0.0, 0.0)
    refuse = {"rule:static": "'static' cannot follow gradients that drift"}.get
    choice, _, _ = pick(
        check,
        [torch, auto, static],
        {},
        study=study_with(True, shape=check.shape),
        refuse=lambda v: refuse(v.key),
    )
    assert choice.leads["rule:static"].clear and choice.refused == {
        "rule:static": refuse("rule:static")
    }
    assert choice.winner.key == "policy:auto"
    assert "no candidate that led it beyond the seed noise passed" not in choice.why
    assert choice.why == (
        f"auto is the best found for this run: static led it beyond the seed noise, but "
        f"{refuse('rule:static')}"
    )


def test_a_clear_lead_with_a_worse_held_out_loss_is_refused(check):
    """The objective prices skips and precision; a lead that ends the held-out episodes at a
    higher eval loss than auto's, beyond the seed noise, is not what a user runs for."""
    torch = validated("rule:torch", 0.125, 0.3)
    auto = validated("policy:auto", 0.0, 0.05, eval_loss=(4.0e-5, 4.0e-5))
    worse = validated("trial:5", 0.0, 0.0, eval_loss=(5.754e-5, 5.6e-5))  # +42%: refused
    level = validated("trial:6", 0.0, 0.01, eval_loss=(4.004e-5, 3.99e-5))  # within the noise
    study = study_with(True, shape=check.shape)
    study.set_user_attr(verdict_key("trial:6", check.shape), Verdict("6", True, []).to_dict())
    choice, _, _ = pick(check, [torch, auto, worse, level], {}, study=study)
    assert choice.leads["trial:5"].clear and "trial:5" in choice.refused
    assert choice.refused["trial:5"].startswith("its held-out eval loss is 41.9% above auto's")
    assert choice.winner.key == "trial:6"  # a level loss leaves the lead standing
    alone, _, _ = pick(check, [torch, auto, worse], {}, study=study_with(True, shape=check.shape))
    assert alone.winner.key == "policy:auto" and "eval loss is 41.9% above auto's" in alone.why


def test_torch_that_clearly_beats_auto_is_exported_without_a_check(check):
    torch = validated("rule:torch", 0.0, 0.0)
    auto = validated("policy:auto", 0.125, 0.05)
    choice, said, study = pick(check, [torch, auto], {}, study=study_with(True, shape=check.shape))
    assert choice.winner.key == "rule:torch" and said == []
    assert choice.why.startswith(
        "torch beat auto by 0.6500 on the objective, more than the seed noise"
    )


def test_auto_that_harms_this_run_gives_way_to_torch(check):
    torch = validated("rule:torch", 0.125, 0.3)
    auto = validated("policy:auto", 0.0, 0.05)
    study = study_with(
        False, ["mlp/drift seed 0: skipped 9.00% of 400 steps, torch 0.50%"], check.shape
    )
    choice, _, _ = pick(check, [torch, auto], {}, study=study)
    assert choice.winner.key == "rule:torch"
    assert choice.why == (
        "auto harms this run (mlp/drift seed 0: skipped 9.00% of 400 steps, torch 0.50%): "
        "torch's own rule, the reference"
    )


def test_without_auto_on_real_steps_there_is_no_pick(check):
    torch = validated("rule:torch", 0.125, 0.3)
    best = validated("trial:1", 0.0, 0.0)
    replayed = Validated(Candidate.parse("policy:auto"), "auto", torch.cards, real=False)
    choice, _, _ = pick(check, [torch, best, replayed], {})
    assert choice.winner is None and choice.bar is None
    assert choice.why == "auto could not be validated on real steps in the budget"
    assert choice.unchecked == [("auto", "validated on replay only")]


def test_where_replay_is_all_the_evidence_replayed_rows_choose_and_auto_that_harms_gives_torch(
    check,
):
    """A search on records: every row is replayed, and counts (``replay_counts``); the same walk
    down to ``auto`` and the same fall-back to ``torch`` where ``auto`` harms the runs."""
    rows = [
        dataclasses.replace(validated("rule:torch", 0.125, 0.3), real=False),
        dataclasses.replace(validated("policy:auto", 0.0, 0.05), real=False),
    ]
    stored = ["run: skips 9.00% of the clean steps, torch 0.50%"]
    choice, _, _ = pick(
        check, rows, {}, study=study_with(False, stored, check.shape), replay_counts=True
    )
    assert choice.winner is not None and choice.winner.key == "rule:torch"
    assert choice.why.startswith("auto harms this run (run: skips 9.00%")
    assert choice.unchecked == []
    # without it, replayed rows choose nothing (the workload search needs real steps)
    choice, _, _ = pick(check, rows, {}, study=study_with(False, stored, check.shape))
    assert (
        choice.winner is None
        and choice.why == "auto could not be validated on real steps in the budget"
    )


@pytest.mark.slow  # long runs of mlp, clean and drifting
@pytest.mark.paced
def test_a_fixed_scale_fails_the_drift_run_that_auto_passes(check):
    static = check.check(scaler("static"), "static")
    assert not static.passed
    drift = [r for r in static.reasons if r.startswith("mlp/drift")]
    assert any("skipped" in r for r in drift), static.reasons  # the rise past what 2^16 holds
    mine, ref = static.runs["mlp/drift"]["candidate"][0], static.runs["mlp/drift"]["torch"][0]
    assert mine["skip_rate"] > ref["skip_rate"] + 0.05 and mine["eval_loss"] > ref["eval_loss"]
    auto = check.check(scaler("auto"), "auto")
    assert auto.passed, auto.summary()
    assert set(auto.runs) == {"mlp", "mlp/drift"}


@pytest.mark.slow  # long runs of mlp
@pytest.mark.paced
def test_the_pick_skips_what_fails_the_check_and_exports_the_next_that_clears_auto(check):
    torch = validated("rule:torch", 0.125, 0.3)
    auto = validated("policy:auto", 0.0, 0.05)
    eager = validated("trial:3", 0.0, 0.0)  # best on the short validation...
    history = validated("trial:5", 0.0, 0.01)
    factories = {
        "trial:3": scaler("fairseq", **EAGER),  # ...but harms a long clean run
        "trial:5": scaler("torch"),  # passes: it is torch's own runs
        "policy:auto": scaler("auto"),
    }
    study = optuna.create_study()
    choice, said, _ = pick(check, [torch, auto, eager, history], factories, study=study)
    assert choice.winner is not None and choice.winner.key == "trial:5"
    assert [v.passed for v in choice.verdicts] == [False, True]
    assert said[0].startswith("3 fails the no-harm check") and "5 passed" in said[1]
    assert choice.why.startswith("5 beat auto by 0.3200 on the objective") and choice.why.endswith(
        "and passed the no-harm check"
    )
    stored = study.user_attrs[verdict_key("trial:3", check.shape)]
    assert stored["passed"] is False and stored["reasons"]
    # a second pick reads the stored verdicts: no run, nothing said again
    again, said_again, _ = pick(check, [torch, auto, eager, history], factories, study=study)
    assert again.winner.key == "trial:5" and said_again == []


@pytest.mark.slow  # torch's long runs of mlp (the screen replays them)
@pytest.mark.paced
def test_no_time_for_the_check_means_no_export_of_that_candidate(check):
    torch = validated("rule:torch", 0.125, 0.3)
    auto = validated("policy:auto", 0.0, 0.05)
    best = validated("trial:5", 0.0, 0.0)
    factories = {"trial:5": scaler("amax-history"), "policy:auto": scaler("auto")}
    choice, _, _ = pick(check, [torch, auto, best], factories, step_s=10.0, stop_at=0.0)
    assert choice.winner.key == "policy:auto"  # the bar, the shipped policy
    assert "its no-harm check did not fit in the time left" in choice.why
    assert choice.unchecked and "no-harm check needs" in choice.unchecked[0][1]
    # what the search says: one line for every scaler left unchecked for that reason
    (line,) = unchecked_lines(choice.unchecked)
    assert line.startswith("not checked: ") and "no-harm check needs" in line
    assert line.count("no-harm check needs") == 1
    # a label with parentheses of its own stays whole (labels and reasons are kept apart)
    why = "its no-harm check needs ~1m, 0s left"
    assert unchecked_lines([("trial 3 (amax-loss)", why), ("trial 4", why)]) == [
        f"not checked: trial 3 (amax-loss); trial 4 ({why})"
    ]


def test_scalers_left_unchecked_for_one_reason_are_said_in_one_line():
    needs = "its no-harm check needs ~3m01s, 2m30s left"
    lines = unchecked_lines(
        [
            ("amax-loss, trial 43", needs),
            ("amax-loss, trial 44", needs),
            ("deepspeed, auto", "validated on replay only"),
            ("auto", needs),
            ("static, trial 2", "RuntimeError: boom (inner)"),
        ]
    )
    assert lines == [
        f"not checked: amax-loss, trial 43; amax-loss, trial 44; auto ({needs})",
        "not checked: deepspeed, auto (validated on replay only)",
        "not checked: static, trial 2 (RuntimeError: boom (inner))",
    ]


def test_a_check_that_reaches_the_budgets_end_stops_there_and_says_so(check, tmp_path, monkeypatch):
    """A machine slower than planned: the check fits its estimate but its runs reach the
    deadline; they stop there, the candidate is not exported (no verdict is stored for it), and
    a torch run cut short is not cached."""
    import time

    from autoscale.search.no_harm import OutOfTime

    with pytest.raises(OutOfTime, match=r"stopped at the budget's end after \d+ of 400 steps"):
        check.check(scaler("amax-history"), "amax-history", deadline=time.monotonic() + 0.3)
    fresh = NoHarmCheck(check.no_harm, tmp_path, Ledger(), SCALE)  # torch's runs not cached here
    w = fresh.no_harm.workloads[0]
    with pytest.raises(OutOfTime, match="torch's mlp run"):
        fresh.reference(w, 0, deadline=time.monotonic() + 0.3)
    assert not fresh.cached(w, 0)

    torch = validated("rule:torch", 0.125, 0.3)
    auto = validated("policy:auto", 0.0, 0.05)
    best = validated("trial:5", 0.0, 0.0)
    factories = {"trial:5": scaler("amax-history"), "policy:auto": scaler("auto")}
    # auto's verdict is stored (no runs for it); the candidate's screen passes at once and its
    # check is estimated at microseconds: it starts, and its 800 real steps reach the deadline
    study = study_with(True, shape=check.shape)
    screened = Verdict("trial 5", True, [], screened=True)
    monkeypatch.setattr(check, "screen", lambda factory, label, deadline=None: screened)
    timings = Timings({workload_key(w): Timing(1e-6, 0.0, 0.0, 4) for w in check.no_harm.workloads})
    rows = [torch, auto, best]
    choice = choose(
        study, rank({v.key: v for v in rows}, torch, REWARD), factories, check, timings, Ledger(),
        weights=REWARD, stop_at=time.monotonic() + 0.2, say=lambda t: None,
    )  # fmt: skip
    assert choice.winner.key == "policy:auto"
    assert any("stopped at the budget's end" in why for _, why in choice.unchecked), (
        choice.unchecked
    )
    assert stored_verdict(study, "trial:5") is None


def test_the_screen_runs_torchs_uncached_runs_only_where_the_whole_check_fits(tmp_path):
    """On a new machine the screen's replay needs torch's first run of each workload: real
    steps, most of the check. They start only where the whole check's estimate fits before the
    deadline (they ran before that was asked, unbounded), and stop at it."""
    import time

    from autoscale.search.no_harm import OutOfTime

    fresh = NoHarmCheck(
        NoHarmPlan(no_harm_workloads([base_spec(model="mlp")], STEPS), STEPS),
        tmp_path, Ledger(), SCALE,
    )  # fmt: skip
    torch = validated("rule:torch", 0.125, 0.3)
    auto = validated("policy:auto", 0.0, 0.05)
    rows = [torch, auto]
    slow = Timings({workload_key(w): Timing(1.0, 0.1, 0.1, 4) for w in fresh.no_harm.workloads})
    choice = choose(
        optuna.create_study(), rank({v.key: v for v in rows}, torch, REWARD),
        {"policy:auto": scaler("auto")}, fresh, slow, Ledger(), weights=REWARD,
        stop_at=time.monotonic() + 5.0, say=lambda t: None,
    )  # fmt: skip
    assert choice.unchecked and "no-harm check needs" in choice.unchecked[0][1]
    assert not any(fresh.cached(w, 0) for w in fresh.no_harm.workloads)  # nothing ran
    with pytest.raises(OutOfTime, match="torch's mlp run"):
        fresh.screen(scaler("auto"), "auto", deadline=time.monotonic() + 0.2)
    assert not any(fresh.cached(w, 0) for w in fresh.no_harm.workloads)


FLUSH_STEPS = 60  # six windows of the fp32 reference: enough to see a scale keep nothing
FLUSH = {"init_scale": 2.0**-12, "min_scale": 2.0**-30}  # flushes every gradient of small-grads


@pytest.mark.slow
def test_a_scale_that_flushes_whole_gradients_is_harm_by_the_builds_measure(tmp_path):
    """A static scale of 2^-12 on mlp/small-grads (the loss x 1e-5) leaves the fp16 backward no
    non-zero gradient element. The scorecard's precision loss counts only the elements non-zero
    after that backward, so by it (the check's measure before) the run is as precise as torch's
    or more; the check now measures what the ``auto`` build's long runs measure, the share of the
    elements an fp32 backward leaves non-zero that reach the optimizer at fp16 precision, by the
    same code: it names the harm, with the numbers the build's long run of the member gives."""
    from pathlib import Path

    from autoscale.envs.suite import load_spec
    from autoscale.selection import suite_eval as ev

    suite = load_spec(Path(__file__).resolve().parents[2] / "envs" / "suite.yaml")
    member = suite.member("mlp/small-grads")
    check = NoHarmCheck(NoHarmPlan((member.workload,), FLUSH_STEPS), tmp_path, Ledger(), SCALE)
    flush = lambda: make_scaler("static", device="cpu", **FLUSH)  # noqa: E731
    verdict = check.check(flush, "flush")
    assert not verdict.passed
    mine, ref = (verdict.runs["mlp/small-grads"][who][0] for who in ("candidate", "torch"))
    assert mine["precision_loss"] <= ref["precision_loss"]  # the scorecard's: not worse than torch
    assert mine["kept"] == 0.0 and ref["kept"] > 0.5  # the reference's: it keeps nothing
    (why,) = [r for r in verdict.reasons if "at fp16 precision" in r]
    assert why.startswith("mlp/small-grads seed 0: keeps 0.00% of gradient elements")
    assert "kept at fp16 precision" not in verdict.summary()  # a failed check names its reasons

    torch = lambda: make_scaler("torch", device="cpu", **SCALE)  # noqa: E731
    long = ev.long_runs(suite, [member.name], {"flush": flush, "torch": torch}, FLUSH_STEPS, seed=0)
    assert ev.kept_share(long[member.name]["flush"]) == mine["kept"]
    assert ev.kept_share(long[member.name]["torch"]) == ref["kept"]
    build = [r for r in ev.long_harm(long, "flush")[member.name] if "at fp16 precision" in r]
    assert build == [why.removeprefix("mlp/small-grads seed 0: ")]


def test_a_verdict_is_reused_only_by_a_check_of_the_same_shape(tmp_path, monkeypatch):
    """Review item 7: a search whose budget checked gpt2 on its gpt2-tiny proxy keeps that
    verdict; a resume whose budget checks gpt2 itself checks again (here the real model's check
    fails where the proxy's passed), a check of the same shape reuses it, and export, which runs
    no check, reads the one stored last."""
    from autoscale.search.plan import fit_no_harm

    gpt2 = NoHarmPlan(no_harm_workloads([base_spec(model="gpt2")]), 1000)
    step_s = {"mlp": 0.001, "gpt2-tiny": 0.01, "gpt2": 0.5}
    proxy = no_harm_proxy(gpt2.workloads[1])
    timings = Timings(
        {workload_key(w): Timing(step_s[w.model], 0.1, 0.1, 4) for w in (*gpt2.workloads, proxy)}
    )

    def fitted(work_s):
        plan, _ = fit_no_harm(gpt2, timings, work_s, lambda w, s: False)
        return NoHarmCheck(plan, tmp_path, Ledger(), SCALE)

    small, large = fitted(600.0), fitted(20000.0)  # a 10-minute budget and a long one
    assert [w.model for w in small.no_harm.workloads] == ["mlp", "gpt2-tiny", "mlp"]
    assert [w.model for w in large.no_harm.workloads] == ["mlp", "gpt2", "mlp"]
    assert small.shape.startswith("mlp,gpt2-tiny,mlp/drift|1000|kept-fp32-v1|")
    assert large.shape.startswith("mlp,gpt2,mlp/drift|1000|kept-fp32-v1|")
    longer = NoHarmCheck(dataclasses.replace(small.no_harm, steps=2000), tmp_path, Ledger(), SCALE)
    assert len({small.shape, large.shape, longer.shape}) == 3

    ran = []
    for name, c in (("proxy", small), ("real", large)):

        def screen(factory, label, deadline=None, c=c):
            return Verdict(label, True, screened=True, shape=c.shape)

        def run(factory, label, deadline=None, name=name, c=c):
            ran.append((name, label))
            harmed = name == "real" and label == "5"
            return Verdict(
                label, not harmed, ["gpt2 seed 0: worse"] if harmed else [], shape=c.shape
            )

        monkeypatch.setattr(c, "screen", screen)
        monkeypatch.setattr(c, "check", run)

    torch = validated("rule:torch", 0.125, 0.3)
    auto = validated("policy:auto", 0.0, 0.05)
    best = validated("trial:5", 0.0, 0.0)
    factories = {"trial:5": scaler("torch"), "policy:auto": scaler("auto")}
    study = optuna.create_study()
    first, _, _ = pick(small, [torch, auto, best], factories, study=study)
    assert first.winner.key == "trial:5" and ran == [("proxy", "5")]
    again, said, _ = pick(small, [torch, auto, best], factories, study=study)
    assert again.winner.key == "trial:5" and said == [] and len(ran) == 1  # the same shape: reused
    resumed, said, _ = pick(large, [torch, auto, best], factories, study=study)
    assert ran[1:] == [("real", "5"), ("real", "auto")]  # another shape: checked again
    assert resumed.winner.key == "policy:auto" and said[0].startswith("5 fails the no-harm check")
    assert stored_verdict(study, "trial:5", small.shape).passed  # the proxy's verdict is kept
    assert not stored_verdict(study, "trial:5").passed  # export reads the latest


def test_the_pick_keeps_what_export_cannot_decide_again():
    """Why a lead was refused (the horizon's replay needs the search's bench) and the shape of
    the check whose verdicts counted: kept in the study, written once."""
    from autoscale.search.choose import CHECK_SHAPE, Choice, record_pick, stored_refusal

    study = optuna.create_study()
    choice = Choice(None, refused={"rule:torch": "its lead does not hold on the replay"})
    record_pick(study, choice, "mlp,mlp/drift|1000|x")
    assert stored_refusal(study.user_attrs, "rule:torch") == "its lead does not hold on the replay"
    assert stored_refusal(study.user_attrs, "trial:3") is None
    assert study.user_attrs[CHECK_SHAPE] == "mlp,mlp/drift|1000|x"
    writes = []
    study.set_user_attr = lambda k, v: writes.append(k)
    record_pick(study, choice, "mlp,mlp/drift|1000|x")
    assert writes == []  # nothing new: no storage write
