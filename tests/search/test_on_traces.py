"""``autoscale search --traces``: a search on the replay of a user's recorded runs."""

from __future__ import annotations

import json

import pytest

import autoscale
from autoscale.cli import main
from autoscale.envs.from_records import suite_from_records
from autoscale.errors import ConfigError
from autoscale.observe import read_record, watch_scaler
from autoscale.scalers import read_manifest
from tests.observe.helpers import fp16_loop


def _record(path, steps: int = 400, weight: float = 2.0**-10):
    """A real fp16 loop under torch's rule (a loss weighted down, a bad batch every 50 steps)."""
    scaler = autoscale.get_scaler("torch", device="cpu", growth_interval=100)
    watch = watch_scaler(scaler, record=str(path))
    fp16_loop(scaler, steps, bad_every=50, weight=weight)
    watch.close()
    return path


def test_windows_split_train_and_test_in_time(tmp_path):
    suite, traces = suite_from_records([_record(tmp_path / "r")])
    (member,) = suite.members
    assert member.episode.steps == 128  # three windows of 128 fit in 400 steps, of 256 do not
    train = [i.start for i in member.instances["train"]]
    test = [i.start for i in member.instances["test"]]
    assert train == [0] and test == [128, 256] or (train == [0, 128] and test == [256])
    assert max(train) < min(test)
    inst = traces[member.name].instance(member.instances["test"][0].name)
    assert inst.steps == 128 and inst.start_features is not None
    with pytest.raises(ConfigError, match="fewer than three windows of 1024"):
        suite_from_records([tmp_path / "r"], horizon=1024)


@pytest.fixture()
def fresh_clock(monkeypatch):
    """A budget counts from the process's import of autoscale (the CLI's start); called in
    process after other tests, it would count their time too: start it now."""
    import time

    monkeypatch.setattr(autoscale, "IMPORT_TIME", time.monotonic())


@pytest.mark.slow
def test_search_on_a_record_exports_a_policy_and_its_report(
    tmp_path, monkeypatch, capsys, fresh_clock
):
    _record(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    assert main(["search", "--traces", "run", "--budget", "40s", "--n-trials", "40"]) == 0
    out = capsys.readouterr().out
    assert "validated on the replay of held-out windows" in out
    assert "[2/6 plan]" in out and "[4/6 search]" in out and "[5/6 validate]" in out
    export = next(line for line in out.splitlines() if line.startswith("[6/6 export]"))
    assert "auto is the best found for these records" in export or "beat auto by" in export
    policy = tmp_path / "policies" / "run-traces"
    manifest = read_manifest(policy)
    assert manifest.kind == "parametric"
    assert manifest.workload["traces"] == [str((tmp_path / "run").resolve())]
    assert "replay" in manifest.workload["validation"]
    nh = manifest.scorecard["no_harm_replay"]
    assert nh["passed"] and nh["skip_rate"] <= nh["torch_skip_rate"] + 0.005
    assert (policy / "report.html").is_file()
    assert "run-traces" in (policy / "report.html").read_text()  # the pick among the replays
    scaler = autoscale.get_scaler(str(policy), device="cpu")  # torch alone
    assert scaler.name == "run-traces"
    import optuna

    study = optuna.load_study(study_name="run-traces", storage="sqlite:///autoscale.db")
    assert "replay" in study.user_attrs["validation"]
    # the same command resumes the study: its trials are kept
    before = len(study.trials)
    monkeypatch.setattr(autoscale, "IMPORT_TIME", __import__("time").monotonic())
    assert main(["search", "--traces", "run", "--budget", "30s", "--n-trials", "5", "--force"]) == 0
    assert (
        len(optuna.load_study(study_name="run-traces", storage="sqlite:///autoscale.db").trials)
        == before + 5
    )


def test_bad_traces_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    assert main(["search", "--traces", "empty", "--budget", "1m"]) == 2
    assert "'empty' is not an autoscale record: it has no meta.json" in capsys.readouterr().err
    _record(tmp_path / "old", steps=200)
    meta = json.loads((tmp_path / "old" / "meta.json").read_text())
    (tmp_path / "old" / "meta.json").write_text(json.dumps({**meta, "version": 0}))
    assert main(["search", "--traces", "old", "--budget", "1m"]) == 2
    assert "format version 0, this autoscale reads version 1" in capsys.readouterr().err
    _record(tmp_path / "short", steps=100)
    assert main(["search", "--traces", "short", "--budget", "1m"]) == 2
    assert "fewer than three windows" in capsys.readouterr().err
    assert main(["search", "--traces", "short", "--model", "mlp", "--budget", "1m"]) == 2
    assert "takes no --model/--workload" in capsys.readouterr().err
    assert not (tmp_path / "autoscale.db").exists() and not (tmp_path / "policies").exists()
    assert read_record(tmp_path / "short").steps  # the record itself is untouched


def test_a_study_made_from_other_records_is_refused_not_resumed(tmp_path, monkeypatch, capsys):
    """The default study name is the folder's: a folder recorded again holds other steps, and the
    study's trials (and their test-replay scores) were measured on the old ones."""
    import optuna

    from autoscale.search.storage import open_storage

    monkeypatch.chdir(tmp_path)
    _record(tmp_path / "old", steps=300)
    before, _ = suite_from_records([tmp_path / "old"])
    run = _record(tmp_path / "run", steps=400)  # the same folder, recorded again, longer
    study = optuna.create_study(study_name="run-traces", storage=open_storage("autoscale.db"))
    study.set_user_attr("traces", [str(run.resolve())])
    study.set_user_attr("records", [[str(run.resolve()), 300]])
    study.set_user_attr("suite", before.to_dict())
    assert main(["search", "--traces", "run", "--budget", "1m"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # the one line, last
    assert last.startswith(
        f"autoscale search: error: study 'run-traces' was made from other records ({run.resolve()}"
    )
    assert "pass --study NEW_NAME" in last
    assert len(study.trials) == 0 and not (tmp_path / "policies").exists()
