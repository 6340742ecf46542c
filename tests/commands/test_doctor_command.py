"""``autoscale doctor``."""

import json
import math

from autoscale.cli import main
from autoscale.commands.doctor import DtypeResult, recommend


def test_doctor_reports_and_recommends(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--steps", "2", "--seq-len", "32", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for heading in ("device:", "fp16:", "bf16:", "speed:", "advice:"):
        assert heading in text
    d = json.loads(out.read_text())
    assert set(d["results"]) == {"fp32", "bf16", "fp16"}
    for r in d["results"].values():
        assert r["error"] is None and r["step_ms"] > 0 and 4.0 < r["eval_loss"] < 7.0
    assert d["advice"][0].startswith(
        "use bf16 autocast"
    )  # CPU autocast has bf16; gpt2-tiny tolerates it


def test_recommendation_rules():
    info = {"bf16_ok": True, "fp16": "native"}
    r = lambda dt, ms, loss: DtypeResult(dt, step_ms=ms, eval_loss=loss)  # noqa: E731
    ok = recommend(
        info, {"fp32": r("fp32", 10, 5.0), "bf16": r("bf16", 5, 5.01), "fp16": r("fp16", 5, 5.0)}
    )
    assert len(ok) == 1 and ok[0].startswith("use bf16 autocast")
    drift = recommend(
        info, {"fp32": r("fp32", 10, 5.0), "bf16": r("bf16", 5, 5.5), "fp16": r("fp16", 5, 5.0)}
    )
    assert "moves this model's held-out loss by 10.0%" in drift[0] and "loss scaler" in drift[0]
    faster = recommend(
        info, {"fp32": r("fp32", 10, 5.0), "bf16": r("bf16", 10, 5.0), "fp16": r("fp16", 4, 5.0)}
    )
    assert "fp16 is 2.5x faster than bf16" in faster[1]
    none = recommend(
        {"bf16_ok": False, "fp16": "native"},
        {
            "fp32": r("fp32", 1, 5.0),
            "bf16": DtypeResult("bf16", error="x"),
            "fp16": r("fp16", 1, 5.0),
        },
    )
    assert none[0].startswith("no bf16 on this device")
    emulated = recommend(
        {"bf16_ok": True, "fp16": "emulated"},
        {"fp32": r("fp32", 10, 5.0), "bf16": r("bf16", 10, 5.0), "fp16": r("fp16", 40, math.nan)},
    )
    assert "fp16 is emulated on this device (4.0x the fp32 step time)" in emulated[-1]
    busy = recommend(
        {"bf16_ok": True, "fp16": "native", "busy": "load average 5.0 on 2 cores"},
        {"fp32": r("fp32", 1, 5.0), "bf16": r("bf16", 1, 5.0), "fp16": r("fp16", 1, 5.0)},
    )
    assert (
        "the CPU is busy (load average 5.0 on 2 cores)" in busy[1]
        and "OMP_NUM_THREADS=1" in busy[1]
    )
