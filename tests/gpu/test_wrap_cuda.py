"""``autoscale wrap`` and recording on CUDA: the frameworks' own GradScaler (Accelerate and the
Trainer build one for fp16 only on a GPU) replaced, losses bit-identical under the observer, and
no host sync per step from recording beyond the scaler's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autoscale
from autoscale.observe import watch_scaler
from tests.gpu.helpers import count_syncs

SCRIPTS = Path(__file__).resolve().parents[1] / "observe" / "scripts"


def _run(args, cwd):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _tagged(out: str, tag: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(tag + " ")]


@pytest.mark.parametrize("script", ["accelerate_run.py", "trainer_run.py", "lightning_run.py"])
def test_framework_gradscaler_replaced_and_observer_bit_identical(script, tmp_path):
    cmd = [sys.executable, str(SCRIPTS / script)]
    plain = _run(cmd, tmp_path)
    assert plain.returncode == 0, plain.stderr[-2000:]
    wrap = [sys.executable, "-m", "autoscale", "wrap"]
    observed = _run([*wrap, "--record", "r", "--", *cmd], tmp_path)
    assert observed.returncode == 0, observed.stderr[-2000:]
    assert _tagged(observed.stdout, "WEIGHTS") == _tagged(plain.stdout, "WEIGHTS")
    assert _tagged(observed.stdout, "LOSS") == _tagged(plain.stdout, "LOSS")
    assert _tagged(observed.stdout, "SCALER")[0].endswith("LossScaler torch")
    auto = _run([*wrap, "--scaler", "auto", "--", *cmd], tmp_path)
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert _tagged(auto.stdout, "SCALER")[0].endswith("LossScaler auto")
    assert "1 skipped" in auto.stderr


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused"])
def test_recording_adds_no_host_sync_per_step(fused, tmp_path):
    def loop(scaler):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
        ).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        x, y = torch.randn(32, 256, device="cuda"), torch.randn(32, 8, device="cuda")

        def step():
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        return step

    alone = autoscale.get_scaler("torch", device="cuda")
    watched = autoscale.get_scaler("torch", device="cuda")
    watch = watch_scaler(watched, record=str(tmp_path / "r"), hist_every=1)
    watch.flush_every = 1000  # the one copy per flush is counted apart
    a, b = loop(alone), loop(watched)
    for _ in range(2):
        a(), b()
    for _ in range(5):
        assert count_syncs(b) <= count_syncs(a)
    assert count_syncs(watch.flush) == 1  # the pending steps come to the host in one copy
    watch.close()
