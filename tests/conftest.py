"""Fixtures shared by the environment and agent tests, and the user folder every test writes to
instead of the real home."""

import atexit
import os
import shutil
import sys
import tempfile

# pytest keeps the test modules it rewrites (for its assert messages) as bytecode beside them,
# unless PYTHONDONTWRITEBYTECODE is set: then every run rewrites all of them again, 3-4 s of each
# worker's collection. The tests keep their cache (ignored by git, as any __pycache__).
sys.dont_write_bytecode = False

import pytest  # noqa: E402

from autoscale.envs import load_env_spec  # noqa: E402

# No test writes into the real home: an export without a folder goes to $AUTOSCALE_HOME/policies.
# Set before any test module is imported, so the environments they copy at import (for their
# subprocesses) and the session's fixtures have it too; each test then gets its own (below).
_SESSION_HOME = tempfile.mkdtemp(prefix="autoscale-home-")
atexit.register(shutil.rmtree, _SESSION_HOME, ignore_errors=True)
os.environ["AUTOSCALE_HOME"] = _SESSION_HOME

# Under pytest-xdist (`-n 2`) each worker is one of the processes sharing the cores: one torch
# thread each, as the scaler and integration tests already run (two workers of two threads each
# on two cores spend their time waiting for each other). Subprocesses keep torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def autoscale_home(tmp_path, monkeypatch):
    """The test's own user folder of autoscale's (its ``tmp_path``): what one test exports is not
    listed or found by another."""
    monkeypatch.setenv("AUTOSCALE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="session")
def tiny_spec():
    """An mlp workload with bad batches every 4 steps: fast real fp16 steps, visible skips."""
    return load_env_spec(
        {
            "name": "tiny",
            "workload": {
                "model": "mlp",
                "scenario": "bad-batches",
                "scenario_params": {"every": 4},
                "dtype": "fp16",
            },
            "episode": {"steps": 8, "init_scale": 65536, "min_scale": 1.0, "max_scale": 2**30},
            "instances": {
                "train": [{"seed": 0}, {"seed": 1, "start": 3}],
                "test": [{"seed": 5}, {"seed": 6, "start": 2}],
            },
            "reward": {"skip": 1.0, "precision": 4.0, "progress": 0.1, "divergence": 10.0},
        }
    )


@pytest.fixture(scope="session")
def tiny_trace(tiny_spec, tmp_path_factory):
    from autoscale.envs import record_trace

    path = tmp_path_factory.mktemp("trace") / "tiny.npz"
    record_trace(tiny_spec, 16, path)
    return path
