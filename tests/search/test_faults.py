"""A search that survives faults, with real ``autoscale search`` processes on real storages:

* a worker killed with SIGKILL in the middle of a trial (SQLite): its trial is failed by the
  worker restarted in its place, the other worker and the restarted one finish, no finished trial
  is lost, the export is whole (failing a stale trial goes through Optuna's storage API, the same
  on every storage; two JournalFile workers are in test_workers.py);
* the PostgreSQL server stopped (as a crash: ``pg_ctl -m immediate``) under two workers, one of
  them frozen in a trial: each says so in one line, no finished trial is lost, and the same
  command resumes the study once the server is back and fails the trials left running;
* a cache damaged between two runs, and a half-written policy folder at the export target:
  the folder refused in one line, each damaged trace said and recorded again.

Exports killed half-way or racing for one name are tested in tests/scalers/test_publish.py,
damaged traces of every kind in tests/search/test_trace_cache.py.

Every wait is for an event (a trial state in the storage, a process stopped or gone); the figures
of each fault go to ``$AUTOSCALE_FAULTS_REPORT`` for ``experiments/faults.py``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from autoscale.scalers import LossScaler, make_scaler
from autoscale.scalers.policies import read_manifest
from tests.search.faults import (
    FaultRecord,
    PostgresServer,
    Storage,
    TrialState,
    finished,
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

# real searches, two workers on one study: up to a few minutes each
pytestmark = [pytest.mark.slow, pytest.mark.paced, pytest.mark.solo]
SPEC = Path(__file__).with_name("faults.yaml")  # mlp, bad-batches; a short replay horizon
# With the traces and torch's no-harm runs cached (warm_cache), a worker reserves validation
# and the no-harm check of its candidates and searches in the rest; --n-trials ends the search,
# and the run, within the budget. The plan grows with the budget (longer validation, more seeds:
# at 4m a kill test took up to 177 s, at 2m 88-134 s), so the budget is the smallest that fits
# with other jobs on the two cores.
BUDGET = "90s"
N_TRIALS = "12"
FINISHED = 5  # trials finished in the storage before a fault is injected
WARM_STUDY, WARM_DB = "faults-warm", "warm.db"  # the warm cache's study, beside its artifacts
VALIDATION_SHAPE = re.compile(r"on (\d+) test episodes? x (\d+) real steps")


def _search_args(storage: str, study: str) -> tuple[str, ...]:
    return (
        "search", "--env", str(SPEC), "--budget", BUDGET, "--n-trials", N_TRIALS,
        "--storage", storage, "--study", study, "--quiet",
    )  # fmt: skip


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    """An artifacts folder holding what every search of SPEC reuses (keyed by what it depends
    on): the traces one search recorded, and torch's long runs of the no-harm check."""
    root = tmp_path_factory.mktemp("warm")
    storage = f"sqlite:///{root / WARM_DB}"
    args = ("search", "--env", str(SPEC), "--budget", BUDGET, "--n-trials", "1", "--quiet",
            "--storage", storage, "--study", WARM_STUDY)  # fmt: skip
    # the same budget as the tests: the plan (trace length) depends on it; the study keeps the
    # plan, for a test that must read exactly these traces (the damaged cache)
    warm = start_worker(*args, cwd=root, name="warm")
    rc = warm.finish()
    if rc == 2 and "the budget ran out while recording traces" in warm.err:
        # a machine slower than measured (other jobs on its cores): the traces recorded so far
        # stay cached and a larger budget goes on from them, as the error says (the resume keeps
        # the study's plan: it records the rest of it whole)
        again = [a if a != BUDGET else "4m" for a in args]
        warm = start_worker(*again, cwd=root, name="warm-again")
        rc = warm.finish()
    assert rc == 0, warm.err[-3000:]
    # the plan the study stored, shortened by a re-plan or not, is in the cache under its keys
    assert all(p.is_file() for p in planned_traces(root / WARM_DB, root / "artifacts"))
    _fill_no_harm_cache(root / "artifacts")
    return root / "artifacts"


def planned_traces(db: Path, artifacts: Path, first: bool = False) -> list[Path]:
    """The cached traces a search resuming the warm study reads (its stored plan: instances and
    trace length); ``first``: only each member's first train and first test instance, which every
    plan records."""
    import optuna

    from autoscale.search.export import study_suites
    from autoscale.search.traces import instance_key

    study = optuna.load_study(study_name=WARM_STUDY, storage=f"sqlite:///{db}")
    suite, _, steps = study_suites(study)
    return [
        artifacts / "traces" / f"{instance_key(m, inst, steps)}.npz"
        for m in suite.members
        for which in ("train", "test")
        for inst in m.instances[which][: 1 if first else None]
    ]


def _fill_no_harm_cache(folder: Path) -> None:
    """Run (or find cached) torch's reference runs of the no-harm check, as a search of SPEC
    plans them, so that a search only runs its candidates' own."""
    from autoscale.envs.suite import as_suite, load_spec
    from autoscale.search.budget import Ledger
    from autoscale.search.no_harm import NO_HARM_STEPS, NoHarmCheck, no_harm_workloads
    from autoscale.search.timing import NoHarmPlan

    base = as_suite(load_spec(str(SPEC)))
    ep = base.episode
    bounds = {"init_scale": ep.init_scale, "min_scale": ep.min_scale, "max_scale": ep.max_scale}
    check = NoHarmCheck(
        NoHarmPlan(no_harm_workloads(list(base.members)), NO_HARM_STEPS), folder, Ledger(), bounds
    )
    for workload in check.no_harm.workloads:
        for seed in check.no_harm.seeds:
            check.reference(workload, seed)
            assert check.cached(workload, seed)


@pytest.fixture
def cached(warm_cache, tmp_path) -> Path:
    """``tmp_path`` with the warm caches in its artifacts folder."""
    for part in ("traces", "no-harm"):
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


def _assert_whole_export(tmp_path, study: str, name: str | None = None) -> None:
    folder = tmp_path / "policies"
    name = name or study  # the policy's name: the study's unless --export named it
    manifest = read_manifest(folder / name)
    assert manifest.workload["study"] == study
    assert isinstance(make_scaler(str(folder / name), device="cpu"), LossScaler)
    assert hidden_entries(folder) == []  # no staging or backup folder left behind


def test_worker_killed_mid_trial(cached, request):
    """Two workers on SQLite; one is frozen while a trial of its own is RUNNING in the storage
    and killed with SIGKILL, then restarted with the same command."""
    tmp_path = cached
    url, kind = f"sqlite:///{tmp_path / 'autoscale.db'}", "sqlite"
    study, storage = "kill", Storage(url)
    args = _search_args(url, study)
    a = start_worker(*args, cwd=tmp_path, name="a")
    b = start_worker(*args, cwd=tmp_path, name="b")
    # some trials finished first, so that the kill has something to lose
    wait_for(
        f"{FINISHED} finished trials",
        lambda: len(storage.finished(study)) >= FINISHED,
        alive=(a, b),
    )
    victim = freeze_mid_trial(b, storage, study)
    before = storage.finished(study)
    assert kill_hard(b) == -9
    assert storage.trials(study)[victim].state == TrialState.RUNNING  # nobody told it

    restarted = start_worker(*args, cwd=tmp_path, name="b2")
    rc = {w.pid: w.finish() for w in (a, restarted)}
    assert rc == {a.pid: 0, restarted.pid: 0}, a.err[-2000:] + restarted.err[-2000:]
    after = storage.trials(study)
    storage.close()

    assert after[victim].state == TrialState.FAIL
    assert "failed 1 trial left running by stopped workers" in restarted.out
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
    # one plan for the study: both scored the same instances with the same episodes
    # (the worker that did not create the study waited for its plan and adopted it, the
    # restarted one resumed it: neither re-plans, so the validation all ran is the same)
    shapes = {VALIDATION_SHAPE.findall(w.out)[-1] for w in workers.values()}
    assert len(shapes) == 1, shapes
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
    """Two workers on one PostgreSQL study; the server goes down (as a crash) while one of them is
    frozen in a trial of its own: each worker says in one line that the storage is lost and exits
    2; with the server back, the same command resumes the study and fails the trials the lost
    workers could not finish (the frozen one's, and the other's if it was in one it had tagged;
    one it had not yet tagged is failed by a resume after UNTAGGED_GRACE_S)."""
    tmp_path = cached
    study, storage = "down", Storage(postgres.url)
    args = _search_args(postgres.url, study)
    first = start_worker(*args, cwd=tmp_path, name="first")
    other = start_worker(*args, cwd=tmp_path, name="other")
    wait_for(
        f"{FINISHED} finished trials",
        lambda: len(storage.finished(study)) >= FINISHED,
        alive=(first, other),
    )
    # frozen while a trial of its own runs (tagged, as a worker tags it when its objective
    # starts): the crash leaves that trial running, for the resumed command to fail
    victim = freeze_mid_trial(first, storage, study)
    before = storage.finished(study)
    storage.close()
    postgres.stop("immediate")
    thaw(first)
    errors = []
    # each finishes before the server is back: the other meets the lost storage at its next
    # read or write (a trial's, a validated row's, a verdict's), whatever phase it is in
    for worker in (first, other):
        assert worker.finish() == 2, worker.err[-3000:]
        lines = [line for line in worker.err.splitlines() if "error:" in line]
        assert len(lines) == 1 and "Traceback" not in worker.err, worker.err[-3000:]
        assert re.search(
            r"autoscale search: error: lost the storage 'postgresql://autoscale@127\.0\.0\.1:\d+/"
            r"autoscale' \(.+\); this worker's \d+ complete trials are kept in study 'down'; the "
            r"same command resumes it once the storage is reachable$",
            lines[0],
        ), lines[0]
        errors.append(lines[0])

    postgres.start()
    kept = storage.trials(study)
    assert lost(before, kept) == []  # every trial finished before the crash is still there
    left_running = [n for n, t in kept.items() if t.state == TrialState.RUNNING]
    assert victim in left_running and len(left_running) <= 2  # one a worker at the most

    # a worker that lost the storage inside Optuna's ask (its trial created, not yet tagged:
    # TPE reads every trial there) leaves an untagged trial, which no resume can tell from a
    # live worker's mid-ask (another host's) until UNTAGGED_GRACE_S has passed
    tagged = [n for n in left_running if kept[n].worker is not None]
    untagged = [n for n in left_running if kept[n].worker is None]

    again = start_worker(*args, cwd=tmp_path, name="again")
    assert again.finish() == 0, again.err[-3000:]
    final = storage.trials(study)
    storage.close()
    assert "(resuming)" in again.out and "Traceback" not in again.err
    k = len(tagged)
    assert f"failed {k} trial{'' if k == 1 else 's'} left running by stopped workers" in again.out
    assert all(final[n].state == TrialState.FAIL for n in tagged)
    assert all(final[n].state == TrialState.RUNNING for n in untagged)
    assert [n for n, t in final.items() if t.state == TrialState.RUNNING] == untagged
    if untagged:  # a resume after the grace fails them too
        import optuna

        from autoscale.search.storage import open_storage
        from autoscale.search.study import fail_stale_trials

        st = open_storage(postgres.url, must_exist=False)
        loaded = optuna.load_study(study_name=study, storage=st)
        assert fail_stale_trials(loaded, st, untagged_grace_s=0.0) == len(untagged)
        getattr(st, "engine", None) and st.engine.dispose()
    assert lost(before, final) == [] and lost(finished(kept), final) == []
    assert sorted(final) == list(range(len(final))) and len(final) > len(kept)
    assert len({t.worker for t in final.values()} - {None}) == 3  # first, other and again
    _assert_whole_export(tmp_path, study)
    report(
        FaultRecord(
            request.node.name,
            "PostgreSQL server crash (pg_ctl stop -m immediate) and restart mid-search, two workers",
            "postgresql",
            finished_before=len(before),
            lost=len(lost(before, final)),
            outcome=(
                "one-line error and exit 2 from each worker; the same command resumed the study "
                f"and failed the {len(left_running)} trial(s) left running"
            ),
            details={"trials": len(final), "error": errors[0]},
        )
    )


def test_damaged_caches_and_a_half_written_policy(cached, warm_cache, request):
    """Between two searches the cache is damaged (two traces cut short or overwritten in part,
    one of torch's no-harm runs cut short) and a policy folder of the export's name is left
    half-written. The search refuses that folder in one line before writing anything; with the
    folder moved aside it warns once per damaged trace, records those again, and exports.

    The second search resumes the study that recorded the cache, so it keeps that study's plan,
    and the traces damaged are two it reads under that plan: a new study plans from the pace it
    measures, and on a machine busier or idler than at recording it plans other trace lengths or
    instances (other cache keys) and reads none or some of the damaged files."""
    tmp_path = cached
    db = tmp_path / "autoscale.db"
    shutil.copyfile(warm_cache.parent / WARM_DB, db)
    url = f"sqlite:///{db}"
    args = (*_search_args(url, WARM_STUDY), "--export", "damaged")
    traces = planned_traces(db, tmp_path / "artifacts", first=True)
    no_harm = sorted((tmp_path / "artifacts" / "no-harm").glob("*.npz"))
    assert len(traces) >= 2 and all(p.is_file() for p in traces) and no_harm
    cut = traces[0].read_bytes()
    traces[0].write_bytes(cut[: len(cut) // 2])
    data = bytearray(traces[1].read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    traces[1].write_bytes(bytes(data))
    no_harm[0].write_bytes(no_harm[0].read_bytes()[:100])
    half = tmp_path / "policies" / "damaged"
    half.mkdir(parents=True)
    # cut off in the middle of a mapping, as a copy that did not finish
    (half / "policy.yaml").write_text(
        "name: damaged\nkind: parametric\nfamily: torch\nparameters: {growth_interval: 5"
    )

    stored = db.read_bytes()
    refused = start_worker(*args, cwd=tmp_path, name="refused")
    assert refused.finish() == 2
    (line,) = refused.err.strip().splitlines()
    assert line.startswith(f"autoscale search: error: policy folder '{half}' already exists and ")
    assert "is not a readable policy (cannot read" in line
    assert line.endswith("remove it, choose another name (--export NAME) or pass --force")
    assert db.read_bytes() == stored  # refused before writing anything

    half.rename(tmp_path / "damaged-aside")
    again = start_worker(*args, cwd=tmp_path, name="again")
    assert again.finish() == 0, again.err[-3000:]
    warned = [line for line in again.err.splitlines() if line.startswith("warning: cached ")]
    # (on a failure, the plan and record lines say whether this search read other instances)
    phases = "\n".join(x for x in again.out.splitlines() if x.startswith("["))
    assert sorted(w.split("'")[1] for w in warned) == sorted(map(str, traces[:2])), (
        phases + "\n" + again.err[-3000:]
    )
    assert all(w.endswith("; recording it again") for w in warned)
    m = re.search(r"\[3/6 record\] (\d+) instances x \d+ real steps: (\d+) recorded", again.out)
    assert m and int(m[2]) >= 2
    assert "Traceback" not in again.err
    _assert_whole_export(tmp_path, WARM_STUDY, "damaged")
    report(
        FaultRecord(
            request.node.name,
            "damaged cache (2 traces, 1 no-harm run) and a half-written policy folder",
            "sqlite",
            injected=4,
            outcome="the folder refused in one line before anything was written; each damaged "
            "trace warned once and recorded again; the search exported a whole policy",
            details={"warnings": warned},
        )
    )
