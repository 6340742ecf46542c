"""``autoscale wrap`` on a script in the shape of Hugging Face's run_clm.py (datasets and evaluate
imported before torch, ``from torch.amp import GradScaler``) that checkpoints its scaler and
resumes: observed, resumed under the observer and under ``--scaler auto``, and its checkpoint
loaded again without autoscale. The public scripts themselves: experiments/third_party.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "datasets_first.py"
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def _wrap(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return _run(sys.executable, "-m", "autoscale", "wrap", *args, cwd=cwd)


def _lines(out: str, tag: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(tag + " ")]


def _summary(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("autoscale wrap:")]


@pytest.mark.slow
def test_datasets_first_script_observed_then_resumed_under_auto(tmp_path):
    pytest.importorskip("datasets")
    pytest.importorskip("evaluate")
    script = (sys.executable, str(SCRIPT))
    plain = _run(*script, "save", "plain.pt", cwd=tmp_path)
    seen = _wrap("--", *script, "save", "seen.pt", cwd=tmp_path)
    # the observer changes nothing: losses and scales bit for bit, the skipped step included
    assert _lines(seen.stdout, "LOSS") == _lines(plain.stdout, "LOSS")
    assert len(_lines(plain.stdout, "LOSS")) == 6 and "nan" in _lines(plain.stdout, "LOSS")[2]
    assert _lines(seen.stdout, "SCALER") == ["SCALER LossScaler torch"]
    assert _summary(seen.stderr) == [
        "autoscale wrap: torch (rank 0): 6 steps, 1 skipped (16.7%), scale 2^11 .. 2^12, "
        "0 steps at the minimum (2^-24)"
    ]

    # resumed without autoscale from either checkpoint: the same run
    again = _run(*script, "load", "plain.pt", cwd=tmp_path)
    from_seen = _run(*script, "load", "seen.pt", cwd=tmp_path)
    assert _lines(from_seen.stdout, "LOSS") == _lines(again.stdout, "LOSS")
    assert _lines(plain.stdout, "SAVED") == ["SAVED 4096.0"]
    assert (
        _lines(from_seen.stdout, "RESUMED") == _lines(again.stdout, "RESUMED") == ["RESUMED 4096.0"]
    )

    # resumed under the observer: bit for bit the plain resume (the growth count carries over)
    observed = _wrap("--", *script, "load", "plain.pt", cwd=tmp_path)
    assert _lines(observed.stdout, "LOSS") == _lines(again.stdout, "LOSS")

    # resumed under auto from the observed run's checkpoint: auto's scaler takes every step,
    # from the saved scale
    auto = _wrap("--scaler", "auto", "--", *script, "load", "seen.pt", cwd=tmp_path)
    assert _lines(auto.stdout, "SCALER") == ["SCALER LossScaler auto"]
    assert _lines(auto.stdout, "RESUMED") == ["RESUMED 4096.0"]
    # no step skipped and every scale a power of two: the same losses as the plain resume
    assert [line.split()[2] for line in _lines(auto.stdout, "LOSS")] == [
        line.split()[2] for line in _lines(again.stdout, "LOSS")
    ]
    (line,) = _summary(auto.stderr)
    assert line.startswith("autoscale wrap: auto (rank 0): 6 steps, 0 skipped")
