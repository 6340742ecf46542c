import optuna
import pytest

from autoscale.envs.episodes import scaler_for
from autoscale.search.space import (
    KNOBS,
    default_trial_params,
    parametric_families,
    suggest_parametric,
    suggest_residual,
)
from autoscale.search.workload import base_spec
from tests.search.conftest import RULES

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_families_are_the_built_in_rules_with_their_defaults():
    fams = parametric_families()
    assert set(RULES) <= set(fams)
    assert fams["torch"]["growth_interval"] == 2000


def test_every_sampled_rule_builds_a_valid_scaler():
    spec = base_spec(model="mlp")
    fams = parametric_families()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = set()
    for _ in range(80):
        trial = study.ask()
        rule, params = suggest_parametric(trial, fams)
        seen.add(rule)
        scaler = scaler_for(rule, spec, **params)
        for k, v in params.items():
            if k in KNOBS and KNOBS[k].kind != "bool":
                assert KNOBS[k].low <= v <= KNOBS[k].high
        assert scaler.get_scale() > 0
        study.tell(trial, 0.0)
    assert seen == set(fams)


@pytest.mark.parametrize("rule", ["torch", "deepspeed", "static", "amax-history"])
def test_enqueued_defaults_reproduce_the_built_in_rule(rule):
    spec = base_spec(model="mlp")
    fams = parametric_families()
    study = optuna.create_study()
    study.enqueue_trial(default_trial_params(rule, fams[rule], spec.episode))
    trial = study.ask()
    got_rule, params = suggest_parametric(trial, fams)
    assert got_rule == rule
    tuned, builtin = scaler_for(rule, spec, **params), scaler_for(rule, spec)
    assert tuned.rule.params() == builtin.rule.params()
    assert tuned.get_scale() == builtin.get_scale() == spec.episode.init_scale


def test_rl_space_samples_residual_agents_of_discrete_offsets():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    algos = set()
    for _ in range(30):
        cfg = suggest_residual(study.ask())
        algos.add(cfg["algo"])
        assert 1e-4 <= cfg["hyperparams"]["learning_rate"] <= 3e-3
        assert 0.8 <= cfg["hyperparams"]["gamma"] <= 0.99
        assert 0.25 <= cfg["precision_x"] <= 4.0
    assert algos == {"ppo", "a2c", "dqn"}
