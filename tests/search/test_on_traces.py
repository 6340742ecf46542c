"""``autoscale search --traces``: a search on the replay of a user's recorded runs."""

from __future__ import annotations

import json

import pytest

import autoscale
from autoscale.cli import main
from autoscale.envs.from_records import suite_from_records
from autoscale.errors import ConfigError
from autoscale.observe import read_record, watch_scaler
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


def test_bad_traces_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    assert main(["search", "--traces", "empty", "--budget", "1m"]) == 2
    assert "'empty' is not an autoscale record: it has no meta.json" in capsys.readouterr().err
    _record(tmp_path / "old", steps=200)
    meta = json.loads((tmp_path / "old" / "meta.json").read_text())
    (tmp_path / "old" / "meta.json").write_text(json.dumps({**meta, "version": 0}))
    assert main(["search", "--traces", "old", "--budget", "1m"]) == 2
    assert "format version 0, this autoscale reads version 1 or 2;" in capsys.readouterr().err
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


def test_the_records_check_refuses_what_harms_the_runs_and_pools_what_passes(tmp_path):
    """The no-harm check of a search on records: each whole run replayed next to torch."""
    from autoscale.search.budget import Ledger
    from autoscale.search.no_harm_records import RecordsCheck, totals

    rec = read_record(_record(tmp_path / "run", steps=300))
    check = RecordsCheck([rec, rec], Ledger(), lambda: autoscale.get_scaler("torch", device="cpu"))
    torch = check.check(lambda: autoscale.get_scaler("torch", device="cpu"), "torch")
    assert torch.passed and len(torch.runs) == 1  # one folder, twice: one entry
    run = next(iter(torch.runs.values()))
    assert run["candidate"] == run["torch"] and run["candidate"][0]["clean_steps"] > 250
    assert check.cost(None, 2) == 2 * check.run_s > 0
    # a fixed scale far too small for gradients weighted by 2^-10: most elements lost to underflow
    tiny = check.check(lambda: autoscale.get_scaler("static", device="cpu", init_scale=1.0), "tiny")
    assert not tiny.passed
    assert any("below fp16's range" in r for r in tiny.reasons), tiny.reasons
    assert tiny.summary().startswith(
        "tiny fails the no-harm check on the replay of the whole records"
    )
    # one far too large: every step overflows
    huge = check.check(
        lambda: autoscale.get_scaler("static", device="cpu", init_scale=2.0**40), "huge"
    )
    assert not huge.passed and any("skips 100.00% of the clean steps" in r for r in huge.reasons)
    pooled = totals(torch)
    assert pooled["passed"] and pooled["skip_rate"] == pooled["torch_skip_rate"]
    assert pooled["clean_steps"] == run["candidate"][0]["clean_steps"]


def test_a_study_is_resumed_only_from_its_own_kind_of_source(tmp_path, monkeypatch, capsys):
    """One identity check for both searches: records do not resume a workload's study, and a
    workload search does not resume a study of records."""
    import optuna

    from autoscale.search.storage import open_storage

    monkeypatch.chdir(tmp_path)
    run = _record(tmp_path / "run", steps=400)
    suite, _ = suite_from_records([run])
    storage = open_storage("autoscale.db")
    work = optuna.create_study(study_name="mlp-study", storage=storage)
    work.set_user_attr("suite", {"name": "mlp", "members": [{"name": "mlp/bad-batches"}]})
    assert main(["search", "--traces", "run", "--study", "mlp-study", "--budget", "1m"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        "autoscale search: error: study 'mlp-study' was made from a workload's real steps "
        "(mlp/bad-batches), not records: pass --study NEW_NAME to search these records"
    )
    assert len(work.trials) == 0 and "traces" not in work.user_attrs
    recs = optuna.create_study(study_name="run-traces", storage=storage)
    recs.set_user_attr("traces", [str(run.resolve())])
    recs.set_user_attr("suite", suite.to_dict())
    rc = main(["search", "--model", "mlp", "--study", "run-traces", "--budget", "1m", "--quiet"])
    assert rc == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"autoscale search: error: study 'run-traces' was made from records ({run.resolve()}): "
        "pass --traces with them to resume it, or --study NEW_NAME to search a workload"
    )
    assert len(recs.trials) == 0 and not (tmp_path / "policies").exists()
