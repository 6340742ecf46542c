"""What ``--log`` says: where each live log went (the wrap's exit line), an unknown kind with the
nearest valid one, and the extra that installs a missing package."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoscale.errors import AutoscaleError
from autoscale.observe.live import check_log_spec

SCRIPTS = Path(__file__).parent / "scripts"


def test_an_unknown_log_kind_names_the_nearest_and_the_forms():
    with pytest.raises(AutoscaleError) as info:
        check_log_spec("tensorbord:runs/tb")
    assert str(info.value) == (
        "unknown log kind 'tensorbord'; did you mean 'tensorboard'? "
        "(--log takes csv:FILE, tensorboard:DIR or wandb:PROJECT)"
    )
    with pytest.raises(AutoscaleError, match=r"did you mean 'wandb'\?"):
        check_log_spec("wanb:proj")
    # a file with no kind: the csv form of it
    with pytest.raises(AutoscaleError, match=r"did you mean 'csv:runs/x\.csv'\?"):
        check_log_spec("runs/x.csv")


def test_a_log_that_cannot_be_written_is_refused_before_the_command(tmp_path, capsys):
    """An unwritable --log is one line and exit 2 before the command starts (it ran the whole
    training, warned that it was "not recording", and exited 0 with no log)."""
    from autoscale.cli import main

    script = str(SCRIPTS / "plain.py")
    for spec, said in (
        ("csv:/proc/x.csv", "cannot write --log csv:/proc/x.csv ('/proc'"),
        ("tensorboard:/proc/tb", "cannot write --log tensorboard:/proc/tb ('/proc'"),
        (f"csv:{tmp_path}", "is a folder; give the CSV file to write"),
    ):
        assert main(["wrap", "--log", spec, "--", sys.executable, script, "2"]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []  # (the command did not run)


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_a_missing_package_names_its_extra(monkeypatch, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a)
    )
    with pytest.raises(AutoscaleError) as info:
        check_log_spec(f"{package}:x")
    assert str(info.value) == (
        f"--log {package} needs the {package} package, which is not installed; "
        f"pip install 'autoscale[{package}]'"
    )


@pytest.mark.slow
def test_the_exit_line_says_where_each_log_went(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "autoscale", "wrap", "--log", "csv:logs/steps.csv", "--"]
        + [sys.executable, str(SCRIPTS / "spawned.py"), "two"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [x for x in out.stderr.splitlines() if x.startswith("autoscale wrap: torch")]
    first = tmp_path / "logs" / "steps.csv"
    second = tmp_path / "logs" / "steps.scaler1.csv"
    assert first.is_file() and second.is_file()
    assert len(lines) == 2
    assert lines[0].endswith(f"; log: csv {first}"), lines[0]
    assert lines[1].endswith(f"; log: csv {second}"), lines[1]
