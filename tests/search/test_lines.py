"""Lines the search prints say what it does: the plan says RL was dropped, and why, where the RL
trials could not run; the no-harm screen states the margin it refuses at; progress bars are drawn
on a terminal only."""

from __future__ import annotations

import os

from autoscale.envs.suite import load_spec
from autoscale.scalers import make_scaler
from autoscale.search.agent_trials import RLObjective
from autoscale.search.budget import Ledger
from autoscale.search.no_harm import SCREEN_MARGIN, NoHarmCheck, no_harm_workloads
from autoscale.search.plan import make_plan, shape_suite
from autoscale.search.runner import rules_torch_first
from autoscale.search.timing import NoHarmPlan
from autoscale.search.workload import base_spec
from tests.search.test_plan import timings_for


def test_the_plan_drops_rl_where_a_member_has_one_train_instance_and_says_why(
    tmp_path, monkeypatch
):
    """A suite of 8 members, one train instance each (a re-plan under load keeps one): a cold
    agent needs one held out to select it on, so without the shipped residual agent to start from
    the plan searches the parametric space and its line says RL was dropped; with it, RL stays
    (the warm start is judged by the real-step validation alone)."""
    from autoscale.agents import warm

    suite = load_spec("suite")
    shaped = shape_suite(suite, 64, 1, 1)
    no_harm = NoHarmPlan(no_harm_workloads(list(suite.members)), 1000)

    def plan_of():
        return make_plan(
            suite, timings_for(suite, 0.002), 3600, no_harm=no_harm, space="both",
            rules=rules_torch_first(), stored=(shaped, shaped.with_episode_steps(64), 64),
        )  # fmt: skip

    assert warm.shipped_agent(which=warm.RESIDUAL) is not None  # it ships
    assert RLObjective.fits(shaped) and plan_of().space == "both"
    monkeypatch.setattr(warm, "WARM_DIR", tmp_path)  # none ships
    assert len(shaped.members) == 8 and not RLObjective.fits(shaped)
    plan = plan_of()
    assert plan.space == "parametric"
    line = plan.describe()
    assert "parametric space" in line and "both space" not in line
    assert (
        "RL dropped (an agent needs 2 train instances per member, one to select it on, or the "
        "shipped residual agent to start from; the plan keeps 1): searching the parametric space "
        "only" in line
    )


def test_the_screen_says_the_margin_it_refuses_at(tmp_path):
    """A scale that overflows on every step is refused on replay; the reason names the screen's
    own margin (+2%), not the long runs' (+0.5%)."""
    scale = {"init_scale": 2.0**16, "min_scale": 1.0, "max_scale": 2.0**40}
    plan = NoHarmPlan(no_harm_workloads([base_spec(model="mlp")], 64), 64)
    check = NoHarmCheck(plan, tmp_path, Ledger(), scale)
    verdict = check.screen(
        lambda: make_scaler("static", device="cpu", **{**scale, "init_scale": 2.0**40}), "huge"
    )
    assert not verdict.passed and verdict.screened
    assert all(
        r.endswith(f"(+{100 * SCREEN_MARGIN:.1f}% allowed on replay)") for r in verdict.reasons
    )
    assert "+0.5% allowed" not in verdict.summary()


def test_bars_are_drawn_on_a_terminal_only(tmp_path):
    from autoscale.search.report import draw_bars

    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as terminal, open(tmp_path / "log", "w") as log:
            assert draw_bars(True, terminal)
            assert not draw_bars(False, terminal)  # --quiet
            assert not draw_bars(True, log)  # piped to a file
    finally:
        os.close(master)
        os.close(slave)


def test_the_last_line_says_where_the_time_went_sampler_included(capsys):
    """With thousands of trials in a study, Optuna's TPE sampler takes most of a resumed search
    (its cost grows with the trials): the done line names its share beside the work and the
    bookkeeping, so the shares account for the time."""
    from autoscale.commands.search import _print_done
    from autoscale.search.runner import SearchResult

    ledger = Ledger()
    for category, seconds in (("work:replay", 40.0), ("alg:sampler", 180.0), ("bk:optuna", 30.0)):
        ledger.add(category, seconds)
    result = SearchResult("s", None, {"complete": 900, "pruned": 1200, "failed": 0},
                          wall_s=288.0, budget_s=300.0, ledger=ledger)  # fmt: skip
    _print_done(result, "sqlite:////tmp/a.db")
    assert capsys.readouterr().out.splitlines()[0] == (
        "done in 4m48s of a 5m budget; training and evaluation 14%, Optuna's sampler and pruner "
        "62%, bookkeeping (storage, plots, notes, artifacts) 10.4%; this worker ran 2100 trials"
    )


def test_a_passed_check_shows_the_seed_noise_its_eval_loss_is_judged_against():
    """A candidate's eval loss 10% above torch's passes where torch's own seeds spread wider:
    the line shows that spread, so a pass does not read as a failure."""
    from autoscale.search.no_harm import Verdict

    run = {"skip_rate": 0.0, "eval_loss": 0.001966, "kept": 1.0}
    ref = {"skip_rate": 0.0, "eval_loss": 0.001782, "kept": 0.9662}
    verdict = Verdict("auto", True, [], {"mlp/drift": {"candidate": [run], "torch": [ref],
                                                        "noise": 0.00031}})  # fmt: skip
    assert verdict.summary() == (
        "auto passed the no-harm check: mlp/drift: skipped 0.00% (torch 0.00%), eval loss "
        "0.001966 (torch 0.001782, seed noise 0.00031), kept at fp16 precision 100.00% "
        "(torch 96.62%)"
    )


def test_a_workload_is_named_once():
    """The search's first line and its table name the workload without saying the scenario
    twice (it read 'bad-batches (gpt2-tiny, bad-batches, fp16)')."""
    import dataclasses

    from autoscale.envs.suite import as_suite
    from autoscale.search.study import describe_spec

    spec = base_spec(model="gpt2-tiny", scenario="bad-batches")
    assert describe_spec(as_suite(spec)) == "gpt2-tiny/bad-batches (fp16)"
    mine = dataclasses.replace(spec, name="nightly")
    assert describe_spec(as_suite(mine)) == "nightly (gpt2-tiny, bad-batches, fp16)"


def test_a_scaler_left_unchecked_is_said_once_across_rounds(monkeypatch):
    """A candidate whose check does not fit is said once, not again each round with its seconds
    left counted down; one first left unchecked in a later round is said then."""
    from types import SimpleNamespace

    from autoscale.search import runner as runner_mod
    from autoscale.search.choose import Choice

    why = "its no-harm check needs ~26s, {}s left"
    rounds = [
        Choice(None, bar=object(), unchecked=[("trial 7", why.format(25))]),
        Choice(None, bar=object(), unchecked=[("trial 7", why.format(19)), ("trial 9", why.format(19))]),
    ]  # fmt: skip
    monkeypatch.setattr(runner_mod, "choose", lambda *a, **k: rounds.pop(0))
    monkeypatch.setattr(runner_mod, "record_pick", lambda *a, **k: None)
    said: list[str] = []
    runner = SimpleNamespace(
        source=None, study=None, cfg=SimpleNamespace(families=None), factories={}, no_harm=None,
        plan=SimpleNamespace(timings=None, suite=SimpleNamespace(reward=None)), ledger=Ledger(),
        budget=SimpleNamespace(end=0.0), bench=None, auto_replays={}, validated={}, said=set(),
        say=lambda phase, text: said.append(text),
    )  # fmt: skip
    for _ in range(2):
        runner_mod.SearchRunner._choose(runner, [])
    assert said == [
        f"not checked: trial 7 ({why.format(25)})",
        f"not checked: trial 9 ({why.format(19)})",
    ]
