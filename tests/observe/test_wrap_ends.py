"""``autoscale wrap`` on scripts shaped as people write them, ended the ways runs end: torch looked
up before it is imported, signals, SIGKILL, resume under another scaler, spawned processes with no
rank, two scalers in one program, Pythons that skip the wrap. Subprocesses, as in test_wrap."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import autoscale
from autoscale.observe import read_record

SCRIPTS = Path(__file__).parent / "scripts"
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def _wrap(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autoscale", "wrap", *args],
        cwd=cwd,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _summary(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("autoscale wrap:")]


def _lines(out: str, tag: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(tag + " ")]


@pytest.mark.slow
def test_a_lookup_of_torch_before_its_import_leaves_the_wrap_in_place(tmp_path):
    script = [sys.executable, str(SCRIPTS / "lookup_first.py")]
    plain = subprocess.run(script, cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr[-2000:]
    out = _wrap("--", *script, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _lines(out.stdout, "SCALER") == ["SCALER LossScaler torch"]
    assert _lines(out.stdout, "LOSS") == _lines(plain.stdout, "LOSS")  # bit for bit
    # isinstance against both GradScaler classes, as without the wrap
    assert _lines(out.stdout, "ISINSTANCE") == _lines(plain.stdout, "ISINSTANCE")
    assert _lines(out.stdout, "ISINSTANCE") == ["ISINSTANCE True True"]
    lines = _summary(out.stderr)
    assert "torch (rank 0): 4 steps" in lines[0]
    assert "disabled, no CUDA device here" in lines[1]


@pytest.mark.slow
def test_a_program_that_imports_autoscale_before_torch_is_wrapped(tmp_path):
    # autoscale's own import imports torch, where the wrap could not import autoscale yet
    code = (
        "import autoscale\nimport torch\nprint('TYPE', type(torch.amp.GradScaler('cpu')).__name__)"
    )
    out = _wrap("--", sys.executable, "-c", code, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _lines(out.stdout, "TYPE") == ["TYPE LossScaler"]
    assert "could not install" not in out.stderr


@pytest.mark.slow
def test_transformers_imported_first_is_wrapped(tmp_path):
    pytest.importorskip("transformers")
    out = _wrap(
        "--scaler", "auto", "--", sys.executable, str(SCRIPTS / "hf_first.py"), cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert _lines(out.stdout, "SCALER") == ["SCALER LossScaler auto"]
    assert "auto (rank 0): 1 steps" in out.stderr


@pytest.mark.slow
def test_pythons_that_skip_the_wrap_are_named(tmp_path):
    for flag, says in (("-S", "runs without sitecustomize"), ("-I", "runs without PYTHONPATH")):
        out = _wrap("--", sys.executable, flag, "-c", "pass", cwd=tmp_path)
        assert out.returncode == 0
        assert _summary(out.stderr) == [
            f"autoscale wrap: the command built no GradScaler (python {flag} {says}"
            + (" or sitecustomize" if flag == "-I" else "")
            + f", which the wrap needs: the run was not wrapped; run it without {flag})"
        ]
    show = "import os, autoscale; print('PATH', os.environ['PYTHONPATH']); print('AT', os.path.realpath(autoscale.__file__))"
    no_torch = _wrap("--", sys.executable, "-c", "pass", cwd=tmp_path)
    assert "the command's Python never imported torch" in no_torch.stderr
    missing = _wrap("--", sys.executable, "no-such-script.py", cwd=tmp_path)
    assert missing.returncode == 2  # the command's own status
    assert _summary(missing.stderr) == [
        "autoscale wrap: the command built no GradScaler (the command's Python exited with "
        "status 2 before importing torch; nothing was scaled or recorded)"
    ], missing.stderr
    shown = _wrap("--", sys.executable, "-c", show, cwd=tmp_path)
    # a checkout (an editable install) lends the package only, not its root (tests, experiments)
    checkout = str(Path(autoscale.__file__).resolve().parents[1])
    (path,) = _lines(shown.stdout, "PATH")
    assert checkout not in path.split()[1].split(os.pathsep)
    (at,) = _lines(shown.stdout, "AT")
    assert Path(at.split()[1]).resolve() == Path(autoscale.__file__).resolve()
    autocast = "import torch\nwith torch.autocast('cpu', dtype=torch.float16): pass"
    bare = _wrap("--", sys.executable, "-c", autocast, cwd=tmp_path)
    assert "it ran under fp16 autocast" in bare.stderr and "never scaled" in bare.stderr


def _as_from_a_terminal() -> None:
    """SIGHUP and SIGINT at their defaults, as a command started from a terminal has them: a test
    run under nohup, or as a background job of a script, would pass them on ignored, and a program
    that ignores a signal (the wrap keeps that, as without it) never ends by it."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _until(mode: str, sig: int, rec: Path, *, to_child: bool = False, at: int = 300):
    """Run until_signal.py wrapped; send ``sig`` (to the launcher, or to the program) once it
    has printed step ``at``. Returns (exit status, steps printed, its stdout after that, stderr).

    stdout is read unbuffered (a byte at a time up to each newline): a buffered reader reads
    ahead, and ``communicate`` reads the pipe itself, so the lines read ahead before the signal
    would be lost to it, and a run that took more steps than it showed would look wrong."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "autoscale", "wrap", "--record", str(rec), "--", sys.executable]
        + [str(SCRIPTS / "until_signal.py"), mode],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
        preexec_fn=_as_from_a_terminal,
    )
    pid, printed = None, -1
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode()
        if line.startswith("PID"):
            pid = int(line.split()[1])
        if line.startswith("STEP"):
            printed = int(line.split()[1])
            if printed >= at:
                os.kill(pid, sig) if to_child else proc.send_signal(sig)
                break
    rest, err = (b.decode() for b in proc.communicate(timeout=300))
    # the signal may cut the last line short ("STEP" without its number): whole lines only
    steps = [int(m.group(1)) for m in re.finditer(r"^STEP (\d+)$", rest, re.MULTILINE)]
    return proc.returncode, max([printed, *steps]) + 1, rest, err


@pytest.mark.slow
def test_sigterm_writes_every_step_and_the_run_still_dies_by_it(tmp_path):
    code, taken, _, err = _until("default", signal.SIGTERM, tmp_path / "r")
    assert code == 128 + signal.SIGTERM  # as without the wrap: died by the signal
    record = read_record(tmp_path / "r")
    assert record.meta["finished"] and record.notes == []
    # every step taken, not only the whole chunks of 256 (the step that printed last may have
    # been followed by one more before the handler ran)
    assert taken <= len(record.steps) <= taken + 1
    assert [s["step"] for s in record.steps] == list(range(len(record.steps)))
    assert f"torch (rank 0): {len(record.steps)} steps" in err
    assert "ended by signal 15 (SIGTERM); exit status 143" in err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "to_child"),
    [(signal.SIGHUP, False), (signal.SIGINT, True)],  # a closed terminal; Ctrl-C in the program
)
def test_sighup_and_sigint_write_every_step_too(tmp_path, sig, to_child):
    code, taken, _, err = _until("default", sig, tmp_path / "r", to_child=to_child)
    assert code == 128 + sig
    record = read_record(tmp_path / "r")
    assert record.meta["finished"] and taken <= len(record.steps) <= taken + 1
    assert f"torch (rank 0): {len(record.steps)} steps" in err


@pytest.mark.slow
def test_the_programs_own_sigterm_handler_still_runs(tmp_path):
    for mode in ("own-before", "own-after"):
        code, taken, out, err = _until(mode, signal.SIGTERM, tmp_path / mode)
        assert code == 0 and "HANDLER 15" in out  # the program stopped its loop and exited
        steps = int(_lines(out, "STOPPED")[0].split()[1])
        record = read_record(tmp_path / mode)
        assert record.meta["finished"] and len(record.steps) == steps
        assert f"torch (rank 0): {steps} steps" in err


@pytest.mark.slow
def test_sigkill_keeps_whole_chunks_and_the_exit_line_knows_the_scaler(tmp_path):
    code, taken, _, err = _until("default", signal.SIGKILL, tmp_path / "r", to_child=True)
    assert code == 128 + signal.SIGKILL
    record = read_record(tmp_path / "r")
    assert len(record.steps) == 256 and not record.meta.get("finished")  # one whole chunk
    line = _summary(err)[0]
    assert "torch (rank 0): at least " in line and "killed?" in line
    assert int(line.split("at least ")[1].split()[0]) >= 256
    assert "built no GradScaler" not in err


@pytest.mark.slow
def test_observe_then_resume_under_auto(tmp_path):
    ckpt = str(tmp_path / "ck.pt")
    script = [sys.executable, str(SCRIPTS / "resume.py")]
    saved = _wrap("--", *script, "save", ckpt, cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr[-2000:]
    scale = float(_lines(saved.stdout, "SAVED")[0].split()[1])
    env = {**ENV, "PYTHONWARNINGS": "default"}
    resumed = _wrap("--scaler", "auto", "--", *script, "load", ckpt, cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _lines(resumed.stdout, "RESUMED") == [f"RESUMED {scale}"]
    assert _lines(resumed.stdout, "SCALER") == ["SCALER LossScaler auto"]
    warned = [line for line in resumed.stderr.splitlines() if "starts fresh" in line]
    assert len(warned) == 1 and "saved by rule 'torch' loads into 'auto'" in warned[0]


@pytest.mark.slow
def test_spawned_processes_without_a_rank_record_apart(tmp_path):
    script = [sys.executable, str(SCRIPTS / "spawned.py")]
    out = _wrap("--record", "r", "--all-ranks", "--", *script, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = _summary(out.stderr)
    assert len(lines) == 2 and "torch (rank 0): 5 steps" in lines[0]
    assert "torch (pid " in lines[1] and "5 steps" in lines[1]
    (other,) = [p for p in (tmp_path / "r").iterdir() if p.is_dir()]
    assert other.name.startswith("pid") and other.name.endswith("-scaler0")
    assert len(read_record(tmp_path / "r").steps) == len(read_record(other).steps) == 5


@pytest.mark.slow
def test_a_second_scaler_gets_its_own_record_and_log(tmp_path):
    out = _wrap(
        "--record", "r", "--log", "csv:log.csv", "--",
        sys.executable, str(SCRIPTS / "spawned.py"), "two", cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(read_record(tmp_path / "r").steps) == 6
    assert len(read_record(tmp_path / "r" / "rank0-scaler1").steps) == 4
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 1 + 6
    assert len((tmp_path / "log.scaler1.csv").read_text().splitlines()) == 1 + 4


def _killpg_at(rec: Path, at: int) -> tuple[int, int]:
    """Run until_signal.py wrapped in a process group of its own and SIGTERM the whole group
    once it has printed step ``at``, as scancel, a shell's job control or torchrun's teardown do:
    the program gets the signal from its group and again from the launcher, which forwards it.
    Returns (exit status, steps taken)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "autoscale", "wrap", "--record", str(rec), "--", sys.executable]
        + [str(SCRIPTS / "until_signal.py"), "default"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        bufsize=0,
        start_new_session=True,
    )
    printed = -1
    for raw in iter(proc.stdout.readline, b""):
        if raw.startswith(b"STEP"):
            printed = int(raw.split()[1])
            if printed >= at:
                os.killpg(proc.pid, signal.SIGTERM)
                break
    rest = proc.communicate(timeout=300)[0].decode()
    steps = [int(m.group(1)) for m in re.finditer(r"^STEP (\d+)$", rest, re.MULTILINE)]
    return proc.returncode, max([printed, *steps]) + 1


@pytest.mark.slow
def test_a_sigterm_to_the_whole_group_writes_every_step(tmp_path):
    # twice three runs at once (the load stretches the window in which the forwarded signal
    # lands during the first one's write); each stopped with a chunk of ~190 steps pending
    from concurrent.futures import ThreadPoolExecutor

    recs = [tmp_path / f"r{i}" for i in range(6)]
    with ThreadPoolExecutor(3) as pool:
        ends = list(pool.map(lambda rec: _killpg_at(rec, 700), recs))
    assert [code for code, _ in ends] == [128 + signal.SIGTERM] * len(recs)
    cut = []
    for rec, (_, taken) in zip(recs, ends, strict=True):
        record = read_record(rec)
        if not (record.meta.get("finished") and taken <= len(record.steps) <= taken + 1):
            cut.append(f"{rec.name}: {len(record.steps)} of {taken} steps recorded")
    assert cut == []


@pytest.mark.slow
def test_a_signal_during_the_watchs_flush_waits_for_its_rows(tmp_path):
    """The SIGTERM's handler ran inside the watch's flush, which had taken its 32 pending steps
    out of the pending list: the handler's final write found none pending and the process ended
    without them (under load: "672 of 703 steps recorded"). Sent here from inside the record's
    write, every time: it waits until the rows are in the record."""
    out = _wrap(
        "--record", "r", "--", sys.executable, str(SCRIPTS / "signal_in_flush.py"), cwd=tmp_path
    )
    assert out.returncode == 128 + signal.SIGTERM, out.stderr[-2000:]
    taken = len(_lines(out.stdout, "STEP"))
    record = read_record(tmp_path / "r")
    assert record.meta.get("finished") and taken >= 31  # killed in the 32nd step's flush
    assert taken <= len(record.steps) <= taken + 1, (len(record.steps), taken)
