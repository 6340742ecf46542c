"""Distributed agreement (docs/design.md 3.5): every rank takes the same decision.

Two CPU processes on gloo, deliberately *without* DDP so that gradients differ per rank: only rank
1's loss is made infinite, yet both ranks must skip the step and keep equal scales; the gradient
amax a rule reads is the maximum over the ranks.
"""

from __future__ import annotations

import gc
import json
import math
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autoscale
from tests.scalers.helpers import adamw, batches, flat_params, forward_loss, tiny_model

pytestmark = pytest.mark.slow  # spawns process groups (seconds each)
WORLD = 2
INF_STEP = 1  # only rank 1 overflows, at this step
STEPS = 3


def _scenario(
    rank: int,
    name: str,
    fused: bool,
    unscale: bool = True,
    spike: int | None = None,
    spike_rank: int | None = None,
    settings: dict | None = None,
) -> dict:
    model = tiny_model()  # same weights on both ranks
    opt = adamw(model, fused=fused)
    scaler = autoscale.get_scaler(name, device="cpu", init_scale=2.0**8, **(settings or {}))
    data = batches(STEPS, seed=10 + rank)  # different data per rank
    out = {"skipped": [], "scales": [], "local_amax": [], "amax": [], "step_scales": [],
           "guarded": [], "used": []}  # fmt: skip
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = forward_loss(model, x, y, inf=rank == 1 and i == INF_STEP) * (1 + 9 * rank)
        if i == spike and spike_rank in (None, rank):  # a loss 2^12 times the usual: a
            # guarding rule lowers this step's scale
            loss = loss * 2.0**12
        scaled = scaler.scale(loss)
        # the scale this rank's backward ran at (None where the loss is not finite)
        out["used"].append(scaled.item() / loss.item() if math.isfinite(loss.item()) else None)
        scaled.backward()
        if unscale:  # else a fused optimizer unscales inside its kernel
            scaler.unscale_(opt)
        out["local_amax"].append(max(p.grad.abs().max().item() for p in model.parameters()))
        before = flat_params(model)
        scaler.step(opt)
        scaler.update()
        if torch.equal(before, flat_params(model)):
            out["skipped"].append(i)
        out["scales"].append(scaler.get_scale())
        out["amax"].append(scaler.last_stats.grad_amax)
        out["step_scales"].append(scaler.last_stats.scale)
        out["guarded"].append(scaler.last_stats.guarded)
    out["found_inf"] = scaler.skipped
    return out


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {
            f"{name}-{'fused' if fused else 'adamw'}": _scenario(rank, name, fused)
            for name in ("torch", "amax-history")
            for fused in (False, True)
        }
        # a fused step without unscale_ checks for infs inside GradScaler.step instead
        results["torch-fused-in-step"] = _scenario(rank, "torch", fused=True, unscale=False)
        for fused in (False, True):  # each rank's loss differs: they agree on one step scale
            results[f"amax-loss-{'fused' if fused else 'adamw'}"] = _scenario(
                rank, "amax-loss", fused, spike=STEPS - 1
            )
            # a policy that picks each step's scale from its loss: the ranks pick alike
            results[f"now-{'fused' if fused else 'adamw'}"] = _scenario(
                rank, FIXTURE_NOW, fused, spike=STEPS - 1, spike_rank=1
            )
            # a guard that skips spikes: rank 1's spike skips the step on both ranks
            results[f"spike-{'fused' if fused else 'adamw'}"] = _scenario(
                rank, "amax-loss", fused, spike=STEPS - 1, spike_rank=1,
                settings={"spike_bits": 8.0},
            )  # fmt: skip
    except Exception:
        results = {"error": traceback.format_exc()}
    # written before the process group goes away, so that a failure is reported with its cause
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    try:
        mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    except mp.ProcessExitedException:
        if not all((tmp / f"rank{r}.json").exists() for r in range(WORLD)):
            raise
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    return results


CASES = pytest.mark.parametrize(
    "case",
    [
        "torch-adamw",
        "torch-fused",
        "torch-fused-in-step",
        "amax-history-adamw",
        "amax-history-fused",
    ],
)


@CASES
def test_all_ranks_skip_when_one_rank_overflows(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r1["skipped"] == [INF_STEP]
    assert r0["skipped"] == [INF_STEP], "rank 0 stepped although rank 1 overflowed"
    assert r0["found_inf"] == r1["found_inf"] == 1


@CASES
def test_scales_stay_equal(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["scales"] == r1["scales"]
    assert r0["scales"][INF_STEP] < r0["scales"][0]  # both backed off


@pytest.mark.parametrize("case", ["amax-loss-adamw", "amax-loss-fused"])
def test_a_guarded_steps_scale_is_agreed(ranks, case):
    """Each rank's loss differs (rank 1's is 10x); the step whose loss spikes is guarded, at the
    same scale on both ranks (the larger loss decides), and both ranks step together."""
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["guarded"][-1] and r1["guarded"][-1]
    assert r0["step_scales"] == r1["step_scales"] and r0["scales"] == r1["scales"]
    assert r0["step_scales"][-1] < r0["scales"][-2]  # below the scale the rule had set
    for a, b in zip(r0["used"], r1["used"], strict=True):  # each rank's backward, alike
        assert a is None or b is None or a == pytest.approx(b, rel=1e-6)
    assert r0["skipped"] == r1["skipped"] == [INF_STEP]  # rank 1's inf loss: both skip


@pytest.mark.parametrize("case", ["spike-adamw", "spike-fused"])
def test_a_spike_on_one_rank_is_skipped_on_every_rank(ranks, case):
    """The ranks agree on the largest |loss| before the spike test (as the guard does): rank
    1's loss 2^12 times its usual skips the step on both ranks, the fused kernel's too, and
    neither rank moves its scale for it."""
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["skipped"] == r1["skipped"] == [INF_STEP, STEPS - 1]
    assert r0["scales"] == r1["scales"] and r0["scales"][-1] == r0["scales"][-2]


@pytest.mark.parametrize("case", ["now-adamw", "now-fused"])
def test_a_scale_time_policy_picks_one_scale_on_every_rank(ranks, case):
    """Each rank's loss differs (rank 1's is 10x, and only rank 1's spikes at the last step): a
    policy acting at scale time decides from the largest, so that the ranks take every step at
    the same scale and skip together."""
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["step_scales"] == r1["step_scales"] and r0["scales"] == r1["scales"]
    for a, b in zip(r0["used"], r1["used"], strict=True):  # each rank's backward, alike
        assert a is None or b is None or a == pytest.approx(b, rel=1e-6)
    assert r0["skipped"] == r1["skipped"] and INF_STEP in r0["skipped"]
    assert len(set(r0["step_scales"])) > 1  # it did pick: not one scale throughout


@pytest.mark.parametrize("case", ["amax-history-adamw", "amax-history-fused"])
def test_amax_is_the_max_over_ranks(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    for step in range(STEPS):
        if step == INF_STEP:
            # rank 1's NaN amax wins the reduction on both ranks (a MAX alone would drop NaN)
            assert math.isnan(r1["local_amax"][step]) or math.isinf(r1["local_amax"][step])
            assert r0["amax"][step] == r1["amax"][step] == math.inf
            continue
        expected = max(r0["local_amax"][step], r1["local_amax"][step])
        assert r0["local_amax"][step] != r1["local_amax"][step]
        assert r0["amax"][step] == r1["amax"][step] == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------- collectives, groups, two optimizers
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter")


class _Counter:
    """Counts the collectives torch.distributed runs (wrapping the module's functions)."""

    def __init__(self) -> None:
        self.n = 0
        self.saved = {}
        for name in COLLECTIVES:
            fn = getattr(dist, name)
            self.saved[name] = fn

            def wrapped(*a, _fn=fn, **k):
                self.n += 1
                return _fn(*a, **k)

            setattr(dist, name, wrapped)

    def restore(self) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _count_per_step(rank: int, name: str, fused: bool, ddp: bool, **kw) -> list[int]:
    """Collectives of the scaler in each of 4 steps (the model's own DDP traffic excluded)."""
    model = tiny_model()
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = adamw(model, fused=fused)
    scaler = autoscale.get_scaler(name, device="cpu", init_scale=2.0**8, **kw)
    counts = []
    for i, (x, y) in enumerate(batches(4, seed=20 + rank)):
        opt.zero_grad()
        loss = forward_loss(model, x, y, inf=rank == 1 and i == 2)
        scaler.scale(loss).backward()  # DDP's all_reduce of the gradients happens here
        counter = _Counter()
        try:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        finally:
            counter.restore()
        counts.append(counter.n)
    return counts


def _spike_collectives(rank: int) -> list[list[int]]:
    """Collectives of ``scale()`` and of the rest of each of 5 steps of a rule with a guard and
    a spike test."""
    model = tiny_model()
    opt = adamw(model)
    scaler = autoscale.get_scaler("amax-loss", device="cpu", init_scale=2.0**8, spike_bits=8)
    counts = []
    for x, y in batches(5, seed=40 + rank):
        opt.zero_grad()
        loss = forward_loss(model, x, y)
        counter = _Counter()
        try:
            scaled = scaler.scale(loss)
        finally:
            counter.restore()
        scaled.backward()
        rest = _Counter()
        try:
            scaler.step(opt)
            scaler.update()
        finally:
            rest.restore()
        counts.append([counter.n, rest.n])
    return counts


def _two_optimizers(rank: int) -> dict:
    """Two models, two optimizers, two losses in one step (losses scaled before either step)."""
    a, b = tiny_model(1), tiny_model(2)
    oa, ob = adamw(a), adamw(b)
    scaler = autoscale.get_scaler("torch", device="cpu", init_scale=2.0**8)
    (x, y), (x2, y2) = batches(2, seed=30 + rank)
    la, lb = forward_loss(a, x, y), forward_loss(b, x2, y2)
    scaler.scale(la).backward()
    scaler.step(oa)  # the first optimizer's step happens before the second loss is scaled
    scaler.scale(lb).backward()
    scaler.step(ob)
    scaler.update()
    return {"losses": [la.item(), lb.item()], "stats_loss": scaler.last_stats.loss}


def _worker2(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out: dict = {}
    try:
        for name in ("torch", "amax-history", FIXTURE_NEURAL):
            for fused in (False, True):
                key = f"{name.rsplit('/', 1)[-1]}-{'fused' if fused else 'adamw'}"
                out[f"sharded:{key}"] = _count_per_step(rank, name, fused, ddp=False)
                out[f"ddp:{key}"] = _count_per_step(
                    rank, name, fused, ddp=True, identical_grads=True
                )
        out["two-optimizers"] = _two_optimizers(rank)
        out["guard+spike"] = _spike_collectives(rank)
        # ranks that disagree on identical_grads get one clear error each, not a hang
        try:
            _count_per_step(rank, "torch", False, ddp=False, identical_grads=rank == 0)
            out["mismatch"] = "no error"
        except autoscale.AutoscaleError as exc:
            out["mismatch"] = str(exc)
    except Exception:
        out = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    gc.collect()  # DDP's reducers hold the group: gone before it (tests/integrations/fsdp_helpers)
    dist.destroy_process_group()


FIXTURE_NEURAL = str(Path(__file__).resolve().parent / "fixtures" / "policies" / "fixture-neural")
FIXTURE_NOW = FIXTURE_NEURAL + "-now"  # acting at scale time


def _spawn(worker, world: int, tmp: Path) -> list[dict]:
    try:
        mp.spawn(worker, args=(str(tmp / "init"), str(tmp)), nprocs=world, join=True)
    except mp.ProcessExitedException:
        if not all((tmp / f"rank{r}.json").exists() for r in range(world)):
            raise
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    return results


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    return _spawn(_worker2, WORLD, tmp_path_factory.mktemp("dist2"))


@pytest.mark.parametrize("rule", ["torch", "amax-history", "fixture-neural"])
@pytest.mark.parametrize("fused", ["adamw", "fused"])
def test_at_most_one_collective_per_step_with_sharded_gradients(counted, rule, fused):
    for r in counted:
        first, *rest = r[f"sharded:{rule}-{fused}"]
        assert first == 2  # the one-time handshake of the ranks, then the step's agreement
        assert rest == [1, 1, 1]


@pytest.mark.parametrize("fused", ["adamw", "fused"])
def test_no_collective_when_ddp_made_the_gradients_identical(counted, fused):
    for r in counted:
        for rule in ("torch", "amax-history"):
            first, *rest = r[f"ddp:{rule}-{fused}"]
            assert first == 1 and rest == [0, 0, 0]  # only the handshake
        # a neural policy reads the loss, which each rank computes on its own batch
        assert r[f"ddp:fixture-neural-{fused}"][1:] == [1, 1, 1]


def test_the_spike_test_costs_no_collective_of_its_own(counted):
    """Under torch.distributed the spike test reads the ranks' losses from the step's one
    agreement: scale() makes the guard's one all_reduce of the loss (none before the first
    clean step, when the guard has no limit yet), the step its one all_gather (the first with
    the ranks' one-time handshake)."""
    for r in counted:
        assert r["guard+spike"] == [[0, 2], [1, 1], [1, 1], [1, 1], [1, 1]]


def test_the_second_optimizers_loss_is_not_dropped(counted):
    losses = [v for r in counted for v in r["two-optimizers"]["losses"]]
    expected = sum(losses) / len(losses)  # both losses of both ranks
    for r in counted:
        assert r["two-optimizers"]["stats_loss"] == pytest.approx(expected, rel=1e-6)


def test_ranks_that_disagree_get_one_clear_error_not_a_hang(counted):
    for r in counted:
        assert "disagree on identical_grads" in r["mismatch"], r["mismatch"]


def _worker4(rank: int, init_file: str, out_dir: str) -> None:
    """Four ranks in two groups: {0, 1} and {2, 3}; rank 1 overflows at step 1."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out: dict = {}
    try:
        group = groups[rank // 2]
        model = tiny_model()
        opt = adamw(model)
        scaler = autoscale.get_scaler("torch", device="cpu", init_scale=2.0**8, process_group=group)
        scales, skipped = [], []
        for i, (x, y) in enumerate(batches(3, seed=40 + rank)):
            opt.zero_grad()
            scaler.scale(forward_loss(model, x, y, inf=rank == 1 and i == 1)).backward()
            before = flat_params(model)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            if torch.equal(before, flat_params(model)):
                skipped.append(i)
        out = {"scales": scales, "skipped": skipped}
    except Exception:
        out = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    gc.collect()  # DDP's reducers hold the group: gone before it (tests/integrations/fsdp_helpers)
    dist.destroy_process_group()


def test_a_subgroup_agrees_within_itself_only(tmp_path):
    r = _spawn(_worker4, 4, tmp_path)
    assert r[0]["skipped"] == r[1]["skipped"] == [1]  # rank 1's overflow skips its group
    assert r[2]["skipped"] == r[3]["skipped"] == []  # the other group trains on
    assert r[0]["scales"] == r[1]["scales"] and r[2]["scales"] == r[3]["scales"]
    assert r[0]["scales"] != r[2]["scales"]


def test_a_bad_process_group_is_refused_at_once():
    with pytest.raises(autoscale.AutoscaleError, match="process_group must be a torch.distributed"):
        autoscale.get_scaler("torch", device="cpu", process_group="world")
    scaler = autoscale.get_scaler("torch", device="cpu", process_group=None)
    assert scaler.identical_grads is False
