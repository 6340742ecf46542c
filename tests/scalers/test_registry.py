"""Lookup by name: built-in rules, registered and third-party rules, exported policies, errors."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest

import autoscale
from autoscale.errors import ConfigError, PolicyError, UnknownNameError
from autoscale.scalers import LossScaler, ScaleRule, StepStats, policies, registry
from autoscale.scalers.policies import PolicyManifest, write_manifest
from autoscale.scalers.rules import TorchRule


@pytest.fixture
def clean_registry(monkeypatch):
    """Rules registered by a test disappear after it; entry points are scanned afresh."""
    monkeypatch.setattr(registry, "_RULES", dict(registry._RULES))
    monkeypatch.setattr(registry, "_PLUGINS", set())
    monkeypatch.setattr(registry, "_PLUGIN_ERRORS", {})
    monkeypatch.setattr(registry, "_ENTRY_POINTS_LOADED", False)
    return registry


def test_unknown_name_suggests_the_nearest_and_how_to_list():
    with pytest.raises(UnknownNameError) as info:
        autoscale.get_scaler("troch", device="cpu")
    message = str(info.value)
    assert "unknown scaler 'troch'" in message
    assert "did you mean 'torch'" in message
    assert "autoscale list" in message
    assert isinstance(info.value, KeyError)  # callers catching a missing key still work


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("torch", {"growth_factor": 1.0}, r"growth factor must be > 1.*got 1\.0"),
        ("deepspeed", {"scale_factor": 0.5}, r"growth factor must be > 1.*got 0\.5"),
        ("torch", {"backoff_factor": 1.0}, r"backoff factor must be in \(0, 1\).*got 1\.0"),
        ("megatron", {"backoff_factor": 1.5}, r"backoff factor.*got 1\.5"),
        (
            "torch",
            {"min_scale": 1e6, "max_scale": 10.0},
            r"min_scale \(1e\+06\) must not exceed max_scale \(10\)",
        ),
        ("torch", {"growth_interval": 0}, r"growth_interval must be a positive integer.*got 0"),
        ("deepspeed", {"loss_scale_window": -3}, r"loss_scale_window.*got -3"),
        ("jmp", {"period": 2.5}, r"period.*got 2\.5"),
        ("torch", {"init_scale": 0.0}, r"init_scale must be a positive finite number, got 0\.0"),
        ("static", {"init_scale": -1}, r"init_scale.*got -1"),
        ("torch", {"min_scale": math.inf}, r"min_scale.*got inf"),
        ("fairseq", {"tolerance": 2.0}, r"tolerance.*got 2\.0"),
        ("amax-history", {"margin": -1.0}, r"margin.*got -1\.0"),
        (
            "torch",
            {"growth_intervall": 5},
            r"takes no parameter 'growth_intervall'; did you mean 'growth_interval'",
        ),
    ],
)
def test_invalid_parameters_raise_value_error_naming_the_value(name, kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        autoscale.get_scaler(name, device="cpu", **kwargs)
    assert isinstance(info.value, ConfigError)


def test_register_a_custom_rule(clean_registry):
    @autoscale.register_loss_scaler("thirds")
    class Thirds(ScaleRule):
        description = "divide by 3 on overflow"

        def next_scale(self, scale: float, stats: StepStats) -> float:
            return scale / 3 if stats.found_inf else scale

    scaler = autoscale.get_scaler("thirds", device="cpu", init_scale=9.0)
    assert isinstance(scaler, LossScaler) and isinstance(scaler.rule, Thirds)
    assert scaler.name == "thirds"
    assert scaler.controller.step(StepStats(0, 9.0, True)) == 3.0
    info = {i.name: i for i in autoscale.list_scalers()}["thirds"]
    assert info.kind == "rule" and info.description == "divide by 3 on overflow"
    assert info.defaults["init_scale"] == 2.0**16

    with pytest.raises(ConfigError, match="already registered"):
        autoscale.register_loss_scaler("thirds")(type("Other", (ScaleRule,), {}))
    with pytest.raises(TypeError, match="expects a ScaleRule subclass"):
        autoscale.register_loss_scaler("not-a-scaler")(dict)
    with pytest.raises(TypeError, match="expects a ScaleRule subclass"):
        autoscale.register_loss_scaler("a-scaler-not-a-rule")(LossScaler)


def _plugin_dist(tmp_path, module: str, entries: dict[str, str]) -> None:
    """An installed distribution on sys.path whose entry points publish ``entries``."""
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
            from autoscale.scalers import ScaleRule

            class Quarter(ScaleRule):
                description = "x0.25 on overflow"
                source = "a third-party package"

                def next_scale(self, scale, stats):
                    return scale / 4 if stats.found_inf else scale
            """
        )
    )
    info = tmp_path / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[autoscale.scalers]\n{lines}")


def test_third_party_rule_through_entry_point(clean_registry, tmp_path, monkeypatch):
    _plugin_dist(
        tmp_path, "autoscale_quarter_plugin", {"quarter": "autoscale_quarter_plugin:Quarter"}
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "autoscale_quarter_plugin", raising=False)

    scaler = autoscale.get_scaler("quarter", device="cpu", init_scale=64.0)
    assert type(scaler.rule).__name__ == "Quarter" and scaler.name == "quarter"
    assert scaler.controller.step(StepStats(0, 64.0, True)) == 16.0
    info = {i.name: i for i in autoscale.list_scalers()}["quarter"]
    assert info.kind == "plugin" and info.source == "a third-party package"


def test_a_broken_plugin_fails_alone_and_is_reported(clean_registry, tmp_path, monkeypatch):
    # one package publishes two rules: one loads, the other names a class that is not there
    _plugin_dist(
        tmp_path,
        "autoscale_mixed_plugin",
        {
            "broken": "autoscale_mixed_plugin:Missing",
            "quarter": "autoscale_mixed_plugin:Quarter",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "autoscale_mixed_plugin", raising=False)
    with pytest.warns(
        UserWarning, match=r"scaler plugin 'broken' \(autoscale_mixed_plugin:Missing"
    ):
        infos = {i.name: i for i in autoscale.list_scalers()}
    assert infos["quarter"].kind == "plugin" and infos["quarter"].usable  # the other still loads
    assert autoscale.get_scaler("quarter", device="cpu").name == "quarter"
    broken = infos["broken"]
    assert broken.kind == "plugin" and not broken.usable
    assert "AttributeError" in broken.description and "Missing" in broken.description
    # reported again on every listing and by get_scaler, not only the first time
    assert not {i.name: i for i in autoscale.list_scalers()}["broken"].usable
    with pytest.raises(
        ConfigError, match=r"scaler plugin 'broken' \(autoscale_mixed_plugin:Missing failed"
    ):
        autoscale.get_scaler("broken", device="cpu")
    assert registry.plugin_errors().keys() == {"broken"}


def _export(folder, **fields):
    manifest = PolicyManifest(
        **{
            "kind": "parametric",
            "family": "torch",
            "parameters": {"growth_interval": 100},
            **fields,
        }
    )
    return write_manifest(folder / manifest.name, manifest)


def test_exported_parametric_policy(tmp_path, monkeypatch):
    _export(tmp_path, name="tuned-torch", workload={"model": "mlp", "scenario": "clean"})
    monkeypatch.setenv(policies.POLICY_PATH_ENV, str(tmp_path))

    scaler = autoscale.get_scaler("tuned-torch", device="cpu")
    assert isinstance(scaler.rule, TorchRule)
    assert scaler.get_growth_interval() == 100 and scaler.name == "tuned-torch"
    assert (
        autoscale.get_scaler("tuned-torch", device="cpu", growth_interval=7).get_growth_interval()
        == 7
    )
    # a path to the folder works as well as the name
    assert (
        autoscale.get_scaler(str(tmp_path / "tuned-torch"), device="cpu").get_growth_interval()
        == 100
    )

    info = {i.name: i for i in autoscale.list_scalers()}["tuned-torch"]
    assert info.kind == "policy" and info.defaults == {"growth_interval": 100}
    assert info.description == "parametric policy (torch) searched on mlp/clean"
    assert policies.policy_dirs()[0] == tmp_path


def test_policies_folder_in_the_working_directory(tmp_path, monkeypatch):
    _export(tmp_path / "policies", name="local-policy")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(policies.POLICY_PATH_ENV, raising=False)
    monkeypatch.setenv(policies.HOME_ENV, str(tmp_path / "home"))  # not the user's folder
    assert autoscale.get_scaler("local-policy", device="cpu").get_growth_interval() == 100


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("name: [unclosed\n", "cannot read"),
        ("- just\n- a list\n", "is not a mapping"),
        ("name: broken\nkind: parametric\n", "lacks 'family'"),
        ("name: broken\nkind: magic\nfamily: torch\n", "kind 'magic'"),
        ("name: broken\nkind: parametric\nfamily: torch\nfrom_the_future: 1\n", "unknown keys"),
        ("name: broken\nkind: parametric\nfamily: torch\nformat: 99\n", "format 99"),
        ("name: broken\nkind: parametric\nfamily: no-such-rule\n", "uses rule 'no-such-rule'"),
        (
            "name: broken\nkind: parametric\nfamily: torch\nformat: two\n",
            "format must be an integer",
        ),
        (
            "name: broken\nkind: parametric\nfamily: torch\nparameters: [1]\n",
            "'parameters' must be",
        ),
    ],
)
def test_corrupt_manifest_raises_policy_error(tmp_path, monkeypatch, text, match):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "policy.yaml").write_text(text)
    monkeypatch.setenv(policies.POLICY_PATH_ENV, str(tmp_path))
    with pytest.raises(PolicyError, match=match):
        autoscale.get_scaler("broken", device="cpu")
    # one broken policy does not break the listing
    info = {i.name: i for i in autoscale.list_scalers()}["broken"]
    assert info.kind == "policy" and info.description.startswith("UNUSABLE:")
    assert match in info.description


def test_policy_with_invalid_parameters(tmp_path, monkeypatch):
    """A value the rule refuses in the file is the policy's error, naming its folder's file and
    the fix; the same value given by the caller is the caller's ConfigError, as for a rule."""
    _export(tmp_path, name="bad-params", parameters={"growth_interval": 0})
    monkeypatch.setenv(policies.POLICY_PATH_ENV, str(tmp_path))
    file = tmp_path / "bad-params" / "policy.yaml"
    with pytest.raises(PolicyError) as caught:
        autoscale.get_scaler("bad-params", device="cpu")
    assert str(caught.value).startswith(f"policy 'bad-params' ({file}): growth_interval")
    assert "got 0" in str(caught.value) and str(caught.value).endswith("export the policy again")
    with pytest.raises(PolicyError, match="growth_interval"):  # an override does not mend it
        autoscale.get_scaler("bad-params", device="cpu", backoff_factor=0.5)
    _export(tmp_path, name="fine", parameters={"growth_interval": 100})
    with pytest.raises(ConfigError, match="growth_interval") as caught:
        autoscale.get_scaler("fine", device="cpu", growth_interval=0)
    assert not isinstance(caught.value, PolicyError)


def test_a_copied_policy_with_a_mistyped_rule_is_named_by_its_folder(tmp_path, monkeypatch):
    """A policy folder copied under another name and edited by hand: the error names the folder
    the user asked for (not the name inside the file) and the rule it likely meant."""
    _export(tmp_path, name="mine", family="amax-lose", parameters={})
    (tmp_path / "mine").rename(tmp_path / "copy")
    monkeypatch.setenv(policies.POLICY_PATH_ENV, str(tmp_path))
    with pytest.raises(PolicyError) as caught:
        autoscale.get_scaler("copy", device="cpu")
    assert str(caught.value).startswith(
        f"policy 'copy' ({tmp_path / 'copy' / 'policy.yaml'}) uses rule 'amax-lose', which is not "
        "registered here (did you mean 'amax-loss'?); fix its family or export the policy again"
    ), caught.value


def test_parameter_values_are_read_as_their_defaults_kind():
    """A switch takes what GradScaler's ``enabled`` takes from a script (a bool, 0/1, None: a
    flag parsed as an int) and refuses a word; a number takes a number or a string that reads
    as one (YAML 1.1 leaves ``1e-4`` a string) and refuses a word, naming it."""
    for value, on in ((True, True), (1, True), (0, False), (None, False), (np.bool_(True), True)):
        assert autoscale.get_scaler("torch", device="cpu", enabled=value).is_enabled() is on
    with pytest.raises(ConfigError, match="enabled must be true or false, got 'no thanks'"):
        autoscale.get_scaler("torch", device="cpu", enabled="no thanks")
    assert (
        autoscale.get_scaler("torch", device="cpu", growth_interval="1e3").rule.growth_interval
        == 1000
    )
    assert (
        autoscale.get_scaler(
            "torch", device="cpu", growth_interval=np.int64(7)
        ).rule.growth_interval
        == 7
    )
    with pytest.raises(ConfigError, match="growth_interval must be a number .*got 'often'"):
        autoscale.get_scaler("torch", device="cpu", growth_interval="often")
