"""WorkloadSpec: validation with did-you-mean, and the YAML/JSON round trip."""

import json

import pytest
import yaml

from autoscale.errors import ConfigError, UnknownNameError
from autoscale.training import WorkloadSpec, list_models, list_scenarios


def test_presets_and_scenarios_are_listed():
    assert list_models() == ["gpt2", "gpt2-medium", "gpt2-tiny", "mlp", "autoencoder"]
    assert list_scenarios()[:5] == ["clean", "bad-batches", "small-grads", "moving", "preference"]


def test_defaults():
    spec = WorkloadSpec()
    assert (spec.model, spec.scenario, spec.dtype, spec.batch_size, spec.seq_len) == (
        "gpt2-tiny",
        "clean",
        "fp16",
        4,
        64,
    )
    assert spec.clip == 1.0 and spec.init == "auto" and spec.device is None


@pytest.mark.parametrize("dump,load", [(yaml.safe_dump, yaml.safe_load), (json.dumps, json.loads)])
def test_round_trip(dump, load):
    spec = WorkloadSpec(
        model="mlp",
        scenario="moving",
        scenario_params={"peak": 256, "at": 5},
        dtype="bf16",
        clip=None,
        seed=3,
    )
    back = WorkloadSpec.from_dict(load(dump(spec.to_dict())))
    assert back == spec
    assert back.scenario_params == {"peak": 256.0, "at": 5}
    assert isinstance(back.scenario_params["peak"], float) and isinstance(
        back.scenario_params["at"], int
    )


def test_replace_validates_again():
    spec = WorkloadSpec(model="mlp")
    assert spec.replace(seed=4).seed == 4
    assert spec.replace(dtype="float16").dtype == "fp16"  # alias
    with pytest.raises(ConfigError, match="batch_size must be a positive integer, got 0"):
        spec.replace(batch_size=0)
    with pytest.raises(ConfigError, match="unknown key 'sed'; did you mean 'seed'"):
        spec.replace(sed=1)


def test_specs_are_hashable():
    a = WorkloadSpec(scenario="moving", scenario_params={"at": 3, "peak": 8.0})
    b = WorkloadSpec(scenario="moving", scenario_params={"peak": 8.0, "at": 3})
    assert a == b and hash(a) == hash(b) and len({a, b, a.replace(seed=1)}) == 2


def test_params_are_copied_not_shared():
    params = {"every": 3}
    spec = WorkloadSpec(scenario="bad-batches", scenario_params=params)
    params["every"] = 99
    assert spec.scenario_params == {"every": 3}


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (
            {"model": "gpt2-tinny"},
            UnknownNameError,
            "unknown model 'gpt2-tinny'; did you mean 'gpt2-tiny'",
        ),
        (
            {"scenario": "bad-batch"},
            UnknownNameError,
            "unknown scenario 'bad-batch'; did you mean 'bad-batches'",
        ),
        (
            {"scenario": "bad-batches", "scenario_params": {"evry": 3}},
            ConfigError,
            "no parameter 'evry'; did you mean 'every'",
        ),
        (
            {"scenario": "clean", "scenario_params": {"x": 1}},
            ConfigError,
            "scenario 'clean' has no parameter 'x'; \\(it takes: decay, floor, warmup\\)",
        ),
        (
            {"scenario": "bad-batches", "scenario_params": {"every": 2.5}},
            ConfigError,
            "'every' must be an integer, got 2.5",
        ),
        (
            {"scenario": "small-grads", "scenario_params": {"weight": -1}},
            ConfigError,
            "'weight' must be > 0",
        ),
        ({"scenario": "moving", "scenario_params": {"width": 0}}, ConfigError, "width >= 1"),
        ({"dtype": "fp8"}, ConfigError, "dtype must be one of fp16, bf16, fp32, got 'fp8'"),
        ({"lr": -1.0}, ConfigError, "lr must be a positive finite number"),
        ({"clip": 0.0}, ConfigError, "clip must be a positive finite number"),
        ({"seq_len": 1}, ConfigError, "seq_len must be at least 2"),
        ({"init": "pretrain"}, ConfigError, "init must be one of auto, pretrained, random"),
        ({"seed": -1}, ConfigError, "seed must be a non-negative integer"),
        ({"device": "gpu:x"}, ConfigError, "not a torch device"),
    ],
)
def test_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        WorkloadSpec(**kwargs)


def test_from_dict_refuses_unknown_keys():
    with pytest.raises(ConfigError, match="unknown key 'modle'; did you mean 'model'"):
        WorkloadSpec.from_dict({"modle": "mlp"})
    with pytest.raises(ConfigError, match="must be a mapping"):
        WorkloadSpec.from_dict(["mlp"])


def test_hub_ids_and_paths_pass_name_check(tmp_path):
    # whether their files exist is checked when a TrainingRun is built
    assert WorkloadSpec(model="someorg/some-model").model == "someorg/some-model"
    assert WorkloadSpec(model=str(tmp_path)).model == str(tmp_path)
