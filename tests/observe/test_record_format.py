"""The record's format on disk: strict JSON (version 2), version-1 records still read, and a
folder claimed by one writer only."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

import autoscale
from autoscale.envs.from_records import trace_from_record
from autoscale.errors import ConfigError
from autoscale.observe import read_record
from autoscale.observe import record as record_module
from autoscale.observe.record import RECORD_VERSION, RecordWriter
from tests.observe.helpers import fp16_loop

V1 = Path(__file__).parent / "fixtures" / "record-v1"


def _strict(text: str):
    """json.loads that refuses NaN/Infinity literals, as jq and JavaScript's JSON.parse do."""

    def refuse(name):
        raise ValueError(f"non-JSON literal {name}")

    return json.loads(text, parse_constant=refuse)


def test_record_lines_are_strict_json_and_read_back_as_floats(tmp_path):
    scaler = autoscale.get_scaler("torch", device="cpu", record=str(tmp_path / "r"))
    fp16_loop(scaler, 12, bad={4})
    scaler.observers[0].close()
    lines = (tmp_path / "r" / "steps-000000.jsonl").read_text().splitlines()
    rows = [_strict(line) for line in lines]  # every line parses without NaN literals
    _strict((tmp_path / "r" / "meta.json").read_text())
    assert rows[4]["loss"] == "NaN" and rows[4]["amax"] == "NaN" and rows[4]["loss_nonfinite"]
    assert rows[1]["rms"] == "NaN"  # no histogram on step 1: the RMS is not computed there
    record = read_record(tmp_path / "r")
    assert record.meta["version"] == RECORD_VERSION == 2
    step = record.steps[4]
    assert math.isnan(step["loss"]) and math.isnan(step["amax"]) and step["found_inf"]
    assert isinstance(record.steps[0]["rms"], float) and math.isfinite(record.steps[0]["rms"])


def test_a_version_1_record_with_nan_literals_still_reads(tmp_path):
    assert "NaN" in (V1 / "steps-000000.jsonl").read_text()  # as version 1 wrote them
    record = read_record(V1)
    assert record.meta["version"] == 1 and record.notes == []
    assert [s["step"] for s in record.steps] == list(range(12))
    assert math.isnan(record.steps[4]["loss"]) and record.steps[4]["found_inf"]
    assert record.steps[5]["scale"] == 2.0**15
    trace = trace_from_record(record)  # and the replay reads it
    assert len(trace.instances) == 1
    copy = tmp_path / "v1"
    shutil.copytree(V1, copy)
    (copy / "meta.json").write_text(
        json.dumps({**json.loads((V1 / "meta.json").read_text()), "version": 3})
    )
    with pytest.raises(ConfigError, match="format version 3, this autoscale reads version 1 or 2"):
        read_record(copy)


def test_two_writers_of_one_folder_one_claims_it(tmp_path, monkeypatch):
    # both checked the folder before either wrote (the race of two processes given one folder)
    monkeypatch.setattr(record_module, "check_writable", lambda path: path.mkdir(exist_ok=True))
    first = RecordWriter(tmp_path / "r", {"who": "first"})
    with pytest.raises(ConfigError, match="holds a record already"):
        RecordWriter(tmp_path / "r", {"who": "second"})
    first.write_chunk(0, [{"step": 0}])
    assert json.loads((tmp_path / "r" / "meta.json").read_text())["who"] == "first"
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [
        "meta.json",
        "steps-000000.jsonl",
    ]


def _damaged(tmp_path, line_number: int, text: str, chunk: int = 1) -> Path:
    """A finished 12-step record in two chunks of 6, line ``line_number`` (1-based) of chunk
    ``chunk`` replaced by ``text``."""
    scaler = autoscale.get_scaler("torch", device="cpu", record=str(tmp_path / "whole"))
    fp16_loop(scaler, 12)
    scaler.observers[0].close()
    lines = (tmp_path / "whole" / "steps-000000.jsonl").read_text().splitlines()
    folder = tmp_path / "damaged"
    folder.mkdir()
    shutil.copy(tmp_path / "whole" / "meta.json", folder / "meta.json")
    assert read_record(tmp_path / "whole").meta["finished"]
    for i, first in enumerate((0, 6)):
        rows = lines[first : first + 6]
        if i == chunk:
            rows[line_number - 1] = text
        (folder / f"steps-{first:06d}.jsonl").write_text("\n".join(rows) + "\n")
    return folder


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"step": 10, "scale": "abc", "found_inf": false}', "'scale' is 'abc', not a number"),
        ("garbage{", "not JSON"),
        ('{"step": 10, "scale": 1024.0, "found_inf": "maybe"}', "'found_inf' is 'maybe'"),
        ("[1, 2]", "not a mapping"),
    ],
    ids=["word-for-number", "garbage", "word-for-switch", "list"],
)
def test_a_step_that_does_not_read_ends_the_record_there_and_keeps_the_steps_before(
    tmp_path, text, why
):
    record = read_record(_damaged(tmp_path, 5, text))
    assert [s["step"] for s in record.steps] == list(range(10))  # chunk 0 and 4 lines of chunk 1
    assert record.damaged is not None and record.notes == [record.damaged]
    assert "step 10 (line 5 of steps-000006.jsonl) does not read" in record.damaged
    assert why in record.damaged
    trace = trace_from_record(record)  # the replay reads what stands
    assert len(next(iter(trace.instances.values())).scale) == 10


def test_a_record_whose_first_step_does_not_read_says_so_not_to_wait(tmp_path):
    folder = _damaged(tmp_path, 1, "garbage{", chunk=0)
    with pytest.raises(ConfigError) as err:
        trace_from_record(folder)
    text = str(err.value)
    assert "has no step that reads: step 0 (line 1 of steps-000000.jsonl)" in text
    assert text.endswith("record the run again") and "go on longer" not in text
