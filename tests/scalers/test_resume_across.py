"""Resume across scalers: a state saved by any scaler (a plain GradScaler, ShardedGradScaler,
every autoscale rule and policy) loads into every autoscale scaler. Observing a run with
``autoscale wrap --`` and resuming it with ``--scaler auto`` is this."""

from __future__ import annotations

import io
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from autoscale.errors import ConfigError
from autoscale.scalers.checkpoint import load_as_gradscaler

from .helpers import SCALERS, adamw, batches, make, run, tiny_model

SOURCES = ["gradscaler", "sharded", *SCALERS]


def _saved(source: str, tmp: Path) -> dict:
    """A state saved after 6 steps (one overflowed), through torch.save / weights_only load."""
    if source == "gradscaler":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    elif source == "sharded":
        scaler = ShardedGradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    else:
        scaler = make(source, init_scale=2.0**12)
    model = tiny_model()
    if source == "sharded":  # it agrees found-inf across ranks: a group of one
        dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
        try:
            run(model, adamw(model), scaler, batches(6), [2])
        finally:
            dist.destroy_process_group()
    else:
        run(model, adamw(model), scaler, batches(6), [2])
    buffer = io.BytesIO()
    torch.save(scaler.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("pg")
    return {source: _saved(source, tmp) for source in SOURCES}


@pytest.mark.parametrize("target", list(SCALERS))
def test_every_state_loads_into_every_scaler(saved, target):
    for source, state in saved.items():
        fresh = make(target)
        before = fresh.rule.state()
        saved_by = state.get("autoscale", {}).get("rule", "torch")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fresh.load_state_dict(state)
        messages = [str(w.message) for w in caught]
        expected = fresh.controller.bounds.clamp(state["scale"])
        assert fresh.get_scale() == expected, (source, target)
        if saved_by == fresh.name:
            assert not any("starts fresh" in m for m in messages), (source, target, messages)
            continue
        # the scale carries over, the rule's memory is a fresh rule's, one line says so
        assert len(messages) == 1, (source, target, messages)
        assert "starts fresh" in messages[0] and f"into '{fresh.name}'" in messages[0]
        assert f"its scale {state['scale']:g} carries over" in messages[0]
        after = fresh.rule.state()
        if "base" in after:  # the scale set from outside, which a guarded rule continues from
            assert after.pop("base") in (None, expected) and "base" in before
            before.pop("base")
        assert after == before, (source, target)
        if "autoscale" in state:  # the scaler's own counters (steps, skips) carry over
            assert fresh.steps == state["autoscale"]["steps"] == 6
        # and it trains on from there
        model = tiny_model()
        trace = run(model, adamw(model), fresh, batches(3), [1])
        assert trace.scales[0] == expected and trace.skipped == [1]


def test_a_gradscaler_state_into_torch_keeps_the_tracker_silently(saved):
    ours = make("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours.load_state_dict(saved["sharded"])
    assert ours.rule.state() == {"growth_tracker": saved["sharded"]["_growth_tracker"]}


def test_a_corrupt_autoscale_entry_loads_as_gradscalers_only_inside_a_wrapped_program(saved):
    state = {**saved["auto"], "autoscale": {**saved["auto"]["autoscale"], "version": 99}}
    with pytest.raises(ConfigError, match="format 99.*upgrade autoscale"):
        make("auto").load_state_dict(state)
    load_as_gradscaler(True)
    try:
        fresh = make("auto")
        with pytest.warns(UserWarning) as seen:
            fresh.load_state_dict(state)
    finally:
        load_as_gradscaler(False)
    text = " | ".join(str(w.message) for w in seen)
    assert "format 99" in text and "loaded as a GradScaler's state" in text
    assert "starts fresh" in text and fresh.get_scale() == state["scale"]


@pytest.mark.parametrize(
    ("bad", "continues"), [(0.0, "minimum"), (math.inf, "maximum"), (math.nan, "2^16")]
)
def test_a_dead_runs_scale_raises_outside_a_wrap_and_continues_inside_one(saved, bad, continues):
    """GradScaler loads a scale of 0, inf or NaN (its run is dead); outside a wrap autoscale says
    the checkpoint is corrupt, inside one it must not raise: the nearest usable scale."""
    state = {**saved["auto"], "scale": bad}
    with pytest.raises(ConfigError, match="not a positive finite number"):
        make("auto").load_state_dict(state)
    load_as_gradscaler(True)
    try:
        fresh = make("auto")
        with pytest.warns(UserWarning, match="not a positive finite number.*continuing from"):
            fresh.load_state_dict(state)
    finally:
        load_as_gradscaler(False)
    bounds = fresh.controller.bounds
    want = {"minimum": bounds.min_scale, "maximum": bounds.max_scale, "2^16": 2.0**16}[continues]
    assert fresh.get_scale() == want and math.isfinite(fresh.get_scale())
