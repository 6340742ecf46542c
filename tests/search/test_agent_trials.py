"""The study's first RL trial fine-tunes the general agent shipped with autoscale; the trials after
it sample their own; an agent that cannot act on the search's episodes is said so, and agents
start from nothing."""

from __future__ import annotations

import time

import optuna
import pytest

from autoscale.agents import warm as warm_mod
from autoscale.search.agent_trials import RLObjective
from autoscale.search.budget import Ledger
from autoscale.search.loop import TrialLoop
from tests.search.test_trials import _parts, _study, setup  # noqa: F401  (setup: a fixture)

TrialState = optuna.trial.TrialState


def _ship(suite, traces, folder, offsets=None):
    """A residual agent on auto, trained briefly on the suite's replay, shipped into ``folder``."""
    from autoscale.agents.residual import train_residual
    from autoscale.scalers.actions import ActionMap
    from autoscale.scalers.residual import default_offsets

    result = train_residual(suite, "ppo", 64, replay=traces, select_on=None, window=8, seed=3,
                            hyperparams={"n_steps": 32, "batch_size": 16})  # fmt: skip
    zip_path = folder / "trained.zip"
    folder.mkdir(parents=True, exist_ok=True)
    result.model.save(zip_path)
    action = ActionMap(deltas=offsets or default_offsets()).to_dict()
    return warm_mod.ship_agent(
        zip_path, name="residual-test", algo="ppo", history=1, scale_time=False, action=action,
        info={"trained_on": "the test suite"}, folder=folder, which=warm_mod.RESIDUAL, window=8,
    )  # fmt: skip


def _warm_trials(root, suite, traces, name: str, n: int, seconds: float) -> tuple[list, list[str]]:
    """``n`` RL trials of a new study with the warm start on; (its trials, what was said)."""
    ledger = Ledger()
    bench, _, recorder, work = _parts(root, suite, traces, ledger)
    study = _study(root, name)
    said: list[str] = []
    objective_fn = RLObjective(
        bench, recorder, ledger, stop_at=time.monotonic() + seconds, seed=0, workdir=work,
        warm_start=True, warn=said.append,
    )  # fmt: skip
    counts = {"complete": 0, "pruned": 0, "failed": 0}
    TrialLoop(study, ledger, worker=f"t:{name}", warn=said.append, counts=counts, n_trials=n).run(
        objective_fn, time.monotonic() + 120
    )
    return study.get_trials(), said


@pytest.mark.slow
@pytest.mark.paced
def test_the_first_rl_trial_fine_tunes_the_shipped_agent(setup, tmp_path, monkeypatch):  # noqa: F811
    root, suite, traces = setup
    agent = _ship(suite, traces, tmp_path / "warm")
    assert warm_mod.shipped_agent(tmp_path / "warm", warm_mod.RESIDUAL) == agent
    monkeypatch.setattr(warm_mod, "WARM_DIR", tmp_path / "warm")
    (first, second), said = _warm_trials(root, suite, traces, "warm", 2, 8)
    assert first.state == second.state == TrialState.COMPLETE, said
    assert first.user_attrs["warm_start"] == "residual-test"
    policy = first.user_attrs["policy"]
    assert policy["warm_start"] == "residual-test" and policy["kind"] == "residual"
    assert policy["window"] == 8 and policy["base"] == "auto"
    assert policy["algo"] == "ppo" and first.params == {}  # not sampled
    before = first.user_attrs["warm_before"]
    assert isinstance(before, float) and before == before  # the agent as shipped, scored
    assert first.value <= before  # a fine-tuning that does not beat the start is dropped
    assert first.user_attrs.get("warm_kept", False) == (first.value == before)
    assert "warm_start" not in second.user_attrs and "algo" in second.params  # sampled, cold
    assert said == []


@pytest.mark.slow
@pytest.mark.paced
def test_with_no_time_left_the_warm_trial_is_the_shipped_agent_as_it_came(
    setup,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """A busy machine that left the search no time still gets its agent: the shipped one,
    scored on the replay, untrained (seconds), so it reaches the real-step validation."""
    root, suite, traces = setup
    _ship(suite, traces, tmp_path / "warm")
    monkeypatch.setattr(warm_mod, "WARM_DIR", tmp_path / "warm")
    (trial,), said = _warm_trials(root, suite, traces, "late", 1, -5.0)  # the stop is past
    assert trial.state == TrialState.COMPLETE, said
    assert trial.user_attrs["warm_start"] == "residual-test" and trial.user_attrs["warm_kept"]
    assert trial.user_attrs["policy"]["timesteps"] == 0
    assert trial.value == trial.user_attrs["warm_before"]


@pytest.mark.slow
@pytest.mark.paced
def test_an_agent_of_other_actions_is_refused_in_a_line_and_agents_start_cold(
    setup,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    root, suite, traces = setup
    _ship(suite, traces, tmp_path / "warm", offsets=(-1.0, 0.0, 1.0))
    monkeypatch.setattr(warm_mod, "WARM_DIR", tmp_path / "warm")
    (trial,), said = _warm_trials(root, suite, traces, "cold", 1, 3)
    assert "warm_start" not in trial.user_attrs and "algo" in trial.params
    assert len(said) == 1 and said[0].startswith("agents start from nothing: ")
    assert "residual-test" in said[0] and "\n" not in said[0]


def test_nothing_ships_when_a_file_is_missing(tmp_path):
    assert warm_mod.shipped_agent(tmp_path) is None
    (tmp_path / "general.yaml").write_text("name: x\n")
    assert warm_mod.shipped_agent(tmp_path) is None  # no model beside it


def test_a_dqn_agent_goes_on_from_where_it_ended_not_from_random_actions(
    tiny_spec, tiny_trace, tmp_path
):
    """Fine-tuning a trained DQN keeps its final exploration (a fresh run would start from 1.0:
    random actions, the shipped agent's knowledge thrown away for the first part of the budget);
    a model of other spaces is refused in one line."""
    from autoscale.agents.train import train_agent
    from autoscale.errors import ConfigError

    first = train_agent(tiny_spec, "dqn", 64, replay=tiny_trace, seed=0)
    first.model.save(tmp_path / "dqn.zip")
    again = train_agent(tiny_spec, "dqn", 32, replay=tiny_trace, seed=1, init=tmp_path / "dqn.zip")
    eps = first.model.exploration_final_eps
    assert again.model.exploration_rate == pytest.approx(eps) and eps < 0.5
    with pytest.raises(ConfigError, match="cannot go on training .* as a ppo agent here") as e:
        train_agent(tiny_spec, "ppo", 32, replay=tiny_trace, init=tmp_path / "dqn.zip")
    assert "\n" not in str(e.value)


def test_one_recorded_train_instance_per_member_is_ground_only_for_a_warm_start(
    setup,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """A re-plan under load may keep one train instance per member: a cold agent needs two (one
    selects it), so without a shipped residual agent the search runs no RL trial and says why
    once; with one, its fine-tuning goes to the real-step validation, which judges it anyway."""
    import dataclasses

    _, suite, traces = setup
    one = dataclasses.replace(
        suite,
        members=tuple(
            dataclasses.replace(m, instances={**m.instances, "train": m.instances["train"][:1]})
            for m in suite.members
        ),
    )
    monkeypatch.setattr(warm_mod, "WARM_DIR", tmp_path / "none")
    said: list[str] = []
    assert RLObjective.fits(suite, said.append) and said == []
    assert not RLObjective.fits(one, said.append)
    assert len(said) == 1 and said[0].startswith("no RL trials: an agent needs two")
    _ship(suite, traces, tmp_path / "warm")
    monkeypatch.setattr(warm_mod, "WARM_DIR", tmp_path / "warm")
    assert RLObjective.fits(one, said.append) and len(said) == 1
    assert not RLObjective.fits(one, said.append, warm_start=False)


@pytest.mark.slow
def test_an_rl_trials_training_leaves_the_time_its_scoring_took_before(
    setup,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """A trial trains until its deadline less what the last trial took after its training (the
    agent archived and scored on the replay), so it ends by its deadline instead of past it."""
    import autoscale.agents.residual as residual

    root, suite, traces = setup
    ledger = Ledger()
    bench, _, recorder, work = _parts(root, suite, traces, ledger)
    objective_fn = RLObjective(
        bench, recorder, ledger, stop_at=time.monotonic() + 600, seed=0, workdir=work
    )  # fmt: skip
    monkeypatch.setattr(objective_fn, "trial_seconds", lambda: 3.0)
    real, calls = residual.train_residual, []

    def train(*args, **kwargs):  # when it was called, its deadline, the reserve it was given
        calls.append((time.monotonic(), kwargs["deadline"], objective_fn.after_s))
        return real(*args, **kwargs)

    monkeypatch.setattr(residual, "train_residual", train)
    counts = {"complete": 0, "pruned": 0, "failed": 0}
    said: list[str] = []
    study = _study(root, "reserve")
    loop = TrialLoop(study, ledger, worker="t:r", warn=said.append, counts=counts, n_trials=2)
    loop.run(objective_fn, time.monotonic() + 120)
    assert counts["complete"] == 2 and len(calls) == 2, said
    (_, _, first_reserve), (called, deadline, reserve) = calls
    assert first_reserve == 0.0 and reserve > 0.0  # measured on the first trial
    assert deadline - called <= max(0.0, 3.0 - reserve)
