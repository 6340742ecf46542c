"""Fault injection for the search's fault tests: workers as real processes (frozen and killed at
chosen points), a private PostgreSQL server to stop and restart, the storage read as the tests see
it, and the record of every fault for ``experiments/results/faults.md``.

Nothing here sleeps for a guessed length: every wait polls for an event (a trial state in the
storage, a process stopped or gone, a server answering) and fails with what it waited for if a
generous bound passes first.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from autoscale.search.storage import open_storage
from tests.search.conftest import autoscale_cmd, cli_env

TrialState = optuna.trial.TrialState
REPORT_ENV = "AUTOSCALE_FAULTS_REPORT"  # a JSON-lines file the fault tests append their figures to
POLL_S = 0.05


# ---------------------------------------------------------------------- processes
@dataclass
class Worker:
    """An ``autoscale`` subprocess whose output goes to files (a pipe nobody reads could fill)."""

    proc: subprocess.Popen
    out_path: Path
    err_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def tag(self) -> str:
        """The ``worker`` user attribute of its trials."""
        return f"{socket.gethostname()}:{self.proc.pid}"

    def poll(self) -> int | None:
        return self.proc.poll()

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def finish(self, timeout: float = 400) -> int:
        """Its exit status, once it has exited."""
        return self.proc.wait(timeout=timeout)


def start_worker(*args: str, cwd: Path, name: str) -> Worker:
    out, err = cwd / f"{name}.out", cwd / f"{name}.err"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(autoscale_cmd(*args), cwd=cwd, env=cli_env(), stdout=fo, stderr=fe)
    return Worker(proc, out, err)


def wait_for(
    what: str,
    condition: Callable[[], Any],
    *,
    alive: tuple[Worker, ...] = (),
    timeout: float = 300,
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail if a worker in ``alive`` exits
    first, or (as a safety bound, not a timing) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        for w in alive:
            if w.poll() is not None:
                raise AssertionError(
                    f"waiting for {what}: worker {w.pid} exited with {w.poll()}:\n{w.err[-3000:]}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        time.sleep(POLL_S)


def _proc_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]  # the field after the command name


def tcp_ports(pid: int) -> set[int]:
    """The local ports of process ``pid``'s TCP sockets (its open sockets matched by inode in
    /proc/net/tcp and tcp6); empty where they cannot be read."""
    links = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # (closed since the listing)
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    inodes = {link[len("socket:[") : -1] for link in links if link.startswith("socket:[")}
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if len(fields) > 9 and fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def freeze(worker: Worker) -> None:
    """SIGSTOP, returning once the kernel shows the process stopped."""
    os.kill(worker.pid, signal.SIGSTOP)
    wait_for(f"worker {worker.pid} to stop", lambda: _proc_state(worker.pid) in ("T", "t"))


def thaw(worker: Worker) -> None:
    os.kill(worker.pid, signal.SIGCONT)


def kill_hard(worker: Worker) -> int:
    """SIGKILL and reap; returns the exit status (-9)."""
    os.kill(worker.pid, signal.SIGKILL)
    return worker.finish(timeout=60)


def freeze_mid_trial(worker: Worker, storage: Storage, study: str) -> int:
    """Freeze ``worker`` while one of its trials is RUNNING in the storage; returns its number.

    Trials last a fraction of a second: the worker is frozen as soon as it has one running, then
    the storage is read again (once a server has ended the statements the worker sent before it
    stopped), and the worker is let go to try again if that trial finished between the two
    reads."""
    while True:
        wait_for(
            f"a running trial of worker {worker.tag}",
            lambda: storage.running_of(study, worker.tag),
            alive=(worker,),
        )
        freeze(worker)
        # a statement the worker sent before it stopped (its trial's COMMIT) still runs at a
        # server: the storage is read once the server has ended every one of them
        wait_for(
            f"the statements of worker {worker.tag} to end",
            lambda: storage.in_flight(worker.pid) == 0,
        )
        running = storage.running_of(study, worker.tag)
        if running:
            return running[0]
        thaw(worker)


# ---------------------------------------------------------------------- the storage
@dataclass(frozen=True)
class TrialRow:
    number: int
    state: TrialState
    value: float | None
    params: dict[str, Any]
    worker: str | None


class Storage:
    """The study as another process sees it (one storage object, so polling opens no new
    connections); ``None`` while the storage cannot be read."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._storage: Any = None

    def trials(self, study: str) -> dict[int, TrialRow] | None:
        try:
            if self._storage is None:
                self._storage = open_storage(self.url, must_exist=False)
            sid = self._storage.get_study_id_from_name(study)
            rows = self._storage.get_all_trials(sid, deepcopy=False)
        except Exception:  # not created yet, or the server is down
            return None
        return {
            t.number: TrialRow(
                t.number, t.state, t.value, dict(t.params), t.user_attrs.get("worker")
            )
            for t in rows
        }

    def running_of(self, study: str, tag: str) -> list[int]:
        rows = self.trials(study) or {}
        return [n for n, t in rows.items() if t.state == TrialState.RUNNING and t.worker == tag]

    def complete(self, study: str) -> dict[int, TrialRow]:
        rows = self.trials(study) or {}
        return {n: t for n, t in rows.items() if t.state == TrialState.COMPLETE}

    def finished(self, study: str) -> dict[int, TrialRow]:
        """The trials told complete or pruned: what a fault must not lose."""
        rows = self.trials(study) or {}
        return {
            n: t for n, t in rows.items() if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        }

    def in_flight(self, pid: int) -> int | None:
        """How many statements of process ``pid`` a PostgreSQL server is executing (its
        connections found by their local ports), leaving out those waiting for a lock: one of
        its threads may wait for a lock its stopped main thread holds, and a statement cannot
        make a change durable without the COMMIT the stopped process has yet to send. 0 for a
        storage without a server (SQLite, a journal file: a stopped process writes nothing),
        None while it cannot be read."""
        if not self.url.startswith("postgresql"):
            return 0
        ports = tcp_ports(pid)
        if not ports:
            return 0
        import sqlalchemy

        try:
            if self._storage is None:
                self._storage = open_storage(self.url, must_exist=False)
            with self._storage.engine.connect() as conn:
                return conn.execute(
                    sqlalchemy.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
                        "AND wait_event_type IS DISTINCT FROM 'Lock' AND client_port = ANY(:ports)"
                    ),
                    {"ports": sorted(ports)},
                ).scalar_one()
        except Exception:  # the server is down
            return None

    def close(self) -> None:
        engine = getattr(self._storage, "engine", None)
        if engine is not None:
            engine.dispose()
        self._storage = None


def finished(rows: dict[int, TrialRow]) -> dict[int, TrialRow]:
    """The trials told complete or pruned: what a fault must not lose."""
    return {n: t for n, t in rows.items() if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}


def lost(before: dict[int, TrialRow], after: dict[int, TrialRow]) -> list[int]:
    """Trials finished in ``before`` that ``after`` lacks or holds otherwise."""
    return [n for n, t in before.items() if after.get(n) != t]


# ---------------------------------------------------------------------- a private PostgreSQL
def postgres_bindir() -> Path | None:
    """The folder of PostgreSQL's server programs (initdb, pg_ctl), or None."""
    found = shutil.which("pg_config")
    if found:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            out = subprocess.run([found, "--bindir"], capture_output=True, text=True, check=True)
            path = Path(out.stdout.strip())
            if (path / "initdb").is_file():
                return path
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(versions[-1]).parent if versions else None


def postgres_skip_reason() -> str | None:
    """Why a private PostgreSQL server cannot run here (None when it can)."""
    import importlib.util

    if postgres_bindir() is None:
        return "PostgreSQL's server programs (initdb, pg_ctl) are not installed: apt-get install postgresql"
    if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is None:
        return "no PostgreSQL driver: pip install 'autoscale[postgres]'"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser: initdb refuses root"
    return None


class PostgresServer:
    """A throw-away PostgreSQL cluster on a free local port, owned by this test, so that it can be
    stopped and restarted without touching any other server (as root, its programs run as the
    ``postgres`` user: initdb and postgres refuse root)."""

    def __init__(self) -> None:
        self.bindir = postgres_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="autoscale-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        self._as_owner(
            "initdb", "-D", str(self.data), "-U", "autoscale", "-A", "trust", "--no-sync"
        )
        self.start()
        self._as_owner(
            "createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "autoscale", "autoscale"
        )

    @property
    def url(self) -> str:
        return f"postgresql://autoscale@127.0.0.1:{self.port}/autoscale"

    def _as_owner(self, program: str, *args: str) -> None:
        cmd = [str(self.bindir / program), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=self.root)

    def start(self) -> None:
        """Start it; returns once it accepts connections (pg_ctl -w)."""
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
        self._as_owner(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "start"
        )

    def stop(self, mode: str = "immediate") -> None:
        """Stop it (``immediate``: no shutdown checkpoint, as a crash; recovery replays the WAL);
        returns once it is down."""
        self._as_owner("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------------- the report
@dataclass
class FaultRecord:
    """One injected fault and what it cost, for experiments/results/faults.md."""

    test: str
    fault: str
    storage: str
    injected: int = 1
    finished_before: int = 0  # trials finished in the storage when the fault hit
    lost: int = 0  # of those, missing or changed afterwards
    outcome: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def report(record: FaultRecord) -> None:
    """Append ``record`` to the file named by ``$AUTOSCALE_FAULTS_REPORT`` (when set)."""
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(record.__dict__, default=str) + "\n")


def hidden_entries(folder: Path) -> list[str]:
    """Staging or backup folders left in a policy folder (none after a clean or killed export)."""
    return (
        sorted(p.name for p in folder.iterdir() if p.name.startswith("."))
        if folder.is_dir()
        else []
    )
