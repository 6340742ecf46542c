"""Using a scaler imports torch and PyYAML only (docs/design.md 2): no SB3, Gymnasium or Optuna."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

HEAVY = ("stable_baselines3", "gymnasium", "optuna")

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import autoscale

    scaler = autoscale.get_scaler("torch", device="cpu")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(3, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    autoscale.list_scalers()
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
    print(json.dumps({"heavy": heavy, "steps": scaler.steps, "autoscale": "autoscale.scalers" in sys.modules}))
    """
)


@pytest.mark.slow  # a subprocess or a 124M model: seconds
def test_scaler_use_stays_light():
    code = f"HEAVY = {HEAVY!r}\n{SCRIPT}"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == 1 and result["autoscale"] is True
    assert result["heavy"] == []


@pytest.mark.slow
def test_the_check_would_see_a_heavy_import():
    code = f"HEAVY = {HEAVY!r}\nimport gymnasium\n{SCRIPT}"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "gymnasium" in json.loads(out.stdout.strip().splitlines()[-1])["heavy"]
