import os

import optuna
import pytest

from autoscale.errors import StorageError, UnknownNameError
from autoscale.processes import host_name
from autoscale.search.storage import (
    artifacts_dir,
    load_study,
    mask_url,
    open_storage,
    study_names,
)


def test_sqlite_file_runs_in_wal_mode(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path / 'a.db'}")
    optuna.create_study(study_name="s", storage=storage)
    with storage.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    assert study_names(open_storage(str(tmp_path / "a.db"))) == ["s"]
    assert artifacts_dir(f"sqlite:///{tmp_path / 'a.db'}") == tmp_path / "artifacts"


def test_log_path_is_a_journal_file(tmp_path):
    from optuna.storages.journal import JournalStorage

    path = tmp_path / "runs.log"
    storage = open_storage(str(path))
    assert isinstance(storage, JournalStorage)
    optuna.create_study(study_name="j", storage=storage)
    assert path.is_file() and study_names(open_storage(str(path))) == ["j"]


def test_unreachable_server_is_one_line_storage_error():
    with pytest.raises(StorageError) as info:
        open_storage("postgresql://nobody:secret@127.0.0.1:1/x")
    msg = str(info.value)
    assert "cannot open storage 'postgresql://nobody:***@127.0.0.1:1/x'" in msg
    assert "secret" not in msg and "\n" not in msg


def test_a_postgresql_url_without_a_driver_names_the_extra_and_what_it_installs(monkeypatch):
    # neither psycopg2 (which the extra installs) nor psycopg (SQLAlchemy's default) importable
    import sys

    for module in ("psycopg2", "psycopg"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(StorageError) as info:
        open_storage("postgresql://nobody@127.0.0.1:1/x")
    assert str(info.value) == (
        "cannot open storage 'postgresql://nobody@127.0.0.1:1/x': no PostgreSQL driver (psycopg2 "
        "or psycopg) is installed: pip install 'autoscale[postgres]' (psycopg2)"
    )
    # a URL that names its driver: that one is missing, whatever the extra installs
    with pytest.raises(StorageError, match="its database driver psycopg is not installed$"):
        open_storage("postgresql+psycopg://nobody@127.0.0.1:1/x")


def test_missing_folder_and_missing_file_are_refused(tmp_path):
    with pytest.raises(StorageError, match="does not exist"):
        open_storage(f"sqlite:///{tmp_path / 'nope' / 'a.db'}")
    with pytest.raises(StorageError, match="no storage at"):
        open_storage(str(tmp_path / "absent.db"), must_exist=True)
    with pytest.raises(StorageError, match="neither a URL"):
        open_storage("autoscale")


def test_unknown_study_lists_the_studies(tmp_path):
    url = f"sqlite:///{tmp_path / 'b.db'}"
    storage = open_storage(url)
    with pytest.raises(UnknownNameError, match="holds no study yet"):
        load_study("x", storage, url)
    optuna.create_study(study_name="bad-batches-run", storage=storage)
    with pytest.raises(UnknownNameError, match="did you mean 'bad-batches-run'"):
        load_study("bad-batches-rnu", storage, url)
    assert mask_url("postgresql://u:p@h/db") == "postgresql://u:***@h/db"


def test_a_trial_no_worker_tagged_is_failed_once_it_is_old(tmp_path):
    """A worker killed between Optuna's ask and its objective leaves a running trial without its
    ``worker`` tag: the next worker fails it once it is older than the grace period (a live
    worker tags its trial milliseconds after the ask), and leaves a fresh one alone."""

    from autoscale.search.study import fail_stale_trials

    storage = open_storage(str(tmp_path / "s.db"))
    study = optuna.create_study(study_name="s", storage=storage)
    untagged = study.ask()  # RUNNING, never tagged
    tagged_live = study.ask()
    tagged_live.set_user_attr("worker", f"{host_name()}:{os.getpid()}")  # this live process
    assert fail_stale_trials(study, storage) == 0  # both too fresh or alive
    assert fail_stale_trials(study, storage, untagged_grace_s=0.0) == 1
    states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    assert states == {
        untagged.number: optuna.trial.TrialState.FAIL,
        tagged_live.number: optuna.trial.TrialState.RUNNING,
    }


def _ask_many(url: str, n: int, out) -> None:
    import optuna

    from autoscale.search.storage import open_storage

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.load_study(study_name="queue", storage=open_storage(url))
    out.put([study.ask().number for _ in range(n)])


@pytest.mark.slow  # a subprocess or a 124M model: seconds
@pytest.mark.paced
@pytest.mark.solo  # several processes asking at once
def test_two_workers_never_run_the_same_enqueued_trial(tmp_path):
    """Workers asking at once on one SQLite file each get their own trial: an enqueued (WAITING)
    trial becomes RUNNING for one of them only (a worker that got one another had already run
    died on "Cannot tell a COMPLETE trial")."""
    import multiprocessing as mp

    import optuna

    from autoscale.search.storage import open_storage

    url = f"sqlite:///{tmp_path / 'queue.db'}"
    study = optuna.create_study(study_name="queue", storage=open_storage(url))
    for i in range(80):
        study.enqueue_trial({"x": i})
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ask_many, args=(url, 40, out)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    numbers = [n for g in got for n in g]
    assert len(numbers) == len(set(numbers)) == 120


@pytest.mark.slow
def test_a_journal_whose_last_entry_is_being_written_opens_once_it_is_whole(tmp_path):
    """Another worker appends a whole line under Optuna's lock; a reader that meets it half
    written reads again: the journal is not refused for it (and needs no lock to be read)."""
    import threading
    import time

    path = tmp_path / "runs.log"
    optuna.create_study(study_name="s", storage=open_storage(str(path)))
    whole = path.read_bytes()
    assert whole.endswith(b"\n")
    path.write_bytes(whole[:-10])  # the last entry's end not written yet

    def finish():
        time.sleep(0.1)
        with open(path, "ab") as fh:
            fh.write(whole[-10:])

    writer = threading.Thread(target=finish)
    writer.start()
    try:
        assert study_names(open_storage(str(path), must_exist=True)) == ["s"]
    finally:
        writer.join()
    path.write_bytes(whole[:-10])  # and one that stays cut short is refused, saying where
    with pytest.raises(StorageError, match=r"line \d+ is cut short; .*fix or remove that line"):
        open_storage(str(path))


def test_a_storage_is_named_the_same_from_any_folder(tmp_path, monkeypatch):
    from autoscale.search.storage import same_storage, storage_id

    monkeypatch.chdir(tmp_path)
    assert storage_id("a.db") == storage_id("sqlite:///a.db") == f"sqlite:///{tmp_path / 'a.db'}"
    assert storage_id("runs.log") == str(tmp_path / "runs.log")
    assert storage_id("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"
    assert same_storage("a.db", f"sqlite:///{tmp_path}/a.db")
    assert not same_storage("a.db", "b.db")
