"""``autoscale wrap`` end to end, as subprocesses: scripts autoscale never saw, unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoscale.observe import read_record

SCRIPTS = Path(__file__).parent / "scripts"


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _wrap(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "autoscale", "wrap", *args], cwd)


def _lines(out: str, tag: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(tag + " ")]


@pytest.mark.slow
def test_a_scaler_the_program_builds_itself_is_observed_as_it_is(tmp_path):
    """A program that took the README's advice (``autoscale.get_scaler``) builds no torch
    GradScaler: the wrap observes and records its scaler anyway, changes nothing, and says that
    ``--scaler`` did not replace it (the wrap said the run built no GradScaler and recorded
    nothing)."""
    script = [sys.executable, str(SCRIPTS / "plain.py"), "20", "auto"]
    plain = _run(script, tmp_path)
    assert plain.returncode == 0, plain.stderr
    wrapped = _wrap("--record", "runs/own", "--scaler", "torch", "--", *script, cwd=tmp_path)
    assert wrapped.returncode == 0, wrapped.stderr
    assert _lines(wrapped.stdout, "LOSS") == _lines(plain.stdout, "LOSS")
    assert _lines(wrapped.stdout, "WEIGHTS") == _lines(plain.stdout, "WEIGHTS")
    said = [line for line in wrapped.stderr.splitlines() if line.startswith("autoscale wrap:")]
    assert any("built its own scaler 'auto'" in line for line in said), said
    assert not any("built no GradScaler" in line for line in said), said
    (summary,) = [line for line in said if "(rank 0)" in line]
    assert "auto (rank 0): 20 steps" in summary and "runs/own" in summary, summary
    record = read_record(tmp_path / "runs" / "own")
    assert [s["step"] for s in record.steps] == list(range(20))


@pytest.mark.slow
def test_the_observer_changes_nothing_and_records(tmp_path):
    script = [sys.executable, str(SCRIPTS / "plain.py"), "30"]
    plain = _run(script, tmp_path)
    assert plain.returncode == 0, plain.stderr
    wrapped = _wrap("--record", "runs/x", "--", *script, cwd=tmp_path)
    assert wrapped.returncode == 0, wrapped.stderr
    # bit for bit: every loss and the final weights
    assert _lines(wrapped.stdout, "LOSS") == _lines(plain.stdout, "LOSS")
    assert _lines(wrapped.stdout, "WEIGHTS") == _lines(plain.stdout, "WEIGHTS")
    assert _lines(wrapped.stdout, "SCALER") == ["SCALER autoscale.scalers.scaler LossScaler torch"]
    assert _lines(wrapped.stdout, "ISINSTANCE") == ["ISINSTANCE True"]
    summary = [line for line in wrapped.stderr.splitlines() if line.startswith("autoscale wrap:")]
    assert len(summary) == 1
    assert "torch (rank 0): 30 steps, 1 skipped (3.3%), scale 2^15 .. 2^16" in summary[0]
    assert str(tmp_path / "runs" / "x") in summary[0]

    record = read_record(tmp_path / "runs" / "x")
    assert record.meta["finished"] and record.notes == []
    assert [s["step"] for s in record.steps] == list(range(30))
    step5 = record.steps[5]
    assert step5["found_inf"] and step5["loss_nonfinite"] and step5["scale"] == 2.0**16
    assert record.steps[6]["scale"] == 2.0**15  # torch halved it
    # a gradient histogram every 8th step by default
    assert [s["hist"] is not None for s in record.steps] == [i % 8 == 0 for i in range(30)]
    assert all(sum(s["hist"]) > 0 for s in record.steps if s["hist"] is not None)
    # the scheduler stepped on every step: the record's lr shows the schedule
    assert record.steps[0]["lr"] == pytest.approx(1e-3) and record.steps[3]["lr"] == pytest.approx(
        2.5e-4
    )
    assert not any(s["threshold_measured"] for s in record.steps)


@pytest.mark.slow
def test_scaler_auto_replaces_gradscaler_keeping_what_it_has(tmp_path):
    out = _wrap(
        "--scaler", "auto", "--", sys.executable, str(SCRIPTS / "plain.py"), "12", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert _lines(out.stdout, "SCALER") == ["SCALER autoscale.scalers.scaler LossScaler auto"]
    # auto's rule has a growth_interval (kept) and no growth_factor (ignored): said once
    assert (
        "'auto' keeps growth_interval=50 and ignores the program's GradScaler arguments "
        "growth_factor=2.0" in out.stderr
    )
    assert "auto (rank 0): 12 steps, 1 skipped" in out.stderr


@pytest.mark.slow
def test_scaler_params_set_the_replacing_rule(tmp_path):
    """``--scaler-param`` sets the replacing scaler's rule (over the program's GradScaler
    arguments): what the record says it ran; a setting the rule does not take, or one without
    --scaler, is one line and exit 2 before the command runs."""
    script = [sys.executable, str(SCRIPTS / "plain.py"), "12"]
    out = _wrap(
        "--scaler", "auto", "--scaler-param", "spike_bits=8", "--scaler-param",
        "growth_interval=7", "--record", "runs/s", "--", *script, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    spec = read_record(tmp_path / "runs" / "s").meta["spec"]
    assert spec["spike_bits"] == 8.0 and spec["spike_memory"] == 256
    assert spec["growth_interval"] == 7  # the program's 50 gave way
    assert "keeps growth_interval" not in out.stderr
    for args, said in (
        (["--scaler", "auto", "--scaler-param", "spike_bitz=8"], "spike_bitz"),
        (["--scaler-param", "spike_bits=8"], "give --scaler NAME too"),
        (["--scaler", "auto", "--scaler-param", "spike_bits"], "expects KEY=VALUE"),
    ):
        bad = _wrap(*args, "--", sys.executable, "-c", "print('RAN')", cwd=tmp_path)
        assert bad.returncode == 2 and "RAN" not in bad.stdout, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and said in bad.stderr, bad.stderr


@pytest.mark.slow
def test_an_exported_policy_keeps_its_own_settings_over_the_programs(tmp_path):
    """A searched policy runs with the values it was searched and validated with: the program's
    GradScaler arguments give way where the policy has its own (said in one line, with both
    values), and apply where it has none; init_scale stays the program's (where a run starts,
    not searched), but for a static policy, whose scale it is; --scaler-param still sets any."""
    import dataclasses

    from autoscale.scalers.policies import find_policy, read_manifest, write_manifest

    shipped = read_manifest(find_policy("auto"))
    assert "growth_interval" not in shipped.parameters  # (the program's 50 applies to auto)
    mine, fixed = tmp_path / "mine", tmp_path / "fixed"
    parameters = {**shipped.parameters, "growth_interval": 27, "init_scale": 1024.0}
    write_manifest(mine, dataclasses.replace(shipped, name="mine", parameters=parameters))
    static = {"init_scale": "1e3"}  # (YAML 1.1 reads 1e3 as a string: a number all the same)
    write_manifest(
        fixed, dataclasses.replace(shipped, name="fixed", family="static", parameters=static)
    )
    script = [sys.executable, str(SCRIPTS / "plain.py"), "12"]  # growth_interval=50, 2**16
    out = _wrap("--scaler", str(mine), "--record", "runs/m", "--", *script, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "runs with its own" in line]
    assert said == [
        f"autoscale wrap: '{mine}' runs with its own growth_interval=27, not the program's "
        "GradScaler arguments growth_interval=50 (an exported policy runs as it was searched; "
        "--scaler-param KEY=VALUE sets one)"
    ], out.stderr
    meta = read_record(tmp_path / "runs" / "m").meta
    assert meta["spec"]["growth_interval"] == 27 and meta["spec"]["init_scale"] == 2.0**16
    out = _wrap("--scaler", str(fixed), "--record", "runs/f", "--", *script, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (
        f"'{fixed}' runs with its own init_scale=1000, not the program's GradScaler " in out.stderr
    )
    assert read_record(tmp_path / "runs" / "f").meta["spec"]["init_scale"] == 1000.0
    both = _wrap(
        "--scaler", str(mine), "--scaler-param", "growth_interval=9", "--record", "runs/p", "--",
        *script, cwd=tmp_path,
    )  # fmt: skip
    assert both.returncode == 0, both.stderr
    assert read_record(tmp_path / "runs" / "p").meta["spec"]["growth_interval"] == 9
    assert "runs with its own" not in both.stderr


@pytest.mark.slow
def test_exit_status_and_bad_input(tmp_path):
    fail = _wrap("--", sys.executable, "-c", "import torch, sys; sys.exit(3)", cwd=tmp_path)
    assert fail.returncode == 3
    assert "built no GradScaler" in fail.stderr
    unknown = _wrap("--scaler", "autoo", "--", sys.executable, "-c", "pass", cwd=tmp_path)
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        line for line in unknown.stderr.strip().splitlines() if "did you mean 'auto'" in line
    ]
    missing = _wrap("--", "no-such-command-xyz", cwd=tmp_path)
    assert missing.returncode == 2 and "command 'no-such-command-xyz' not found" in missing.stderr
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    if os.access(tmp_path / "ro", os.W_OK):  # root writes anywhere: use a file in the way
        target = tmp_path / "file"
        target.write_text("")
        bad = str(target / "rec")
    else:
        bad = str(tmp_path / "ro" / "rec")
    unwritable = _wrap("--record", bad, "--", sys.executable, "-c", "print('RAN')", cwd=tmp_path)
    assert unwritable.returncode == 2 and "cannot write the record folder" in unwritable.stderr
    assert "RAN" not in unwritable.stdout  # refused before the command started
    nolog = _wrap("--log", "tensorbord:x", "--", sys.executable, "-c", "pass", cwd=tmp_path)
    assert nolog.returncode == 2 and "did you mean 'tensorboard'" in nolog.stderr


@pytest.mark.slow
def test_a_record_is_never_overwritten(tmp_path):
    args = ["--record", "r", "--", sys.executable, str(SCRIPTS / "plain.py"), "3"]
    assert _wrap(*args, cwd=tmp_path).returncode == 0
    again = _wrap(*args, cwd=tmp_path)
    assert again.returncode == 2 and "holds a record already" in again.stderr
    assert len(read_record(tmp_path / "r").steps) == 3


@pytest.mark.slow
def test_lightning_under_the_observer_and_auto(tmp_path):
    pytest.importorskip(
        "lightning", reason="the Lightning test needs lightning (pip install -e '.[dev]')"
    )
    script = [sys.executable, str(SCRIPTS / "lightning_run.py")]
    plain = _run(script, tmp_path)
    assert plain.returncode == 0, plain.stderr[-2000:]
    observed = _wrap("--", *script, cwd=tmp_path)
    assert observed.returncode == 0, observed.stderr[-2000:]
    assert _lines(observed.stdout, "LOSS") == _lines(plain.stdout, "LOSS")
    assert _lines(observed.stdout, "WEIGHTS") == _lines(plain.stdout, "WEIGHTS")
    assert _lines(plain.stdout, "SCALER") == ["SCALER torch.amp.grad_scaler GradScaler -"]
    auto = _wrap("--scaler", "auto", "--", *script, cwd=tmp_path)
    assert _lines(auto.stdout, "SCALER") == ["SCALER autoscale.scalers.scaler LossScaler auto"]
    assert "auto (rank 0): 8 steps, 1 skipped" in auto.stderr


@pytest.mark.slow
def test_trainer_fp16_on_a_cpu_builds_no_gradscaler_and_keeps_its_status(tmp_path):
    pytest.importorskip("transformers")
    out = _wrap("--", sys.executable, str(SCRIPTS / "trainer_run.py"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    # Accelerate's fp16 path needs a GPU: on a CPU the Trainer builds no GradScaler (tests/gpu
    # runs the same script where it does)
    assert "built no GradScaler" in out.stderr and "only on a GPU" in out.stderr


@pytest.mark.slow
def test_torchrun_ranks_are_wrapped_and_rank_0_records(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not next to this Python")
    script = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "ddp_run.py")]
    plain = _run(script, tmp_path)
    assert plain.returncode == 0, plain.stderr[-2000:]
    wrapped = _wrap("--record", "r", "--", *script, cwd=tmp_path)
    assert wrapped.returncode == 0, wrapped.stderr[-2000:]
    for rank in (0, 1):  # each rank's scaler is autoscale's, the weights bit-identical
        mine = [line for line in wrapped.stdout.splitlines() if line.startswith(f"RANK{rank} ")]
        theirs = [line for line in plain.stdout.splitlines() if line.startswith(f"RANK{rank} ")]
        assert mine and theirs, (wrapped.stdout, wrapped.stderr[-3000:], plain.stdout)
        assert mine[0].split()[2:] == theirs[0].split()[2:]
        assert mine[0].split()[1] == "LossScaler"
    summary = [line for line in wrapped.stderr.splitlines() if line.startswith("autoscale wrap:")]
    assert len(summary) == 2 and "(rank 0)" in summary[0] and "(rank 1)" in summary[1]
    assert all("10 steps, 1 skipped" in line for line in summary)  # the ranks agreed
    assert "record:" in summary[0] and "record:" not in summary[1]
    assert [p.name for p in (tmp_path / "r").iterdir() if p.is_dir()] == []  # rank 0 only
    everyone = _wrap("--record", "all", "--all-ranks", "--", *script, cwd=tmp_path)
    assert everyone.returncode == 0, everyone.stderr[-2000:]
    assert len(read_record(tmp_path / "all").steps) == 10
    assert len(read_record(tmp_path / "all" / "rank1-scaler0").steps) == 10
