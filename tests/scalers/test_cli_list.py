"""``autoscale list``, ``--version``, ``--help`` and errors of the command line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import autoscale
from autoscale.cli import main
from autoscale.scalers import policies
from autoscale.scalers.policies import PolicyManifest, write_manifest

BUILTIN = ["static", "torch", "deepspeed", "megatron", "jmp", "fairseq", "metaseq", "amax-history"]


def test_list_shows_every_rule_with_defaults(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Built-in rules:\n")
    for name in BUILTIN:
        assert f"  {name} " in out
    assert "growth_interval=2000" in out  # torch's defaults
    assert "init_scale=2^32" in out  # megatron's, written as a power of two
    assert "autoscale.get_scaler(NAME" in out


def test_list_json(capsys):
    assert main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows] == [i.name for i in autoscale.list_scalers()]
    assert set(BUILTIN) <= set(by_name)
    assert by_name["torch"]["kind"] == "rule"
    assert by_name["torch"]["defaults"]["growth_interval"] == 2000
    assert by_name["deepspeed"]["defaults"]["min_scale"] == 1.0
    assert by_name["amax-history"]["source"].startswith("Transformer Engine")


def test_list_shows_exported_policies(capsys, tmp_path, monkeypatch):
    write_manifest(
        tmp_path / "tuned", PolicyManifest(name="tuned", kind="parametric", family="deepspeed")
    )
    monkeypatch.setenv(policies.POLICY_PATH_ENV, str(tmp_path))
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "Policies (shipped with autoscale, or exported):\n  tuned" in out
    assert "parametric policy (deepspeed)" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"autoscale {autoscale.__version__}"


def test_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: autoscale" in out and "list" in out and "every registered scaler" in out


def test_no_arguments_prints_help(capsys):
    assert main([]) == 0
    assert "usage: autoscale" in capsys.readouterr().out


def test_unknown_subcommand_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script():
    exe = shutil.which("autoscale", path=str(Path(sys.executable).parent)) or shutil.which(
        "autoscale"
    )
    assert exe, "the autoscale console script is not installed"
    out = subprocess.run([exe, "list", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert set(BUILTIN) <= {r["name"] for r in json.loads(out.stdout)}
    bad = subprocess.run([exe, "frobnicate"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2


def test_a_built_policy_is_described_by_every_split_of_its_suite():
    manifest = PolicyManifest(
        name="built",
        kind="parametric",
        family="amax-loss",
        workload={
            "suite": "s",
            "members": ["a/x", "b/x"],
            "left_out": ["c/x", "d/x", "e/x"],
            "validation": ["c/x"],
            "test": ["d/x", "e/x"],
        },
    )
    assert manifest.describe() == (
        "parametric policy (amax-loss) chosen on suite 's', 5 members: candidates trained or "
        "searched on 2, chosen on 1 validation member, tested on 2 test members"
    )
    searched = PolicyManifest(
        name="found",
        kind="parametric",
        family="torch",
        workload={"suite": "s", "members": ["a/x", "b/x"], "left_out": ["c/x"]},
    )
    assert (
        searched.describe()
        == "parametric policy (torch) searched on suite 's' (2 members), 1 left out"
    )
    unchanged = PolicyManifest(
        name="kept",
        kind="parametric",
        family="amax-loss",
        workload={"model": "mlp", "scenario": "clean", "exported_policy": "auto"},
    )
    assert unchanged.describe() == (
        "parametric policy (amax-loss) = 'auto' unchanged, exported by a search on mlp/clean"
    )
    # a search on recorded runs that kept auto says so too, before what it searched
    note = "searched on the replay of 1 recorded run: /r (500 steps of python train.py)"
    on_records = PolicyManifest(
        name="kept",
        kind="parametric",
        family="amax-loss",
        workload={"note": note, "exported_policy": "auto"},
    )
    assert on_records.describe() == f"parametric policy (amax-loss) = 'auto' unchanged: {note}"
    # a trial exported by number that the search refused says so, with the first reason
    refused = PolicyManifest(
        name="t7",
        kind="parametric",
        family="static",
        workload={"model": "mlp", "scenario": "clean"},
        scorecard={"evidence": {"not_the_pick": ["it fails the no-harm check: skips 9%", "x"]}},
    )
    assert refused.describe() == (
        "parametric policy (static) searched on mlp/clean; exported by number, not the "
        "search's pick: it fails the no-harm check: skips 9%"
    )


def test_the_shipped_auto_is_described_by_the_suite_it_was_chosen_on(capsys):
    from autoscale.scalers.policies import find_policy, read_manifest

    workload = read_manifest(find_policy("auto")).workload
    total = len(workload["members"]) + len(workload["left_out"])
    assert main(["list"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  auto ")]
    assert f"chosen on suite '{workload['suite']}', {total} members:" in row
    assert f"chosen on {len(workload['validation'])} validation members" in row
    assert f"({len(workload['members'])} members)" not in row


def test_a_policy_whose_rule_is_not_registered_here_is_listed_as_unusable(
    capsys, tmp_path, monkeypatch
):
    write_manifest(
        tmp_path / "orphan",
        PolicyManifest(name="orphan", kind="parametric", family="no-such-rule"),
    )
    monkeypatch.setenv(policies.POLICY_PATH_ENV, str(tmp_path))
    info = {i.name: i for i in autoscale.list_scalers()}["orphan"]
    assert not info.usable
    assert main(["list"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "orphan" in line]
    assert "UNUSABLE" in row and "cannot be built here" in row
    assert "uses rule 'no-such-rule', which is not registered here" in row
