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
    assert member.episode.steps == 64  # four windows of 64 fit in 400 steps, of 128 do not
    train = [i.start for i in member.instances["train"]]
    test = [i.start for i in member.instances["test"]]
    assert train == [0, 64, 128, 192] and test == [256, 320]  # two thirds of 6 windows, in time
    inst = traces[member.name].instance(member.instances["test"][0].name)
    assert inst.steps == 64 and inst.start_features is not None
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


@pytest.mark.slow
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


def test_replay_validation_keeps_its_rows_in_the_study_as_real_steps_are(tmp_path):
    """A search on records validates on the replay of its held-out windows: every scaler on every
    test window, whatever the deadline (a replay takes a fraction of a second), kept in the study
    under its ``real:`` key as real-step rows are, marked ``on: replay``, and read back by what
    reads those (``autoscale export``)."""
    import optuna

    from autoscale.search.bench import ReplayBench
    from autoscale.search.budget import Ledger
    from autoscale.search.candidates import AUTO, TORCH
    from autoscale.search.validate import PREFIX, ReplayValidator, real_cards

    suite, traces = suite_from_records([_record(tmp_path / "r")])
    bench = ReplayBench(suite, traces)
    study = optuna.create_study()
    validator = ReplayValidator(bench, study, Ledger(), worker="host:1")
    done = []
    scalers = [(k, k.name, lambda k=k: bench.scaler(k.name)) for k in (TORCH, AUTO)]
    rows = validator.run(scalers, stop_at=0.0, on_done=done.append)
    assert list(rows) == [TORCH, AUTO] and [v.key for v in done] == [TORCH, AUTO]
    assert validator.cost(3) == 3 * validator.run_s > 0  # (every scaler replayed: none skipped)
    (member,) = suite.members
    for key, v in rows.items():
        assert not v.real and len(v.cards[member.name]) == len(member.instances["test"])
        stored = study.user_attrs[PREFIX + key]
        assert (stored["on"], stored["worker"]) == ("replay", "host:1")
        back = real_cards(study.user_attrs, key, validator.names)
        assert [c.to_dict() for c in back.values()] == [c.to_dict() for c in v.cards[member.name]]
    # a resumed study's rows are read back, not replayed, and on_done is not called for them
    again, done_again = ReplayValidator(bench, study, Ledger(), worker="host:2"), []

    def no_replay():
        raise AssertionError("a stored row was replayed")

    back_rows = again.run(
        [(k, k.name, no_replay) for k in (TORCH, AUTO)], stop_at=0.0, on_done=done_again.append
    )
    assert done_again == [] and list(back_rows) == [TORCH, AUTO]
    assert [c.to_dict() for c in back_rows[AUTO].cards[member.name]] == [
        c.to_dict() for c in rows[AUTO].cards[member.name]
    ]
    assert study.user_attrs[PREFIX + AUTO]["worker"] == "host:1"  # not written again
    replayed = bench.run("test", lambda: bench.scaler("torch"))[0][member.name]
    assert [c.skipped for c in rows[TORCH].cards[member.name]] == [c.skipped for c in replayed]
    auto = rows[AUTO].cards[member.name]
    assert [c.precision_loss for c in auto] != [c.precision_loss for c in replayed]


@pytest.mark.slow  # a record of 600 real steps (an `autoscale wrap` subprocess), then 14 trials
def test_the_search_runner_runs_a_search_on_records_through_their_source(tmp_path):
    """The one driver runs the records' four phases: their plan (the study, the windows and what
    they leave to win), one round (the search on the train windows' replay, to --n-trials here,
    far from the budget's end), validation on the test windows' replay kept in the study, the pick
    with the records' check, and the export, its manifest describing the records; each line is
    numbered among the four phases."""
    import re
    import time

    import optuna
    import yaml

    from autoscale.search.budget import Budget
    from autoscale.search.candidates import AUTO
    from autoscale.search.choose import VERDICT_PREFIX
    from autoscale.search.on_traces import RecordsSource
    from autoscale.search.runner import SearchConfig, SearchRunner
    from autoscale.search.validate import PREFIX
    from tests.search.test_records_search import SPREAD, wrap_record

    source = RecordsSource((str(wrap_record(tmp_path / "run", *SPREAD)),))
    name = source.default_study()
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    cfg = SearchConfig(
        source.suite, study=name, export="mine", storage=storage, n_trials=14,
        policy_dir=str(tmp_path / "elsewhere"), progress=False,
    )  # fmt: skip
    said: list[str] = []
    budget = Budget(300.0, time.monotonic(), 5.0)
    result = SearchRunner(cfg, budget, out=said.append, source=source).run()
    text = "\n".join(said)
    heads = [re.match(r"\[(?:(\d)/4 )?(\w+)\] ", line).groups() for line in said]
    assert [p for _, p in heads] == ["plan", "plan", "search", "validate"] + ["export"] * (
        len(said) - 5
    ) + ["done"], text
    assert all(n == str(1 + source.phases.index(p)) for n, p in heads[:-1]), text
    assert name == "run-traces" and result.stopped_early is None
    assert (
        "14 trials (14 complete, 0 pruned, 0 failed) in " in said[2]
        and "on the train windows' replay" in said[2]
    )
    assert result.wall_s < 0.5 * budget.seconds  # the trials ran out, not the budget
    study = optuna.load_study(study_name=name, storage=storage)
    rows = {k: v for k, v in study.user_attrs.items() if k.startswith(PREFIX)}
    assert PREFIX + AUTO in rows and any(k.startswith(PREFIX + "trial:") for k in rows)
    assert {v["on"] for v in rows.values()} == {"replay"}
    verdicts = [v for k, v in study.user_attrs.items() if k.startswith(VERDICT_PREFIX)]
    assert verdicts and {v["where"] for v in verdicts} == {"on the replay of the whole records"}
    # exported to a folder the policy lookup does not search: named by its path, the report too
    mine = tmp_path / "elsewhere" / "mine"
    manifest = yaml.safe_load((mine / "policy.yaml").read_text())
    assert manifest["workload"]["records"][0]["steps"] == 600
    assert manifest["scorecard"]["no_harm_replay"]["clean_steps"] > 500
    assert manifest["scorecard"]["evaluated_on"].startswith("replay of 2 held-out windows")
    assert result.exported == mine and (mine / "report.html").is_file()
    assert f"--scaler {mine} --" in said[-1] and f"autoscale.get_scaler('{mine}')" in said[-1]
    assert "<td>mine</td>" in (mine / "report.html").read_text()  # its row, by its name


def test_an_unusable_storage_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch, capsys):
    """The storage is opened before anything is written: a folder that does not exist is said as
    the storage's, and no artifacts folder is left behind."""
    monkeypatch.chdir(tmp_path)
    _record(tmp_path / "run")
    args = ["search", "--traces", "run", "--budget", "1m", "--storage", "sqlite:////proc/nope/x.db"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "cannot open storage" in err and "'/proc/nope' does not exist" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "policies").exists()
