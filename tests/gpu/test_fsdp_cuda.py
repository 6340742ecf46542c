"""FSDP on CUDA: the checks of tests/integrations/test_fsdp.py with a GPU per rank (nccl; two
ranks where the machine has two GPUs, else one), CPU offloading included: the scale on the GPU,
FSDP1's and FSDP2's gradients on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integrations.fsdp_helpers import (
    BAD_BATCH,
    SHARD_INF,
    STEPS,
    assert_ranks_agree,
    assert_same_training,
    run_ranks,
)

WORLD = max(1, min(2, torch.cuda.device_count()))
NAMES = ["torch", "amax-history", "auto"]
SCRIPT = Path(__file__).resolve().parents[1] / "integrations" / "scripts" / "fsdp_run.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("fsdp-cuda"), WORLD, "cuda", NAMES)


CASES = [(kind, name) for kind in ("fsdp2", "fsdp1") for name in NAMES]
CASES += [("fsdp2-offload", "torch"), ("fsdp2-offload", "auto")]  # gradients on the CPU


@pytest.mark.parametrize("kind, name", CASES)
def test_scalers_train_fsdp_on_cuda_and_the_ranks_agree(ranks, kind, name):
    assert_ranks_agree([r[f"{kind}-{name}"] for r in ranks], whole_rms=kind.startswith("fsdp2"))


def test_fsdp1_float16_loss_and_gradients_under_auto_on_cuda(ranks):
    runs = [r["fsdp1-fp16-auto"] for r in ranks]
    for run in runs:
        assert {BAD_BATCH, SHARD_INF} <= set(run["skipped"]) and len(run["skipped"]) < STEPS
        assert run["skipped"] == runs[0]["skipped"] and run["scales"] == runs[0]["scales"]


@pytest.mark.parametrize("tag", ["", "-fp16", "-offload"])
def test_the_torch_rule_is_sharded_grad_scaler_bit_for_bit_on_cuda(ranks, tag):
    for r in ranks:
        assert_same_training(r[f"torch-as-sharded{tag}"], r[f"sharded{tag}"])


@pytest.mark.parametrize("kind, cls", [("fsdp2", "LossScaler"), ("fsdp1", "ShardedLossScaler")])
def test_wrap_observes_fsdp_on_cuda_bit_for_bit_and_auto_takes_the_steps(tmp_path, kind, cls):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not next to this Python")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(WORLD), str(SCRIPT)]
    cmd += [kind, "plain", "8", "cuda"]
    wrap = [sys.executable, "-m", "autoscale", "wrap"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}

    def run(args):
        out = subprocess.run(
            args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out

    def tagged(out, tag):
        return sorted(line for line in out.stdout.splitlines() if line.split()[1:2] == [tag])

    plain, observed = run(cmd), run([*wrap, "--", *cmd])
    assert tagged(observed, "LOSS") == tagged(plain, "LOSS")
    ends = [line.split() for line in tagged(observed, "END")]
    theirs = [line.split() for line in tagged(plain, "END")]
    assert [e[:2] + e[3:] for e in ends] == [e[:2] + e[3:] for e in theirs]
    assert [e[2] for e in ends] == [cls] * WORLD and [e[4] for e in ends] == ["4,6"] * WORLD
    auto = run([*wrap, "--scaler", "auto", "--", *cmd])
    ends = [line.split() for line in tagged(auto, "END")]
    assert [e[2] for e in ends] == [cls] * WORLD and len({e[3] for e in ends}) == 1
    assert all({"4", "6"} <= set(e[4].split(",")) for e in ends)
