"""deferred_interrupt: a SIGINT inside the block comes out after it, exactly once, through the
handler that was there before."""

from __future__ import annotations

import signal
import threading

import pytest

from autoscale.search.interrupts import deferred_interrupt


@pytest.fixture(autouse=True)
def default_handler():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_sigint_inside_the_block_is_raised_when_the_block_ends():
    done = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupt():
        signal.raise_signal(signal.SIGINT)
        done.append("after the signal")  # the block runs to its end
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_a_sigint_nothing_is_raised_and_the_handler_is_restored():
    with deferred_interrupt():
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # and it acts again at once
        signal.raise_signal(signal.SIGINT)


def test_nested_blocks_deliver_once_when_the_outermost_ends():
    where = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupt():
        with deferred_interrupt():
            signal.raise_signal(signal.SIGINT)
        where.append("inner ended without raising")
    assert where == ["inner ended without raising"]


def test_the_previous_handler_gets_the_signal_once():
    calls = []
    signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    with deferred_interrupt():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        assert calls == []
    assert calls == [signal.SIGINT]


def test_an_ignored_sigint_stays_ignored():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with deferred_interrupt():
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_the_interrupt_wins_over_an_error_of_the_block():
    with pytest.raises(KeyboardInterrupt) as info, deferred_interrupt():
        signal.raise_signal(signal.SIGINT)
        raise RuntimeError("boom")
    assert isinstance(info.value.__context__, RuntimeError)


def test_outside_the_main_thread_the_block_runs_as_is():
    seen = []

    def worker():
        with deferred_interrupt():
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_python_drops_in_a_weakref_callback_is_raised_again():
    """A KeyboardInterrupt raised while a weakref callback runs (SQLAlchemy's, during garbage
    collection) is printed as "Exception ignored" and lost: the search then ran to its budget's
    end and exited 0 after a Ctrl-C. Under ``sticky_interrupt`` the next check raises it."""
    import sys
    import weakref

    from autoscale.processes import raise_if_interrupted, sticky_interrupt

    class Thing:
        pass

    def collect(fired: list) -> None:
        def callback(_) -> None:
            fired.append("ran")
            signal.raise_signal(signal.SIGINT)  # Python's handler runs here: its raise is dropped
            fired.append("not reached")

        thing = Thing()
        ref = weakref.ref(thing, callback)
        del thing  # the callback runs here, and Ctrl-C lands inside it
        assert ref() is None

    fired: list = []
    collect(fired)  # Python's own handler: the KeyboardInterrupt is dropped
    assert fired == ["ran"]
    raise_if_interrupted()  # outside sticky_interrupt: nothing to raise
    dropped: list = []
    before, sys.unraisablehook = sys.unraisablehook, dropped.append
    try:
        with sticky_interrupt():
            fired.clear()
            collect(fired)
            assert fired == ["ran"]
            assert dropped == []  # no "Exception ignored" traceback: it comes out again below
            with pytest.raises(KeyboardInterrupt):
                raise_if_interrupted()
            raise_if_interrupted()  # once only
        assert sys.unraisablehook == dropped.append  # the hook before is back
    finally:
        sys.unraisablehook = before
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_owner_is_gone_only_when_it_is_a_dead_process_of_this_host():
    import subprocess
    import sys

    from autoscale.processes import host_name, owner_gone, owner_tag

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    assert owner_gone(f"{host_name()}:{child.pid}")
    assert not owner_gone(owner_tag())  # this process runs
    assert not owner_gone(f"some-other-host:{child.pid}")  # another host's: not ours to judge
    for not_a_tag in (None, "", "no-colon", f"{host_name()}:pid"):
        assert not owner_gone(not_a_tag)


def test_a_ctrl_c_inside_an_import_is_raised_after_it_not_in_it(tmp_path, monkeypatch):
    """A KeyboardInterrupt raised inside an import can leave the module half set up, and inside a
    class body's ``__set_name__`` Python wraps it in a RuntimeError that a caller's ``except
    Exception`` takes for a failure: a piped search that got Ctrl-C while matplotlib was being
    imported for its plot exited 1, another ran on to its budget's end. Under
    ``sticky_interrupt`` the import completes and the Ctrl-C comes at the next check, or at the
    block's end when no check comes."""
    import importlib
    import sys

    from autoscale.processes import raise_if_interrupted, sticky_interrupt

    (tmp_path / "sigint_mid_import.py").write_text(
        "import signal\nsignal.raise_signal(signal.SIGINT)\nAFTER = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with sticky_interrupt():
        module = importlib.import_module("sigint_mid_import")
        assert module.AFTER  # the import ran to its end
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
    del sys.modules["sigint_mid_import"]
    with pytest.raises(KeyboardInterrupt), sticky_interrupt():  # no check: at the block's end
        importlib.import_module("sigint_mid_import")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    del sys.modules["sigint_mid_import"]


@pytest.mark.slow  # about a second or more
def test_a_ctrl_c_inside_a_storage_call_is_raised_after_it_not_in_it(tmp_path, caplog):
    """A KeyboardInterrupt raised inside SQLAlchemy's fetch (a pruner reading the study mid-trial)
    made it close the connection under its own cursor and log "Error closing cursor" with a
    traceback: a records search's Ctrl-C printed one (a CI failure). Under ``sticky_interrupt``
    the storage call completes and the Ctrl-C comes at the next check; a second Ctrl-C while one
    is held is raised where it lands."""
    import logging

    import optuna
    from sqlalchemy import event

    from autoscale.processes import raise_if_interrupted, sticky_interrupt

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}")
    study = optuna.create_study(storage=storage, study_name="s")
    for x in range(3):
        study.add_trial(optuna.trial.create_trial(value=float(x), params={}, distributions={}))
    presses: list[int] = []

    def ctrl_c(*_args) -> None:  # runs inside SQLAlchemy's execute, as a SIGINT during it would
        for _ in range(presses.pop() if presses else 0):
            signal.raise_signal(signal.SIGINT)

    event.listen(storage.engine, "after_cursor_execute", ctrl_c)
    caplog.set_level(logging.WARNING, logger="sqlalchemy")
    with sticky_interrupt():
        presses.append(1)
        try:
            trials = study.get_trials(deepcopy=False)
        except KeyboardInterrupt:
            pytest.fail("the Ctrl-C was raised inside the storage call")
        assert len(trials) == 3  # the call ran to its end
        assert presses == []
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
        raise_if_interrupted()  # once only
        presses.append(2)
        with pytest.raises(KeyboardInterrupt):
            study.get_trials(deepcopy=False)  # pressed again: out at once
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()  # remembered until a check sees it (one Python may drop)
    # the held one went out with the second: the block's end raises nothing
    assert [r.getMessage() for r in caplog.records if r.name.startswith("sqlalchemy")] == []
    assert len(study.get_trials(deepcopy=False)) == 3  # the storage still answers
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
