"""The torch range autoscale claims, and the check of torch's private members at import."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from autoscale.scalers.torch_compat import REQUIRED, SCALER_STATE, TORCH_RANGE, missing_member

ROOT = Path(__file__).resolve().parents[2]


def _torch_requirement() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if re.match(r"torch\b", d)]
    return torch_dep.removeprefix("torch").replace(" ", "")


def test_the_error_names_the_range_pyproject_claims():
    assert _torch_requirement() == TORCH_RANGE


def test_the_torch_under_test_is_in_the_claimed_range():
    """The range is what the tests run on: a run on a torch outside it tests nothing claimed."""
    bounds = re.fullmatch(r">=(\d+)\.(\d+),<(\d+)\.(\d+)", TORCH_RANGE)
    assert bounds, TORCH_RANGE
    lo, hi = tuple(map(int, bounds.group(1, 2))), tuple(map(int, bounds.group(3, 4)))
    here = tuple(int(x) for x in torch.__version__.split(".")[:2])
    assert lo <= here < hi, torch.__version__


def test_this_torch_has_every_member():
    assert missing_member() is None


# Each removes one member before autoscale is imported: a GradScaler method the scaler overrides,
# a module-level helper it imports, one the wrap's instruments import, and an attribute that
# GradScaler's __init__ sets.
REMOVALS = {
    "torch.amp.grad_scaler.GradScaler._maybe_opt_step": (
        "del torch.amp.grad_scaler.GradScaler._maybe_opt_step"
    ),
    "torch.amp.grad_scaler._refresh_per_optimizer_state": (
        "del torch.amp.grad_scaler._refresh_per_optimizer_state"
    ),
    "torch.utils._python_dispatch.TorchDispatchMode": (
        "import torch.utils._python_dispatch as d; del d.TorchDispatchMode"
    ),
    "torch.amp.GradScaler()._per_optimizer_states": (
        "from torch.amp import grad_scaler as g; i = g.GradScaler.__init__\n"
        "def init(self, *a, **k):\n    i(self, *a, **k); del self._per_optimizer_states\n"
        "g.GradScaler.__init__ = init"
    ),
}


def test_every_removal_names_a_checked_member():
    checked = set(REQUIRED) | {f"torch.amp.GradScaler().{n}" for n in SCALER_STATE}
    assert set(REMOVALS) <= checked


def _patched(tmp_path: Path, removal: str) -> dict[str, str]:
    """An environment whose Python removes a member of torch at start (sitecustomize)."""
    (tmp_path / "sitecustomize.py").write_text(f"import torch\n{removal}\n")
    return {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow  # subprocesses importing torch: seconds
@pytest.mark.parametrize("member", sorted(REMOVALS))
def test_import_without_a_member_fails_naming_torch_and_the_member(member, tmp_path):
    env = _patched(tmp_path, REMOVALS[member])
    out = subprocess.run(
        [sys.executable, "-c", "import autoscale"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last == (
        f"autoscale.errors.TorchVersionError: torch {torch.__version__} has no {member}, which "
        f"autoscale's scaler relies on; install a torch that autoscale is tested on: "
        f"pip install 'torch{TORCH_RANGE}'"
    )


@pytest.mark.slow
def test_the_cli_prints_one_line_and_exits_2(tmp_path):
    member = "torch.amp.grad_scaler.GradScaler._maybe_opt_step"
    env = _patched(tmp_path, REMOVALS[member])
    commands = [[sys.executable, "-m", "autoscale", "list"]]
    script = Path(sys.executable).parent / "autoscale"
    if script.is_file():  # the console script pip installs
        commands.append([str(script), "list"])
    for command in commands:
        out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        assert (out.returncode, out.stdout) == (2, ""), command
        assert out.stderr == (
            f"autoscale: error: torch {torch.__version__} has no {member}, which autoscale's "
            f"scaler relies on; install a torch that autoscale is tested on: "
            f"pip install 'torch{TORCH_RANGE}'\n"
        )
