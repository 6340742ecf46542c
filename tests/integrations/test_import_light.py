"""``import autoscale`` and ``import autoscale.integrations`` load no training framework."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FRAMEWORKS = ("accelerate", "transformers", "lightning", "pytorch_lightning", "deepspeed")


def _loaded(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({FRAMEWORKS!r}))))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a subprocess or a 124M model: seconds
def test_integrations_load_their_framework_only_when_used():
    # the DeepSpeed config needs no DeepSpeed, nor any other framework
    code = "import autoscale.integrations\nautoscale.integrations.deepspeed_config('torch')"
    assert _loaded(code) == []


@pytest.mark.slow
def test_the_check_would_see_a_framework():
    code = (
        "from autoscale.integrations import make_accelerator\nmake_accelerator('torch', cpu=True)"
    )
    assert "accelerate" in _loaded(code)
