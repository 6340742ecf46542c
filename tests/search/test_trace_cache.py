"""Damaged files in the search's trace cache (a killed recording, a full disk, a bad copy): each
is told in one line and recorded again, giving the same trace as the first recording."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autoscale.envs.suite import as_suite
from autoscale.envs.traces import Trace
from autoscale.errors import ConfigError
from autoscale.search.plan import shape_suite
from autoscale.search.traces import instance_key, load_traces
from autoscale.search.workload import base_spec
from tests.search.faults import FaultRecord, report
from tests.training.conftest import torch  # noqa: F401  (one intra-op thread: deterministic steps)

STEPS = 16


def _cost(member, steps):
    return 0.01 * steps


def _truncate(keep):
    def damage(path):
        data = path.read_bytes()
        path.write_bytes(data[: keep(len(data))])

    return damage


def _flip_middle(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewrite(change):
    """Save a readable npz whose content ``change`` altered (another version, a missing or
    shortened array: a file written by something else under the same name)."""

    def damage(path):
        with np.load(path) as data:
            arrays = {k: data[k] for k in data.files}
        change(arrays)
        with open(path, "wb") as fh:
            np.savez_compressed(fh, **arrays)

    return damage


def _old_version(arrays):
    arrays["meta"] = np.array(str(arrays["meta"]).replace('"version": 2', '"version": 1'))


DAMAGE = {
    "truncated to half": _truncate(lambda n: n // 2),
    "truncated to its first 10 bytes": _truncate(lambda n: 10),
    "empty": _truncate(lambda n: 0),
    "64 bytes flipped in the middle": _flip_middle,
    "not a zip": lambda path: path.write_text("not a trace\n"),
    "of an older version": _rewrite(_old_version),
    "without its loss array": _rewrite(lambda a: a.pop("0.loss")),
    "with a shortened array": _rewrite(lambda a: a.update({"0.scale": a["0.scale"][:3]})),
    "with a corrupt meta": _rewrite(lambda a: a.update({"meta": np.array("{not json")})),
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The cached traces of an mlp suite of 2 train + 2 test instances (16 steps each)."""
    root = tmp_path_factory.mktemp("cache")
    suite = shape_suite(as_suite(base_spec(model="mlp")), STEPS, 2, 1)
    traces, stats = load_traces(suite, root, STEPS, cost=_cost, stop_at=math.inf)
    assert stats["recorded"] == 4
    return root, suite, traces


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_trace_is_said_and_recorded_again(recorded, how, request):
    root, suite, first = recorded
    member = suite.members[0]
    inst = member.instances["test"][0]
    path = root / "traces" / f"{instance_key(member, inst, STEPS)}.npz"
    DAMAGE[how](path)
    with pytest.raises(ConfigError, match=r"record it again$"):
        Trace.load(path)

    said: list[str] = []
    traces, stats = load_traces(suite, root, STEPS, cost=_cost, stop_at=math.inf, warn=said.append)

    assert (stats["recorded"], stats["cached"]) == (1, 3)
    assert len(said) == 1 and "\n" not in said[0]
    assert said[0].startswith("cached ") and str(path) in said[0]
    assert said[0].endswith("; recording it again")
    again = traces[member.name].instances[inst.name]
    before = first[member.name].instances[inst.name]
    for key in ("threshold", "nonfinite", "loss", "scale", "hist"):
        assert np.array_equal(getattr(again, key), getattr(before, key)), key
    assert Trace.load(path).instances  # the cache holds a whole trace again
    report(
        FaultRecord(
            request.node.name,
            f"cached trace {how}",
            "trace cache",
            outcome="warned in one line, recorded again: the same trace",
        )
    )


def test_recording_slower_than_planned_stops_and_says_how_much_slower(tmp_path):
    """Steps that run slower than the plan measured (other jobs on the cores) run the recording
    out of its share of the budget: one line saying how much slower, the recorded traces kept."""
    import time

    from autoscale.errors import BudgetError

    suite = shape_suite(as_suite(base_spec(model="mlp")), STEPS, 2, 1)
    planned = iter([1e-4] + [5.0] * 10)  # the first trace planned at 0.1 ms, the next ones 5 s

    with pytest.raises(BudgetError) as info:
        load_traces(
            suite, tmp_path, STEPS, cost=lambda m, n: next(planned), stop_at=time.monotonic() + 4
        )
    msg = str(info.value)
    assert msg.startswith("the budget ran out while recording traces (1 recorded, ")
    assert "x slower than measured at the start" in msg and "OMP_NUM_THREADS=1" in msg
    assert msg.endswith("rerun with a larger --budget and the same --study to continue")
    assert len(list((tmp_path / "traces").glob("*.npz"))) == 1  # kept for the rerun
