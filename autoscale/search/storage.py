"""Optuna storages from URLs (:func:`open_storage`: SQLite, a ``.log`` JournalFile, or a server
URL), the artifact store and the cache folder next to them (:func:`artifacts_dir`: ``store/``,
``traces/``, ``locks/``). SQLite runs in WAL mode with ``synchronous=NORMAL``: commits survive a
crash of the process without a disk sync on every write. User-facing detail: docs/search.md,
"Many workers, one study".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autoscale.errors import StorageError, UnknownNameError, unknown_name

__all__ = [
    "DEFAULT_STORAGE",
    "open_storage",
    "artifacts_dir",
    "artifact_store",
    "study_names",
    "load_study",
    "mask_url",
    "file_lock",
    "lost_connection",
]

DEFAULT_STORAGE = "sqlite:///autoscale.db"
_FILE_SUFFIXES = (".db", ".sqlite", ".sqlite3")


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", str(url))


def storage_id(url: str) -> str:
    """A storage URL as it names the storage from any folder (a file by its absolute path)."""
    try:
        kind, path = _file_of(str(url))
    except StorageError:
        return mask_url(url)
    if path is None:
        return mask_url(url)
    path = path.expanduser().resolve()
    return str(path) if kind == "journal" else f"sqlite:///{path}"


def same_storage(a: str, b: str) -> bool:
    """Whether two storage URLs (as given or masked) name one storage (:func:`storage_id`)."""
    return storage_id(a) == storage_id(b)


def _file_of(url: str) -> tuple[str, Path | None]:
    """(kind, file) of a storage: kind is ``sqlite``, ``journal`` or ``rdb``."""
    if "://" not in url:
        if url.endswith(".log"):
            return "journal", Path(url)
        if url.endswith(_FILE_SUFFIXES):
            return "sqlite", Path(url)
        raise StorageError(
            f"storage '{url}' is neither a URL nor a file ending in .db or .log; use e.g. "
            f"{DEFAULT_STORAGE}, runs.log or postgresql://user@host/db"
        )
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        return "sqlite", None if path in ("", ":memory:") else Path(path)
    return "rdb", None


def _reason(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return re.sub(r"^\([\w.]+\)\s*", "", line).strip().rstrip(".")


_LOST = ("OperationalError", "InterfaceError", "DisconnectionError")


def lost_connection(exc: BaseException) -> str | None:
    """The reason, in a few words, when ``exc`` (or an exception it came from) says that the
    database went away or refused a connection in the middle of a run; else None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        module = type(cur).__module__ or ""
        if module.startswith(("sqlalchemy", "psycopg")) and type(cur).__name__ in _LOST:
            return _reason(cur)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return None


def open_storage(url: str, *, must_exist: bool = False) -> Any:
    """An Optuna storage for ``url``.

    Args:
        must_exist: Refuse to create a new file storage (for commands that only read).

    Raises:
        StorageError: a storage that cannot be opened or reached, in one line.
    """
    url = str(url)
    kind, path = _file_of(url)
    shown = mask_url(url)
    if path is not None:
        if must_exist and not path.is_file():
            raise StorageError(
                f"no storage at '{path}'; run autoscale search first, or pass --storage URL"
            )
        if not path.resolve().parent.is_dir():
            what = "is a file" if path.resolve().parent.exists() else "does not exist"
            raise StorageError(
                f"cannot open storage '{shown}': folder '{path.parent}' {what}; give a file in "
                "an existing folder"
            )
        if kind == "journal":
            _check_journal(path, shown)
    try:
        if kind == "journal":
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            return JournalStorage(JournalFileBackend(str(path)))
        if kind == "sqlite":
            # one host: study.fail_stale_trials covers it without heartbeats' write per trial
            storage = _rdb(url if "://" in url else f"sqlite:///{path}", {}, heartbeat=False)
            _sqlite_wal(storage.engine)
            return storage
        url = _postgres_driver(url)
        connect = {"connect_timeout": 10} if url.startswith("postgresql") else {}
        return _rdb(url, {"pool_pre_ping": True, "connect_args": connect})
    except ImportError as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, ImportError) else exc
        name = getattr(cause, "name", None) or "for this URL"
        if url.split("://")[0] in ("postgresql", "postgres"):  # either driver will do
            what = "no PostgreSQL driver (psycopg2 or psycopg) is installed"
            hint = ": pip install 'autoscale[postgres]' (psycopg2)"
        else:
            what, hint = f"its database driver {name} is not installed", ""
        raise StorageError(f"cannot open storage '{shown}': {what}{hint}") from None
    except Exception as exc:
        raise StorageError(
            f"cannot open storage '{shown}': {_reason(exc)}; check the URL, that the server runs "
            "and that the database exists"
        ) from None


def _check_journal(path: Path, shown: str) -> None:
    """Refuse a journal whose last line is no whole entry: Optuna would write its next entry
    onto it and lose the study on the read after. A line cut short may be another worker's
    write in progress, so it is read again once first."""
    for attempt in range(2):
        if not path.is_file():
            return
        number, line = _last_line(path)
        if number == 0 or _entry(line):
            return
        if attempt == 0 and not line.endswith(b"\n"):
            time.sleep(0.5)  # (a write in progress takes microseconds)
            continue
        what = "is cut short" if line.startswith(b'{"op_code"') else "is not a journal entry"
        raise StorageError(
            f"cannot open storage '{shown}': line {number} {what}; pass a journal file that "
            "autoscale search or Optuna wrote, or fix or remove that line"
        )


def _last_line(path: Path) -> tuple[int, bytes]:
    """(number, line) of a file's last line, with its newline if any; (0, b"") if empty."""
    count, whole, partial = 0, b"", b""
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            count += block.count(b"\n")
            head, sep, partial = (partial + block).rpartition(b"\n")
            if sep:
                whole = head.rpartition(b"\n")[2] + sep
    return (count + 1, partial) if partial else (count, whole)


def _entry(line: bytes) -> bool:
    try:
        return line.endswith(b"\n") and isinstance(json.loads(line), dict)
    except ValueError:
        return False


_RACE = ("already exists", "unique constraint", "duplicate key", "database is locked")
# heartbeats on database servers only: a trial whose beat is older than GRACE_S is failed by the
# next worker on any host; on one host study.fail_stale_trials does it without a write per trial
HEARTBEAT_S, GRACE_S = 10, 60


def _rdb(
    url: str, engine_kwargs: dict[str, Any], attempts: int = 5, *, heartbeat: bool = True
) -> Any:
    """An RDBStorage, retried when workers starting together race to create its tables."""
    import random
    import time

    import optuna

    class Storage(optuna.storages.RDBStorage):
        def record_heartbeat(self, trial_id: int) -> None:
            # Optuna beats from a thread of its own, where an error would print a traceback;
            # a server that went away is met and reported once by the main thread instead.
            try:
                super().record_heartbeat(trial_id)
            except Exception as exc:
                if lost_connection(exc) is None:
                    raise

    def make() -> Any:
        import warnings

        with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna 4 and 5
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            beat = {"heartbeat_interval": HEARTBEAT_S, "grace_period": GRACE_S} if heartbeat else {}
            return Storage(url, engine_kwargs=engine_kwargs, **beat)

    for _ in range(attempts - 1):
        try:
            return make()
        except Exception as exc:
            if not any(r in _reason(exc).lower() for r in _RACE):
                raise
            time.sleep(0.2 + 0.3 * random.random())
    return make()


def _postgres_driver(url: str) -> str:
    """A PostgreSQL URL with the driver that is installed: SQLAlchemy 2.1 reads a bare
    ``postgresql://`` as psycopg 3, while ``autoscale[postgres]`` installs psycopg2."""
    import importlib.util

    scheme, sep, rest = url.partition("://")
    if scheme not in ("postgresql", "postgres") or not sep:
        return url
    if (
        importlib.util.find_spec("psycopg") is None
        and importlib.util.find_spec("psycopg2") is not None
    ):
        return f"postgresql+psycopg2://{rest}"
    return f"postgresql://{rest}"


def _sqlite_wal(engine: Any) -> None:
    """WAL mode, and every transaction begun with ``BEGIN IMMEDIATE``.

    sqlite3 begins a transaction only at the first write, so two workers could both pop one
    enqueued trial between Optuna's read and write of its state (the second then dies on "Cannot
    tell a COMPLETE trial"); taking the write lock at BEGIN makes it atomic."""
    from sqlalchemy import event

    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # no implicit BEGIN: on_begin says which
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.close()

    def on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    event.listen(engine, "connect", on_connect)
    event.listen(engine, "begin", on_begin)
    engine.dispose()  # connections made so far lack the pragmas


def artifacts_dir(url: str, override: str | os.PathLike | None = None) -> Path:
    """The folder of artifacts, caches and locks of the storage ``url``."""
    if override:
        return Path(override)
    _, path = _file_of(str(url))
    return (path.resolve().parent if path is not None else Path.cwd()) / "artifacts"


def artifact_store(folder: Path) -> Any:
    """Optuna's FileSystemArtifactStore in ``folder/store`` (created)."""
    from optuna.artifacts import FileSystemArtifactStore

    store = folder / "store"
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(
            f"cannot create the artifact folder '{store}': {exc.strerror}; pass --artifacts DIR"
        ) from None
    return FileSystemArtifactStore(str(store))


def study_names(storage: Any) -> list[str]:
    """Names of the studies in ``storage``."""
    return sorted(s.study_name for s in storage.get_all_studies())


def load_study(name: str, storage: Any, url: str, **kwargs: Any) -> Any:
    """The study ``name``; an UnknownNameError listing the storage's studies if there is none."""
    import optuna

    names = study_names(storage)
    if name not in names:
        if not names:
            raise UnknownNameError(
                f"unknown study '{name}': storage '{mask_url(url)}' holds no study yet "
                "(autoscale search creates one)"
            )
        raise unknown_name("study", name, names, f"storage '{mask_url(url)}'")
    return optuna.load_study(study_name=name, storage=storage, **kwargs)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes of this host (a no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
