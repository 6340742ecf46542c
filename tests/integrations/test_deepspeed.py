"""DeepSpeed: deepspeed_config turns a rule or an exported parametric policy into DeepSpeed's JSON.

DeepSpeed is not installed here: the fp16 block is checked against the fields and types that
DeepSpeed's own parser declares (``DeepSpeedFP16Config`` in ``deepspeed/runtime/precision_config.py``,
a pydantic model that forbids unknown keys), and the file is read back with Accelerate's DeepSpeed
config reader.
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="needs accelerate: pip install -e '.[dev]'")


import json

from accelerate.utils.deepspeed import HfDeepSpeedConfig

import autoscale
from autoscale.errors import ConfigError, UnknownNameError
from autoscale.integrations.deepspeed import HF_AUTO_BATCH, deepspeed_config, write_deepspeed_config
from autoscale.scalers.policies import PolicyManifest, write_manifest
from autoscale.search.export import export_parametric

# DeepSpeedFP16Config's fields and types; int fields take no fraction, so 2^-24 is refused there.
DEEPSPEED_FP16_FIELDS = {
    "enabled": bool,
    "auto_cast": bool,
    "loss_scale": (int, float),
    "initial_scale_power": int,
    "loss_scale_window": int,
    "hysteresis": int,
    "consecutive_hysteresis": bool,
    "min_loss_scale": int,
    "fp16_master_weights_and_grads": bool,
}


def assert_deepspeed_accepts(block: dict) -> None:
    assert set(block) <= set(DEEPSPEED_FP16_FIELDS), set(block) - set(DEEPSPEED_FP16_FIELDS)
    for key, value in block.items():
        kind = DEEPSPEED_FP16_FIELDS[key]
        is_bool = isinstance(value, bool)
        assert isinstance(value, kind) and (kind is bool or not is_bool), f"{key}={value!r}"
    assert block.get("min_loss_scale", 1) >= 1 and block.get("loss_scale", 0) >= 0


def test_deepspeed_rule_gives_deepspeeds_own_defaults():
    config = deepspeed_config("deepspeed")
    # DeepSpeed's documented FP16_FORMAT defaults, which the "deepspeed" rule reproduces
    assert config == {
        **HF_AUTO_BATCH,
        "fp16": {
            "enabled": True,
            "initial_scale_power": 16,
            "min_loss_scale": 1,
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "consecutive_hysteresis": False,
        },
    }
    assert_deepspeed_accepts(config["fp16"])


def test_torch_rule_and_a_built_scaler():
    fp16 = deepspeed_config("torch", growth_interval=500)["fp16"]
    assert_deepspeed_accepts(fp16)
    # torch's 2^-24 floor becomes DeepSpeed's lowest (1); its first growth after 500 clean steps
    # is DeepSpeed's window + 1
    assert fp16 == {
        "enabled": True,
        "initial_scale_power": 16,
        "min_loss_scale": 1,
        "loss_scale": 0,
        "loss_scale_window": 499,
        "hysteresis": 1,
        "consecutive_hysteresis": False,
    }
    built = autoscale.get_scaler(
        "deepspeed", device="cpu", init_scale=2.0**10, hysteresis=3, min_scale=4.0
    )
    fp16 = deepspeed_config(built)["fp16"]
    assert (fp16["initial_scale_power"], fp16["hysteresis"], fp16["min_loss_scale"]) == (10, 3, 4)


def test_static_rule_keeps_any_scale():
    assert deepspeed_config("static", init_scale=100.0)["fp16"] == {
        "enabled": True,
        "loss_scale": 100.0,
    }


def test_exported_parametric_policy(tmp_path, monkeypatch):
    folder = export_parametric(
        "deepspeed", {"init_scale": 2.0**12, "loss_scale_window": 500}, "tuned-ds", out_dir=tmp_path
    )
    monkeypatch.setenv("AUTOSCALE_POLICY_PATH", str(tmp_path))
    by_name = deepspeed_config("tuned-ds")
    assert by_name == deepspeed_config(str(folder))
    assert (
        by_name["fp16"]["initial_scale_power"] == 12 and by_name["fp16"]["loss_scale_window"] == 500
    )
    # the export wrote the same block next to the manifest
    assert json.loads((folder / "deepspeed.json").read_text())["fp16"] == by_name["fp16"]
    assert deepspeed_config("tuned-ds", loss_scale_window=50)["fp16"]["loss_scale_window"] == 50


def test_base_config_is_merged_not_modified():
    base = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 2},
        "fp16": {
            "enabled": "auto",
            "auto_cast": True,
            "loss_scale_window": 7,
            "initial_scale_power": 32,
        },
    }
    before = json.dumps(base, sort_keys=True)
    config = deepspeed_config("deepspeed", base)
    assert json.dumps(base, sort_keys=True) == before
    assert (
        config["zero_optimization"] == {"stage": 2}
        and config["train_micro_batch_size_per_gpu"] == 4
    )
    assert "train_batch_size" not in config  # a base config replaces the "auto" defaults
    assert config["fp16"]["auto_cast"] is True  # kept: not a scale key
    assert (
        config["fp16"]["loss_scale_window"] == 1000 and config["fp16"]["initial_scale_power"] == 16
    )
    assert config["fp16"]["enabled"] is True


@pytest.mark.parametrize(
    ("name", "kwargs", "error", "match"),
    [
        (
            "amax-history",
            {},
            ConfigError,
            r"rule 'amax-history' cannot be expressed in DeepSpeed's fp16 block",
        ),
        (
            "deepspeed",
            {"scale_factor": 4.0},
            ConfigError,
            r"fixes scale_factor at 2; this rule uses 4",
        ),
        ("torch", {"init_scale": 1000.0}, ConfigError, r"initial_scale_power.*1000 is not one"),
        (
            "deepspeed",
            {"min_scale": 2.5},
            ConfigError,
            r"min_loss_scale is an integer; min_scale 2\.5.*min_scale=2 or 3",
        ),
        (
            "deepspeed",
            {"base_config": {"bf16": {"enabled": True}}},
            ConfigError,
            r"enables bf16.*bf16\.enabled to false",
        ),
        (
            "deepspeed",
            {"base_config": "missing.json"},
            ConfigError,
            r"cannot read DeepSpeed config 'missing\.json'",
        ),
        (
            "deepspeeed",
            {},
            UnknownNameError,
            r"unknown scaler 'deepspeeed'; did you mean 'deepspeed'\?",
        ),
    ],
)
def test_what_deepspeed_cannot_run(name, kwargs, error, match):
    with pytest.raises(error, match=match):
        deepspeed_config(name, **kwargs)


def test_neural_policy_is_refused(tmp_path):
    write_manifest(tmp_path / "net", PolicyManifest(name="net", kind="neural", family="mlp-ppo"))
    with pytest.raises(ConfigError, match=r"policy 'net' is a neural policy.*get_scaler\('net'\)"):
        deepspeed_config(str(tmp_path / "net"))


def test_written_file_reads_back(tmp_path):
    path = write_deepspeed_config(
        "megatron", tmp_path / "ds" / "config.json", base_config={"train_batch_size": 8}
    )
    assert json.loads(path.read_text()) == deepspeed_config("megatron", {"train_batch_size": 8})
    read = HfDeepSpeedConfig(str(path))  # what Accelerate's DeepSpeedPlugin parses
    assert read.is_true("fp16.enabled") and read.get_value("fp16.initial_scale_power") == 32
    assert_deepspeed_accepts(read.config["fp16"])


def test_rule_knobs_not_gradscaler_defaults_decide_the_block():
    """megatron/jmp keep their knobs in their own attributes, not GradScaler's private ones."""

    def deepspeed_fp16_config(name, params):
        return deepspeed_config(name, **params)["fp16"]

    assert deepspeed_fp16_config("megatron", {})["loss_scale_window"] == 999
    assert deepspeed_fp16_config("megatron", {"growth_interval": 50})["loss_scale_window"] == 49
    assert deepspeed_fp16_config("jmp", {"period": 10})["loss_scale_window"] == 9
    with pytest.raises(
        ConfigError, match="fixes the factors at 2 and 1/2; rule 'megatron' uses 3.05"
    ):
        deepspeed_fp16_config("megatron", {"growth_factor": 3.05, "backoff_factor": 0.81})


@pytest.mark.parametrize(
    ("family", "params", "key", "value"),
    [
        ("deepspeed", {"loss_scale_window": 50, "hysteresis": 3}, "hysteresis", 3),
        ("static", {"init_scale": 1024.0}, "loss_scale", 1024.0),
        ("torch", {"growth_interval": 100}, "loss_scale_window", 99),
    ],
)
def test_built_scaler_of_an_exported_policy_of_any_family(
    tmp_path, monkeypatch, family, params, key, value
):
    """The block comes from the scaler's rule, not from its name: an exported policy is named
    after itself, and its built scaler used to be refused as a rule DeepSpeed cannot express."""
    export_parametric(family, params, f"tuned-{family}", out_dir=tmp_path)
    monkeypatch.setenv("AUTOSCALE_POLICY_PATH", str(tmp_path))
    scaler = autoscale.get_scaler(f"tuned-{family}", device="cpu")
    assert scaler.name == f"tuned-{family}"
    built = deepspeed_config(scaler)["fp16"]
    assert built[key] == value
    assert built == deepspeed_config(f"tuned-{family}")["fp16"]  # the string form agrees
    assert_deepspeed_accepts(built)
