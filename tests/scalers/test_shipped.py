"""The policies shipped in policies/.

Each loads with torch alone, its manifest is intact (checksum and feature version of a neural
one), it trains a plain fp16 loop, and it passes the no-harm check on a short clean run. The
general policy ``auto`` (written by experiments/build_auto.py) also carries the evidence it
shipped on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import autoscale
from autoscale.scalers.policies import find_policy, read_manifest, sha256_file

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.name for p in (ROOT / "policies").iterdir() if (p / "policy.yaml").is_file())
HEAVY = ("stable_baselines3", "gymnasium", "optuna", "sb3_contrib")

LOOP = textwrap.dedent(
    """
    import json, sys
    import torch
    import autoscale

    torch.manual_seed(0)
    scaler = autoscale.get_scaler(NAME, device="cpu")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    losses, scales = [], []
    for step in range(40):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if step == 20:
            loss = loss * float("inf")  # one bad batch
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
    print(json.dumps({
        "heavy": heavy, "steps": scaler.steps, "skipped": scaler.skipped, "scales": scales,
        "first": losses[0], "last": losses[-1], "rule": type(scaler.rule).__name__,
    }))
    """
)


@pytest.mark.parametrize("name", SHIPPED)
def test_manifest_is_intact(name):
    from autoscale.scalers.features import FEATURE_VERSION

    folder = find_policy(name)
    assert folder is not None and folder.resolve() == (ROOT / "policies" / name).resolve()
    m = read_manifest(folder)
    assert m.name == name
    if m.kind == "neural":
        assert m.weights_sha256 == sha256_file(folder / "weights.pt")
        assert m.feature_version == FEATURE_VERSION
    else:
        assert m.weights_sha256 is None and m.feature_version is None


@pytest.mark.slow  # a Python subprocess that imports torch
@pytest.mark.parametrize("name", SHIPPED)
def test_plain_loop_with_torch_alone(name):
    code = f"NAME = {name!r}\nHEAVY = {HEAVY!r}\n{LOOP}"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["heavy"] == []
    assert r["steps"] == 40 and 1 <= r["skipped"] <= 3  # the bad batch is skipped, little else
    assert all(s > 0 and s == s and s != float("inf") for s in r["scales"])
    assert r["last"] < r["first"]  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_passes_the_no_harm_check_on_a_short_clean_run(name, tmp_path):
    from autoscale.envs.suite import load_spec
    from autoscale.search.budget import Ledger
    from autoscale.search.no_harm import NoHarmCheck, no_harm_workloads
    from autoscale.search.timing import NoHarmPlan

    torch.set_num_threads(1)
    member = load_spec("suite").members[0]
    mlp = [w for w in no_harm_workloads([member], 300) if w.model == "mlp"]
    check = NoHarmCheck(NoHarmPlan(tuple(mlp), 300), tmp_path, Ledger(), {})
    verdict = check.check(lambda: autoscale.get_scaler(name, device="cpu"), name)
    assert verdict.passed, verdict.summary()
    run = verdict.runs["mlp"]["candidate"][0]
    assert run["steps"] == 300


def test_auto_records_its_suite_objective_and_evidence():
    from autoscale.envs.suite import load_spec
    from autoscale.search.objective import OBJECTIVE_DOC

    m = read_manifest(ROOT / "policies" / "auto")
    suite = load_spec("suite")
    members = [x.name for x in suite.members]
    # the members left out of training when it was built (a later split may have added some)
    left = m.workload["left_out"]
    assert m.workload["suite"] == suite.name
    assert m.workload["members"] == members and set(left) <= {x.name for x in suite.left_out}
    assert m.workload["built_by"].startswith("experiments/build_auto.py")
    card = m.scorecard
    assert card["objective"] == OBJECTIVE_DOC
    # it shipped because it met the bar on fresh seeds of every member it was chosen on (train
    # and validation; every member before the split had test members) and did no harm
    chosen_on = members + (m.workload["validation"] if "test" in m.workload else left)
    assert sorted(card["evidence"]["bar_met_on"]) == sorted(chosen_on)
    assert card["evidence"]["bar_missed_on"] == []
    assert card["no_harm"]["passed"] is True
    assert card["long_runs"]["steps"] >= 1000
    assert sorted(card["long_runs"]["members"]) == sorted(members + left)
    # better than torch on the fresh seeds, searched and left-out members alike
    assert card["evidence"]["objective_searched"] < 0 and card["evidence"]["objective_left_out"] < 0
    # what loads is what the manifest says
    scaler = autoscale.get_scaler("auto", device="cpu")
    assert scaler.rule.name == m.family
    for key, value in m.parameters.items():
        if hasattr(scaler.rule, key):
            assert getattr(scaler.rule, key) == value


def _spike_runs(names=("torch", "auto")):
    """Each scaler through the loss times 1000 every 15 steps, SGD lr 0.01 (the run of
    experiments/spike_harm.py; a name may carry rule settings: ``auto:spike_bits=8``)."""
    import importlib.util

    path = ROOT / "experiments" / "spike_harm.py"
    spec = importlib.util.spec_from_file_location("spike_harm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [module.run(name, "sgd", 0.01, 1e3, 90, 15) for name in names]


def test_torch_drops_finite_loss_spikes_by_their_overflow_and_trains():
    torch_run, _ = _spike_runs()
    assert torch_run["skipped"] == 6 and torch_run["longest"] == 1
    assert torch_run["held_out"] < 1.2


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="auto takes a finite loss spike that GradScaler's overflow drops (its guard lowers "
    "that step's scale from the loss); with plain SGD the updates diverge the MLP's run, every "
    "later step skipped (experiments/results/spike_harm.md); a threshold on the loss's jump "
    "over the 16 before it (4 to 16 bits) skips the preference members' large steps too, "
    "above torch's skip rate (experiments/results/spike_jump.md); against 256 losses no "
    "preference step jumps 6 bits (spike_jump_memory256.md): amax-loss's spike_bits skips them "
    "so (the test below); a build judged auto with it and ranked it just behind auto on the "
    "validation members (experiments/results/auto_spike_bits.md), so auto does not set it: the "
    "remedy is clipping or spike_bits=8",
)
def test_auto_does_no_more_harm_than_torch_through_finite_loss_spikes():
    torch_run, auto_run = _spike_runs()
    assert auto_run["longest"] <= 1  # no run of skipped steps after a spike
    assert auto_run["held_out"] <= 1.05 * torch_run["held_out"]


def test_auto_that_skips_loss_spikes_does_no_more_harm_than_torch_through_them():
    """auto with its guard skipping spikes (spike_bits 8, the candidate the next build judges):
    the spikes torch's overflow drops are dropped, and nothing else; the run trains as torch's."""
    torch_run, skipping = _spike_runs(("torch", "auto:spike_bits=8"))
    assert skipping["skipped"] == torch_run["skipped"] == 6 and skipping["longest"] == 1
    assert skipping["held_out"] <= 1.05 * torch_run["held_out"]
    assert skipping["scale"] > torch_run["scale"]  # a spike moved neither scale nor cap
