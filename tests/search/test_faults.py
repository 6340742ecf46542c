"""A search that survives faults, with real ``autoscale search`` processes on real storages:

* a worker killed with SIGKILL in the middle of a trial (SQLite, JournalFile, PostgreSQL): its
  trial is failed by the worker restarted in its place, the other worker and the restarted one
  finish, no finished trial is lost, the export is whole;
* the PostgreSQL server stopped (as a crash: ``pg_ctl -m immediate``) during a search: the worker
  says so in one line, no finished trial is lost, and the same command resumes the study once
  the server is back;
* a cache of traces damaged between two runs: detected, said, recorded again;
* an export killed half-way, and exports racing for one name: one whole policy.

Every wait is for an event (a trial state in the storage, a process stopped or gone); the figures
of each fault go to ``$AUTOSCALE_FAULTS_REPORT`` for ``experiments/faults.py``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from autoscale.scalers import LossScaler, get_scaler
from autoscale.scalers.policies import read_manifest
from tests.search.faults import (
    FaultRecord,
    PostgresServer,
    Storage,
    TrialState,
    freeze,
    freeze_mid_trial,
    hidden_entries,
    kill_hard,
    lost,
    postgres_skip_reason,
    report,
    start_worker,
    thaw,
    wait_for,
)

pytestmark = pytest.mark.slow  # real searches: a minute or two each
SPEC = Path(__file__).with_name("faults.yaml")  # mlp, bad-batches; a short replay horizon
# With the traces and torch's no-harm runs cached (warm_cache), this leaves the search phase tens
# of seconds even when other jobs slow the steps five times; --n-trials bounds it.
BUDGET = "2m"
N_TRIALS = "30"


def _search_args(storage: str, study: str) -> tuple[str, ...]:
    return (
        "search", "--env", str(SPEC), "--budget", BUDGET, "--n-trials", N_TRIALS,
        "--storage", storage, "--study", study, "--quiet",
    )  # fmt: skip


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    """The artifacts folder of one search of SPEC: its recorded traces and torch's no-harm runs,
    which every search of SPEC reuses (keyed by what they depend on)."""
    root = tmp_path_factory.mktemp("warm")
    args = ("search", "--env", str(SPEC), "--budget", BUDGET, "--n-trials", "1", "--quiet")
    warm = start_worker(*args, cwd=root, name="warm")
    assert warm.finish() == 0, warm.err[-3000:]
    return root / "artifacts"


@pytest.fixture
def cached(warm_cache, tmp_path) -> Path:
    """``tmp_path`` with the warm caches in its artifacts folder."""
    for part in ("traces", "gate"):
        shutil.copytree(warm_cache / part, tmp_path / "artifacts" / part)
    return tmp_path


@pytest.fixture
def postgres():
    reason = postgres_skip_reason()
    if reason:
        pytest.skip(reason)
    server = PostgresServer()
    yield server
    server.close()


def _storage_url(kind: str, tmp_path, request) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'autoscale.db'}"
    if kind == "journal":
        return str(tmp_path / "runs.log")
    return request.getfixturevalue("postgres").url


def _assert_whole_export(tmp_path, study: str) -> None:
    folder = tmp_path / "policies"
    manifest = read_manifest(folder / study)
    assert manifest.workload["study"] == study
    assert isinstance(get_scaler(str(folder / study), device="cpu"), LossScaler)
    assert hidden_entries(folder) == []  # no staging or backup folder left behind


@pytest.mark.parametrize("kind", ["sqlite", "journal", "postgresql"])
def test_worker_killed_mid_trial(kind, cached, request):
    """Two workers; one is frozen while a trial of its own is RUNNING in the storage and killed
    with SIGKILL, then restarted with the same command."""
    tmp_path = cached
    url = _storage_url(kind, tmp_path, request)
    study, storage = "kill", Storage(url)
    args = _search_args(url, study)
    a = start_worker(*args, cwd=tmp_path, name="a")
    b = start_worker(*args, cwd=tmp_path, name="b")
    victim = freeze_mid_trial(b, storage, study)
    before = storage.complete(study)
    assert kill_hard(b) == -9
    assert storage.trials(study)[victim].state == TrialState.RUNNING  # nobody told it

    restarted = start_worker(*args, cwd=tmp_path, name="b2")
    rc = {w.pid: w.finish() for w in (a, restarted)}
    assert rc == {a.pid: 0, restarted.pid: 0}, a.err[-2000:] + restarted.err[-2000:]
    after = storage.trials(study)
    storage.close()

    assert after[victim].state == TrialState.FAIL
    assert "failed 1 trial(s) left running by stopped workers here" in restarted.out
    assert not [n for n, t in after.items() if t.state == TrialState.RUNNING]
    assert lost(before, after) == []
    assert sorted(after) == list(range(len(after)))
    workers = {"other": a, "restarted": restarted}
    ran = {k: int(re.search(r"this worker ran (\d+) trials", w.out)[1]) for k, w in workers.items()}
    by_worker = {k: sum(1 for t in after.values() if t.worker == w.tag) for k, w in workers.items()}
    # every trial a worker says it ran is in the study, and the restarted worker searched on
    # (the other may have spent its budget validating and checking: on a loaded machine the
    # first round reserves both before it searches)
    assert by_worker == ran and ran["restarted"] > 0
    assert "Traceback" not in a.err + restarted.err
    _assert_whole_export(tmp_path, study)
    report(
        FaultRecord(
            request.node.name,
            "SIGKILL of a worker mid-trial",
            kind,
            finished_before=len(before),
            lost=len(lost(before, after)),
            outcome=f"its trial {victim} failed by the restarted worker; both workers finished",
            details={
                "trials": len(after),
                "ran": ran,
                "complete": sum(t.state == TrialState.COMPLETE for t in after.values()),
                "failed": sum(t.state == TrialState.FAIL for t in after.values()),
            },
        )
    )


def test_postgresql_server_stops_and_restarts(postgres, cached, request):
    """The server goes down (as a crash) while the worker is frozen in its search; the worker
    says in one line that the storage is lost and exits 2; with the server back, the same
    command resumes the study and fails the trial the lost worker could not finish."""
    tmp_path = cached
    study, storage = "down", Storage(postgres.url)
    args = _search_args(postgres.url, study)
    first = start_worker(*args, cwd=tmp_path, name="first")
    wait_for("3 complete trials", lambda: len(storage.complete(study)) >= 3, alive=(first,))
    freeze(first)
    before = storage.complete(study)
    storage.close()
    postgres.stop("immediate")
    thaw(first)
    assert first.finish() == 2, first.err[-3000:]
    errors = [line for line in first.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in first.err, first.err[-3000:]
    assert re.search(
        r"autoscale search: error: lost the storage 'postgresql://autoscale@127\.0\.0\.1:\d+/"
        r"autoscale' \(.+\); this worker's \d+ complete trials are kept in study 'down'; the same "
        r"command resumes it once the storage is reachable$",
        errors[0],
    ), errors[0]

    postgres.start()
    kept = storage.trials(study)
    assert lost(before, kept) == []  # every trial finished before the crash is still there
    left_running = [n for n, t in kept.items() if t.state == TrialState.RUNNING]

    again = start_worker(*args, cwd=tmp_path, name="again")
    assert again.finish() == 0, again.err[-3000:]
    final = storage.trials(study)
    storage.close()
    assert "(resuming)" in again.out and "Traceback" not in again.err
    if left_running:
        assert f"failed {len(left_running)} trial(s) left running" in again.out
    assert all(final[n].state == TrialState.FAIL for n in left_running)
    assert not [n for n, t in final.items() if t.state == TrialState.RUNNING]
    assert lost(before, final) == [] and lost(storage_complete(kept), final) == []
    assert sorted(final) == list(range(len(final))) and len(final) > len(kept)
    _assert_whole_export(tmp_path, study)
    report(
        FaultRecord(
            request.node.name,
            "PostgreSQL server crash (pg_ctl stop -m immediate) and restart mid-search",
            "postgresql",
            finished_before=len(before),
            lost=len(lost(before, final)),
            outcome=(
                "one-line error, exit 2; the same command resumed the study"
                + (f" and failed its {len(left_running)} running trial(s)" if left_running else "")
            ),
            details={"trials": len(final), "error": errors[0]},
        )
    )


def storage_complete(rows):
    return {n: t for n, t in rows.items() if t.state == TrialState.COMPLETE}
