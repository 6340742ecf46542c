from pathlib import Path

import pytest

from autoscale.envs import load_env_spec
from autoscale.envs.suite import SuiteSpec, as_suite, load_spec
from autoscale.errors import ConfigError, UnknownNameError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "envs").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_specs_load_and_round_trip(path):
    spec = load_spec(path)
    for member in as_suite(spec).members + as_suite(spec).left_out:
        assert member.instances["train"] and member.instances["test"]
    cls = type(spec)
    again = cls.from_dict(spec.to_dict())
    assert again.to_dict() == spec.to_dict()


def test_every_scenario_has_a_spec():
    from autoscale.training import list_scenarios

    specs = [load_spec(p) for p in (ROOT / "envs").glob("*.yaml")]
    scenarios = {s.workload.scenario for s in specs if not isinstance(s, SuiteSpec)}
    assert set(list_scenarios()) <= scenarios


def test_spec_by_name():
    assert load_env_spec("bad-batches").workload.scenario == "bad-batches"
    with pytest.raises(
        UnknownNameError, match="unknown env spec 'bad-batchs'; did you mean 'bad-batches'"
    ):
        load_env_spec("bad-batchs")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "name: x\nworkload: {model: mlp}\nepisod: {steps: 3}\n",
            "unknown key 'episod'; did you mean 'episode'",
        ),
        (
            "name: x\nworkload: {model: mlp}\nepisode: {step: 3}\n",
            "unknown key 'step'; did you mean 'steps'",
        ),
        (
            "name: x\nmodel: mlp\n",
            r"unknown key 'model'; it belongs under 'workload:' \(allowed: name, workload,",
        ),
        ("name: x\nworkload: {model: mlp}\nhorizon: 9\n", "'horizon'; it belongs under 'episode:'"),
        (
            "name: x\nworkload: {model: mlp}\ninstances: {train: [0]}\n",
            "instance set 'test' is missing or empty",
        ),
        (
            "name: x\nworkload: {model: mlp}\ninstances: {train: [0], test: [0]}\n",
            "repeat a train instance",
        ),
        (
            "name: x\nworkload: {model: mlp}\nepisode: {steps: 0}\ninstances: {train: [0], test: [1]}\n",
            "steps must be a positive integer",
        ),
        (
            "name: x\nworkload: {model: mlpp}\ninstances: {train: [0], test: [1]}\n",
            "did you mean 'mlp'",
        ),
        ("name: x\n  workload: [\n", "is not valid YAML"),
        ("- 1\n- 2\n", "expected a mapping"),
        (
            "name: x\nworkload: {model: mlp}\nepisode: {init_scale: lots}\ninstances: {train: [0], test: [1]}\n",
            "is not a number",
        ),
        (
            "name: x\nworkload: {model: mlp}\nreward: {skip: -1}\ninstances: {train: [0], test: [1]}\n",
            "must be a finite number >= 0",
        ),
    ],
)
def test_bad_spec_files(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises((ConfigError, UnknownNameError), match=message):
        load_env_spec(path)


def test_unreadable_spec(tmp_path):
    with pytest.raises(ConfigError, match="file '.*none.yaml' does not exist; give the path"):
        load_env_spec(tmp_path / "none.yaml")
    with pytest.raises(UnknownNameError, match="unknown env spec 'none'"):
        load_env_spec("none")  # a name, not a path
