"""Where exported policies live: a home of the user's, the same from every working directory
(``$AUTOSCALE_HOME/policies``, else ``$XDG_DATA_HOME/autoscale/policies``, else
``~/.local/share/autoscale/policies``), beside ``$AUTOSCALE_POLICY_PATH`` and the project's
``./policies``; and the error for a name found in none of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import autoscale
from autoscale.errors import UnknownNameError
from autoscale.scalers import policies
from autoscale.search.export import export_parametric


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A user home of autoscale's in ``tmp_path``, no path variable, the working directory a
    project folder elsewhere."""
    home = tmp_path / "home"
    monkeypatch.setenv("AUTOSCALE_HOME", str(home))
    monkeypatch.delenv(policies.POLICY_PATH_ENV, raising=False)
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    return home


def test_an_export_without_a_folder_goes_to_the_users_home(home):
    path = export_parametric("torch", {"growth_interval": 100}, "mine")
    assert path == home / "policies" / "mine" and (path / policies.MANIFEST).is_file()
    assert not (Path.cwd() / "policies").exists()  # not the working directory's


@pytest.mark.slow  # a Python subprocess that imports torch
def test_an_exported_policy_is_found_from_any_folder(home, tmp_path):
    export_parametric("torch", {"growth_interval": 100}, "mine")
    sub = Path.cwd() / "src" / "deep"
    sub.mkdir(parents=True)
    code = "import autoscale; s = autoscale.get_scaler('mine', device='cpu'); print(s.name, s.get_growth_interval())"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for cwd in (sub, tmp_path):
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["mine", "100"]


def test_the_home_follows_xdg_then_the_users_home(monkeypatch, tmp_path):
    monkeypatch.delenv("AUTOSCALE_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert policies.user_policy_dir() == tmp_path / "data" / "autoscale" / "policies"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "u"))
    assert (
        policies.user_policy_dir() == tmp_path / "u" / ".local" / "share" / "autoscale" / "policies"
    )
    monkeypatch.setenv("AUTOSCALE_HOME", "~/as")
    assert policies.user_policy_dir() == tmp_path / "u" / "as" / "policies"


def test_the_search_order_and_the_export_folder(home, tmp_path, monkeypatch):
    dirs = policies.policy_dirs()
    assert dirs[:2] == [Path.cwd() / "policies", home / "policies"]
    assert policies.default_policy_dir() == home / "policies"
    monkeypatch.setenv(policies.POLICY_PATH_ENV, os.pathsep.join([str(tmp_path / "a"), "b"]))
    assert policies.policy_dirs()[:4] == [
        tmp_path / "a",
        Path("b"),
        Path.cwd() / "policies",
        home / "policies",
    ]
    assert policies.default_policy_dir() == tmp_path / "a"


def test_an_unknown_name_says_where_it_looked_and_how_to_point_at_a_folder(home, monkeypatch):
    monkeypatch.setenv(policies.POLICY_PATH_ENV, "/srv/team-policies")
    with pytest.raises(UnknownNameError) as info:
        autoscale.get_scaler("mine", device="cpu")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("unknown scaler 'mine'")
    for place in ("/srv/team-policies", str(Path.cwd() / "policies"), str(home / "policies")):
        assert place in message
    assert f"{policies.POLICY_PATH_ENV}=DIR" in message


@pytest.mark.slow  # an `autoscale wrap` subprocess
def test_the_cli_line_for_an_unknown_policy(home, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOSCALE_HOME": str(home)}
    env.pop(policies.POLICY_PATH_ENV, None)
    out = subprocess.run(
        [sys.executable, "-m", "autoscale", "wrap", "--scaler", "mine", "--", "true"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "unknown scaler 'mine'" in line and str(home / "policies") in line
    assert str(tmp_path / "policies") in line


def test_list_says_where_policies_are_looked_for_and_where_exports_go(home, capsys):
    from autoscale.cli import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("Exported policies are looked for"))
    assert f"./policies ({Path.cwd() / 'policies'})" in line
    assert f"an export goes to {home / 'policies'} unless given a folder" in line


@pytest.mark.parametrize("command", ["search", "export", "train-agent"])
def test_the_exporting_commands_help_says_where_an_export_goes(command, capsys):
    from autoscale.cli import main

    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0 and "./policies" not in text
    # default_policy_dir's order, tested above
    assert (
        "--policy-dir DIR export folder (default: the first folder of $AUTOSCALE_POLICY_PATH, "
        "else $AUTOSCALE_HOME/policies, else $XDG_DATA_HOME/autoscale/policies, "
        "else ~/.local/share/autoscale/policies)"
    ) in text


def test_an_export_is_named_as_get_scaler_finds_it(home, tmp_path):
    """The line after an export says what ``get_scaler`` takes: the name where the lookup finds
    that folder by it, else the folder's path (outside the lookup, or a name an earlier folder
    of the lookup holds too)."""
    found = export_parametric("torch", {"growth_interval": 100}, "mine")
    assert policies.policy_ref(found) == "mine"
    elsewhere = export_parametric(
        "torch", {"growth_interval": 7}, "other", out_dir=tmp_path / "out"
    )
    assert policies.policy_ref(elsewhere) == str(elsewhere)
    shadowed = export_parametric("torch", {"growth_interval": 9}, "mine", out_dir=tmp_path / "out")
    assert policies.policy_ref(shadowed) == str(shadowed)  # 'mine' is the home's
    for ref, interval in ((policies.policy_ref(elsewhere), 7), (policies.policy_ref(shadowed), 9)):
        assert autoscale.get_scaler(ref, device="cpu").get_growth_interval() == interval
