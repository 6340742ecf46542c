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
    """Without ``shrink_to`` (every instance, whole, or nothing: experiments/build_auto.py),
    steps that run slower than planned stop the recording: one line saying how much slower, the
    recorded traces kept."""
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
    assert "x slower than measured at the start" in msg
    assert msg.endswith("rerun with a larger --budget and the same --study to continue")
    assert len(list((tmp_path / "traces").glob("*.npz"))) == 1  # kept for the rerun


def _bend(tmp_path, cost, stop_at, floor_at=None, shrink_to=4, slow=None):
    suite = shape_suite(as_suite(base_spec(model="mlp")), STEPS, 2, 1)
    traces, stats = load_traces(
        suite,
        tmp_path,
        STEPS,
        cost=cost,
        stop_at=stop_at,
        floor_at=floor_at,
        shrink_to=shrink_to,
        on_slow=slow,
    )
    (member,) = suite.members
    return member, traces[member.name], stats


def test_a_recording_that_bends_records_the_first_instances_first_and_leaves_out_the_rest(
    tmp_path,
):
    """With ``shrink_to``, each member's first train and test instance come first; an instance
    that does not fit after them is left out and named, not a BudgetError."""
    import time

    calls = []

    def cost(member, n):
        calls.append(n)
        return 0.01 if len(calls) <= 2 else 1e6  # the first two fit, nothing else would

    member, trace, stats = _bend(tmp_path, cost, stop_at=lambda pace: time.monotonic() + 60)
    first = {member.instances["train"][0].name, member.instances["test"][0].name}
    assert set(trace.instances) == first
    assert stats["recorded"] == 2 and stats["shortest"] == STEPS and stats["shortened"] == []
    assert sorted(stats["dropped"]) == sorted(
        f"{member.name}:{i.name}"
        for i in member.instances["train"][1:] + member.instances["test"][1:]
    )


def test_a_first_instance_that_does_not_fit_is_recorded_shorter_down_to_shrink_to(tmp_path):
    """A first instance whose whole trace does not fit its floor is recorded at half the steps,
    then a quarter, down to ``shrink_to``; below it, a BudgetError."""
    import time

    from autoscale.errors import BudgetError

    stop = time.monotonic() + 30
    # a trace of more than 8 steps never fits; 8 steps do
    member, trace, stats = _bend(
        tmp_path, lambda m, n: 0.001 if n <= 8 else 1e6, stop_at=stop, floor_at=stop
    )
    assert {t.steps for t in trace.instances.values()} == {8} and stats["shortest"] == 8
    assert len(trace.instances) == 2 and len(stats["dropped"]) == 2
    assert sorted(stats["shortened"]) == sorted(f"{member.name}:{i}" for i in trace.instances)
    with pytest.raises(BudgetError, match="the budget ran out while recording traces"):
        _bend(tmp_path / "b", lambda m, n: 0.001 if n <= 2 else 1e6, stop_at=stop, shrink_to=4)


def test_the_deadline_moves_with_the_pace_and_a_slow_recording_is_told(tmp_path):
    """``stop_at`` as a function gets the pace so far (recorded over planned seconds) and
    ``on_slow`` hears of a recording that ran over 1.3x its plan."""
    import time

    paces, slow = [], []

    def stop_at(pace):
        paces.append(pace)
        return time.monotonic() + 60

    _bend(tmp_path, lambda m, n: 1e-6, stop_at=stop_at, slow=slow.append)
    # asked before the first recording (to start it, and where to cut it), then at its pace
    assert paces[:2] == [1.0, 1.0] and all(p > 1.3 for p in paces[2:])  # steps outran 1 us
    assert len(slow) == 4 and all(p > 1.3 for p in slow)


def test_a_recording_past_its_deadline_is_cut_to_a_halving_of_its_length(tmp_path):
    """``record_trace(stop_at=...)``: once it has ``least`` steps, a recording past its deadline
    keeps the longest of steps, steps/2, steps/4... it reached, as if planned so."""
    import time

    from autoscale.envs.traces import record_trace

    suite = shape_suite(as_suite(base_spec(model="mlp")), STEPS, 1, 1)
    (member,) = suite.members
    name = member.instances["train"][0].name
    cut = record_trace(member, 64, instances=(name,), stop_at=time.monotonic(), least=8)
    assert cut.instances[name].steps == 8
    whole = record_trace(member, 8, instances=(name,))
    assert np.array_equal(cut.instances[name].threshold, whole.instances[name].threshold)
