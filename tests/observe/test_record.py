"""Recording any loop: the record format, chunks, a run killed mid-way, versions, live logs."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import autoscale
from autoscale.envs.from_records import trace_from_record
from autoscale.errors import AutoscaleError, ConfigError
from autoscale.observe import read_record, watch_scaler
from autoscale.observe.record import underflow_share
from tests.observe.helpers import fp16_loop


def _train(scaler, steps: int, bad: int | None = None, weight: float = 1.0) -> list[float]:
    return fp16_loop(scaler, steps, bad=None if bad is None else {bad}, weight=weight)


def test_get_scaler_records_every_step_in_chunks(tmp_path):
    scaler = autoscale.get_scaler("torch", device="cpu", record=str(tmp_path / "r"))
    watch = scaler.observers[0]
    watch.sinks[0].chunk_steps = 8  # small chunks: three files for 20 steps
    _train(scaler, 20, bad=4)
    watch.close()
    files = sorted(p.name for p in (tmp_path / "r").iterdir())
    assert files == ["meta.json", "steps-000000.jsonl", "steps-000008.jsonl", "steps-000016.jsonl"]
    record = read_record(tmp_path / "r")
    assert len(record.steps) == 20 and record.notes == []
    s = record.steps[4]
    assert (
        s["found_inf"] and s["loss_nonfinite"] and s["threshold"] == 15.0
    )  # scale 2^16, 1 bit below
    clean = record.steps[3]
    assert clean["threshold"] == pytest.approx(math.log2(65504 / clean["amax"]))
    assert record.meta["scaler"] == "torch" and record.meta["threshold"] == "estimated"


def test_the_observer_leaves_training_bit_identical(tmp_path):
    plain = _train(torch.amp.GradScaler("cpu"), 12, bad=3)
    watched = _train(
        autoscale.get_scaler("torch", device="cpu", record=str(tmp_path / "r")), 12, bad=3
    )
    assert [repr(v) for v in plain] == [repr(v) for v in watched]  # nan == nan by repr


def test_histogram_counts_every_element_and_underflow_share(tmp_path):
    scaler = autoscale.get_scaler("torch", device="cpu")
    watch = watch_scaler(scaler, record=str(tmp_path / "r"), hist_every=2)
    _train(scaler, 4)
    watch.close()
    steps = read_record(tmp_path / "r").steps
    assert [s["hist"] is not None for s in steps] == [True, False, True, False]
    n = 16 * 64 + 64 + 64 * 4 + 4  # every gradient element, less exact zeros (ReLU rows)
    assert 0.9 * n < sum(steps[0]["hist"]) <= n
    hist = steps[0]["hist"]
    assert underflow_share(hist, 2.0**40) == 0.0 and underflow_share(hist, 2.0**-40) == 1.0
    # mass spread in log2 inside a bin: half of a bin [2^-20, 2^-19) lies below 2^-19.5
    one = [0] * 80
    one[-20 + 64] = 4
    assert underflow_share(one, 2.0**5.5) == pytest.approx(0.5)


def test_measured_threshold_sees_the_backward(tmp_path):
    scaler = autoscale.get_scaler("torch", device="cpu")
    watch = watch_scaler(scaler, record=str(tmp_path / "r"), measure_threshold=True)
    _train(scaler, 3)
    watch.close()
    steps = read_record(tmp_path / "r").steps
    assert all(s["threshold_measured"] for s in steps)
    for s in steps:  # the backward's own fp16 tensors reach at least the weights' gradients
        assert s["threshold"] <= math.log2(65504 / s["amax"]) + 1e-6


KILLED = """
import sys, time, torch, autoscale
scaler = autoscale.get_scaler("torch", device="cpu", record=sys.argv[1])
scaler.observers[0].sinks[0].chunk_steps = 5
scaler.observers[0].flush_every = 5
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10_000):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(2, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if step == 12:
        print("READY", flush=True)
    if step > 12:
        time.sleep(0.01)
"""


@pytest.mark.slow
def test_a_killed_run_keeps_its_whole_chunks_and_the_report_says_so(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(tmp_path / "r")], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "READY"
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)  # no atexit, no flush
    proc.wait()
    record = read_record(tmp_path / "r")
    assert len(record.steps) >= 10 and len(record.steps) % 5 == 0
    assert [s["step"] for s in record.steps] == list(range(len(record.steps)))
    assert "did not finish" in record.notes[0]
    from autoscale.report import write_report

    html = write_report(record, tmp_path / "report.html", names=["torch"]).read_text()
    assert "Record cut short" in html and f"{len(record.steps)} steps recorded" in html


def test_bad_records_get_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match="no record folder"):
        read_record(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no meta.json"):
        read_record(tmp_path / "empty")
    scaler = autoscale.get_scaler("torch", device="cpu", record=str(tmp_path / "r"))
    _train(scaler, 2)
    scaler.observers[0].close()
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    (tmp_path / "r" / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(ConfigError, match="format version 99, this autoscale reads version 1"):
        read_record(tmp_path / "r")
    with pytest.raises(ConfigError, match="holds a record already"):
        autoscale.get_scaler("torch", device="cpu", record=str(tmp_path / "r"))


def test_a_record_is_a_trace_the_replay_reads(tmp_path):
    scaler = autoscale.get_scaler("torch", device="cpu", record=str(tmp_path / "r"))
    _train(scaler, 10, bad=2)
    scaler.observers[0].close()
    trace = trace_from_record(tmp_path / "r")
    inst = trace.instances["run"]
    assert inst.steps == 10 and bool(inst.nonfinite[2]) and not inst.nonfinite[3]
    assert inst.hist.shape == (10, 80) and (inst.hist.sum(axis=1) > 0).all()
    saved = trace.save(tmp_path / "t.npz")
    from autoscale.envs.traces import Trace

    assert Trace.load(saved).instances["run"].steps == 10


def test_live_csv_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install 'autoscale[tensorboard]'")
    scaler = autoscale.get_scaler(
        "torch",
        device="cpu",
        log=[f"csv:{tmp_path / 'log.csv'}", f"tensorboard:{tmp_path / 'tb'}"],
    )
    _train(scaler, 6, bad=1)
    scaler.observers[0].close()
    rows = list(csv.DictReader((tmp_path / "log.csv").read_text().splitlines()))
    assert [r["skipped"] for r in rows] == ["0", "1", "0", "0", "0", "0"]
    assert rows[-1]["skipped_total"] == "1" and float(rows[2]["scale"]) == 2.0**15
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    scales = [e.value for e in acc.Scalars("autoscale/scale")]
    assert scales == [2.0**16, 2.0**16] + [2.0**15] * 4
    assert [e.step for e in acc.Scalars("autoscale/underflow")] == [0]  # histogram steps only


@pytest.mark.slow
def test_live_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="W&B logging needs wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    scaler = autoscale.get_scaler("torch", device="cpu", log="wandb:autoscale-test")
    _train(scaler, 4, bad=2)
    sink = scaler.observers[0].sinks[0]
    scaler.observers[0].flush()
    summary = dict(sink.run.summary)
    scaler.observers[0].close()
    assert summary["autoscale/skipped_total"] == 1 and summary["autoscale/step"] == 3
    assert wandb.run is None  # the run it opened is finished


def test_bad_log_specs():
    with pytest.raises(AutoscaleError, match="did you mean 'csv'"):
        autoscale.get_scaler("torch", device="cpu", log="cvs:x")
    with pytest.raises(ConfigError, match="names no file; write it as csv:FILE"):
        autoscale.get_scaler("torch", device="cpu", log="csv:")
