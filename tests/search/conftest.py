"""Shared setup of the search tests: the CLI run as a real subprocess, and one searched storage.

The tests marked ``paced`` run real searches (``autoscale search`` subprocesses) or long real runs
against a deadline: they spend a wall-clock budget and plan from the pace they measure, so they
run apart from the rest (the README's test command runs the rest two at a time first). Among
themselves they run two at a time, a test file to a process, with one rule
(:func:`pytest_runtest_protocol`): a test that starts several processes of its own (workers on
one study, a busy process) is marked ``solo`` and runs with no other test beside it; the others,
one search each on one torch thread, run beside one another (a core each). The others decide on
injected timings and clocks, or on deadlines far from what they do, and run with the rest.

Subprocesses get one intra-op thread, as the tests here do (tests/training/conftest.py): with two
cores and another process running, OpenMP oversubscription makes steps many times slower.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.training.conftest import torch  # noqa: F401  (sets one intra-op thread)

SEARCH_BUDGET_S = 90.0  # the smallest plan of mlp with its no-harm runs (clean and drifting) fits
RULES = ("torch", "deepspeed", "megatron", "jmp", "fairseq", "metaseq", "amax-history")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a paced test holds a lock on the machine that all the run's processes
    share, from its setup (the shared searches of its fixtures included) to its teardown: a test
    marked ``solo`` alone, the others beside one another. A solo test waits until the tests
    running beside it end; without xdist each test runs alone anyway."""
    run = getattr(item.config, "workerinput", {}).get("testrunuid")
    if run is None or item.get_closest_marker("paced") is None:
        yield
        return
    solo = item.get_closest_marker("solo") is not None
    path = Path(tempfile.gettempdir()) / f"autoscale-paced-{run}.lock"
    with open(path, "a") as fh:  # closing it releases the lock
        fcntl.flock(fh, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        yield


@dataclass
class CliRun:
    rc: int
    out: str
    err: str
    wall_s: float


def cli_env(threads: str | None = "1", home: Path | None = None) -> dict[str, str]:
    """The environment of a CLI run: one torch thread (deterministic steps), or with
    ``threads=None`` none set, as a user's shell has it (autoscale picks its threads); exports
    given no folder go to ``home/policies`` (``$AUTOSCALE_HOME``), else to the calling test's
    (tests/conftest.py)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    env.pop("AUTOSCALE_POLICY_PATH", None)
    if home is not None:
        env["AUTOSCALE_HOME"] = str(home)
    return env


def autoscale_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "autoscale.cli", *args]


def _sigint_as_a_terminal_has_it() -> None:
    # A shell without job control starts background commands with SIGINT ignored, and children
    # inherit that (`bash -c '... &'` running these tests: Python then installs no handler, and a
    # Ctrl-C reaches nothing). The child of a test that interrupts it starts as a user's
    # terminal would start it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*args: str, cwd: Path) -> subprocess.Popen:
    """``autoscale ARGS`` started in the background (text pipes), Ctrl-C reaching it as in a
    terminal."""
    return subprocess.Popen(
        autoscale_cmd(*args),
        cwd=cwd,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_as_a_terminal_has_it,
    )


def run_cli(*args: str, cwd: Path, timeout: float = 180, env: dict | None = None) -> CliRun:
    t0 = time.monotonic()
    proc = subprocess.run(
        autoscale_cmd(*args),
        cwd=cwd,
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return CliRun(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)


@dataclass
class Searched:
    """The 90-second search of mlp (bad-batches), shared by the tests that read its storage.

    It runs in ``root`` with a user folder of its own (``$AUTOSCALE_HOME``): it starts before any
    test's own is set, and the tests that export from its study use the same (:attr:`env`)."""

    root: Path
    home: Path
    run: CliRun
    study: str = "mlp-bad-batches-parametric"

    @property
    def policies(self) -> Path:
        """Where its exports go when given no folder: ``$AUTOSCALE_HOME/policies``."""
        return self.home / "policies"

    @property
    def env(self) -> dict[str, str]:
        return cli_env(home=self.home)

    @property
    def db(self) -> Path:
        return self.root / "autoscale.db"

    @property
    def url(self) -> str:
        return f"sqlite:///{self.db}"


@pytest.fixture(scope="session")
def searched(tmp_path_factory) -> Searched:
    """``autoscale search --model mlp --budget 90s``, the other defaults, in a fresh folder."""
    root, home = tmp_path_factory.mktemp("search90"), tmp_path_factory.mktemp("search90-home")
    run = run_cli(
        "search",
        "--model",
        "mlp",
        "--budget",
        "90s",
        "--quiet",
        cwd=root,
        timeout=SEARCH_BUDGET_S + 120,
        env=cli_env(home=home),
    )
    return Searched(root, home, run)
