"""Interrupt and resume (the resume piped, and interrupted in turn after it exported), and two
workers on one JournalFile storage from a cold cache, with real ``autoscale search`` subprocesses. Two workers on SQLite and on PostgreSQL (a private server) form
one study in tests/search/test_faults.py, where one of them is also killed mid-trial."""

from __future__ import annotations

import re
import signal
import threading
import time
from typing import Any

import optuna
import pytest

from autoscale.scalers import LossScaler, make_scaler
from autoscale.scalers.policies import read_manifest
from autoscale.search.export import study_suites
from autoscale.search.storage import open_storage
from tests.search.conftest import spawn

optuna.logging.set_verbosity(optuna.logging.WARNING)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.paced,
]  # real `autoscale` subprocesses, seconds to a minute each
TrialState = optuna.trial.TrialState


def _snapshot(url: str, study: str) -> dict[int, tuple]:
    s = optuna.load_study(study_name=study, storage=open_storage(url, must_exist=True))
    return {t.number: (t.state, t.value, t.params) for t in s.get_trials(deepcopy=False)}


def _complete_count(url: str, study: str) -> int:
    try:
        return sum(
            1 for state, _, _ in _snapshot(url, study).values() if state == TrialState.COMPLETE
        )
    except Exception:  # storage or study not created yet
        return 0


def _instances(url: str, study: str) -> int:
    """Train and test instances of the study's stored replay suite."""
    s = optuna.load_study(study_name=study, storage=open_storage(url, must_exist=True))
    suite, _, _ = study_suites(s)
    return sum(len(m.instances["train"]) + len(m.instances["test"]) for m in suite.members)


RECORD_LINE = re.compile(
    r"\[3/6 record\] (\d+) instances .*: (\d+) recorded .*, (\d+) from the cache"
    r"(?:, (\d+) left out)?(?:, (\d+) shortened)?"
)


def test_interrupt_keeps_finished_trials_and_resume_continues_the_study(tmp_path):
    """Ctrl-C once a trial is complete (an event in the storage, not a time), then resume.

    Where the SIGINT lands in the trial loop is left to chance here; the loop's handling of each
    point (inside ask, tell, the objective) is tested deterministically in test_trials.py. The
    child starts with SIGINT at its default (``spawn``), whatever the test process inherited."""
    url, study = f"sqlite:///{tmp_path / 'autoscale.db'}", "int"
    args = ("search", "--model", "mlp", "--budget", "90s", "--study", study, "--quiet")
    proc = spawn(*args, cwd=tmp_path)
    deadline = time.monotonic() + 180  # the search's own budget ends it first
    while proc.poll() is None and time.monotonic() < deadline and _complete_count(url, study) < 1:
        time.sleep(0.05)
    assert proc.poll() is None, "the search ended before it could be interrupted"
    seen = _snapshot(url, study)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "kept in study 'int'" in err and "Traceback" not in err
    after = _snapshot(url, study)
    for number, (state, value, params) in seen.items():
        if state == TrialState.COMPLETE:  # every finished trial is kept as it was
            assert after[number] == (state, value, params)
    assert all(state != TrialState.RUNNING for state, _, _ in after.values())
    assert not (tmp_path / "policies" / study).exists()  # nothing exported, nothing half-written
    assert (
        not list((tmp_path / "policies").glob(".*")) if (tmp_path / "policies").exists() else True
    )
    first = RECORD_LINE.search(out)
    # nothing was cached before; on a loaded machine the recording may leave instances out (the
    # steps ran slower than measured), and the re-plan after it stores the suite without them
    assert first and first.group(3) == "0" and 0 < int(first.group(2)) <= int(first.group(1))
    left_out = int(first.group(4) or 0)
    assert int(first.group(2)) + left_out == int(first.group(1))
    stored = _instances(url, study)
    assert stored == int(first.group(1)) - left_out

    # The resume keeps the study's stored plan and re-times it on this machine: a loaded machine
    # measures slower steps, so its budget is generous (the stored plan needs a fraction of it)
    # and --n-trials, not the clock, ends its search; its validation is bounded by the plan. It
    # runs piped (CI, nohup, Slurm) without --quiet, and is interrupted in turn once its first
    # round exported: it says what is exported, not "nothing was exported".
    resumed, err = _interrupted_after_export(
        ("search", "--model", "mlp", "--budget", "5m", "--n-trials", "12", "--study", study),
        tmp_path,
    )
    log = "".join(err)
    assert resumed.returncode == 130, "".join(resumed.out) + log
    out = "".join(resumed.out)
    assert "\r" not in log and "it/s" not in log and "step/s" not in log, log[:2000]
    assert "[4/6 search]" in out and "[5/6 validate]" in out
    (line,) = [line for line in err if line.startswith("interrupted: ")]
    assert "nothing was exported" not in line and "Traceback" not in log
    assert f"{study} stays as an earlier round exported it: {study} (" in line
    assert "(resuming)" in out
    m = RECORD_LINE.search(out)
    assert m and int(m.group(1)) == stored  # the stored plan, not a new one
    # every trace of it comes from the cache: the first run's re-plan cached them under the plan
    # it stored, shorter ones included (a busy machine may have recorded a first one shorter)
    assert (int(m.group(2)), int(m.group(3))) == (0, int(first.group(2))) and not m.group(4)
    assert "re-planned" not in out
    final = _snapshot(url, study)
    for number, entry in after.items():
        if entry[0] == TrialState.COMPLETE:
            assert final[number] == entry
    assert all(state != TrialState.RUNNING for state, _, _ in final.values())
    new = [n for n in final if n not in after]
    assert new and min(new) == max(after) + 1  # the same study, numbering continued
    assert sorted(final) == list(range(len(final)))
    assert isinstance(make_scaler(str(tmp_path / "policies" / study), device="cpu"), LossScaler)


def _interrupted_after_export(args: tuple[str, ...], cwd) -> tuple[Any, list[str]]:
    """``autoscale ARGS`` piped, sent a Ctrl-C as soon as it says a round exported; the process
    (its stdout lines in ``.out``) and its stderr lines."""
    proc = spawn(*args, cwd=cwd)
    err: list[str] = []
    drain = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    drain.start()  # stderr read beside stdout: a full pipe would stall the search
    proc.out, sent = [], threading.Event()

    def read_out() -> None:
        for line in proc.stdout:
            proc.out.append(line)
            if (
                not sent.is_set()
                and line.startswith("[6/6 export]")
                and "use it with autoscale.get_scaler" in line
            ):
                # at once, from this thread: the export may be the search's last line of work
                # (one round on a busy machine), and a signal that lands after the search, in
                # the interpreter's teardown, meets SIGINT's default action (rc -2, nothing said)
                proc.send_signal(signal.SIGINT)
                sent.set()

    reader = threading.Thread(target=read_out, daemon=True)
    reader.start()
    reader.join(timeout=360)
    assert sent.is_set(), "".join(proc.out + err)
    proc.wait(timeout=60)
    reader.join(timeout=10)
    drain.join(timeout=10)
    return proc, err


def _two_workers(tmp_path, storage: str, study: str) -> list[str]:
    args = (
        "search",
        "--model",
        "mlp",
        "--budget",
        "90s",
        "--storage",
        storage,
        "--study",
        study,
        "--quiet",
    )
    procs = [spawn(*args, cwd=tmp_path) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def _check_one_study(tmp_path, storage: str, study: str, outs: list[str]) -> None:
    ran = [int(re.search(r"this worker ran (\d+) trials", o).group(1)) for o in outs]
    s = optuna.load_study(study_name=study, storage=open_storage(storage, must_exist=True))
    trials = s.get_trials(deepcopy=False)
    assert len(trials) == sum(ran) and min(ran) > 0  # no trial lost, none duplicated
    assert sorted(t.number for t in trials) == list(range(len(trials)))
    assert len({t.user_attrs.get("worker") for t in trials}) == 2
    # one plan for the study: the worker that created it recorded, re-planned if its steps ran
    # slower than measured, and stored the plan; the other waited for that plan, adopted it
    # without re-planning and read every trace of it from the cache: each recorded once
    joined = [k for k, o in enumerate(outs) if "(resuming)" in o or "created the study first" in o]
    assert len(joined) == 1, outs
    creator, joiner = outs[1 - joined[0]], outs[joined[0]]
    stored, (_, _, steps) = _instances(storage, study), study_suites(s)
    made = RECORD_LINE.search(creator)
    assert made.group(3) == "0" and int(made.group(2)) == stored
    assert stored + int(made.group(4) or 0) == int(made.group(1))  # the re-plan drops the rest
    took = RECORD_LINE.search(joiner)
    assert (int(took.group(1)), int(took.group(2)), int(took.group(3))) == (stored, 0, stored)
    assert f"{stored} instances x {steps} real steps" in took.group(0)
    assert "re-planned" not in joiner
    manifest = read_manifest(tmp_path / "policies" / study)
    assert manifest.workload["study"] == study
    if "trial" in manifest.workload:  # a trial cleared auto
        assert s.trials[manifest.workload["trial"]].state == TrialState.COMPLETE
    elif "exported_policy" in manifest.workload:  # nothing cleared auto: auto itself
        assert manifest.workload["exported_policy"] == "auto"
    else:  # a built-in rule cleared auto and was exported as itself
        assert manifest.family == manifest.workload["builtin_rule"]


@pytest.mark.solo  # two searches: beside another test the smallest plan needed 1m47s of 90s
def test_two_journal_file_workers_form_one_study(tmp_path):
    storage = str(tmp_path / "runs.log")
    outs = _two_workers(tmp_path, storage, "shared")
    _check_one_study(tmp_path, storage, "shared", outs)
