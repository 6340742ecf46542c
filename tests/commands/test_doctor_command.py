"""``autoscale doctor``."""

import json
import math

from autoscale.cli import main
from autoscale.commands.doctor import DtypeResult, fp16_verdict, recommend
from autoscale.training.fp16 import native_fp16_matmul


def test_doctor_reports_and_recommends(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--steps", "2", "--seq-len", "32", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for heading in ("device:", "fp16:", "bf16:", "speed:", "fp16 path:", "advice:"):
        assert heading in text
    d = json.loads(out.read_text())
    # on a CPU both fp16 paths are timed, side by side
    assert set(d["results"]) == {"fp32", "bf16", "fp16-native", "fp16-emulated"}
    assert "fp16 native" in text and "fp16 emulated" in text
    for r in d["results"].values():
        assert r["error"] is None and r["step_ms"] > 0 and 4.0 < r["eval_loss"] < 7.0
    # gpt2-tiny's products (138M multiply-adds per micro-batch) are worth emulating without
    # fp16 matrix instructions; the line names the path, why, and the measured times
    path = d["fp16_path"]
    assert path["auto"] == ("native" if native_fp16_matmul() else "emulated")
    assert f"fp16 path: {path['auto']} (auto: " in text
    assert "measured: emulated " in path["verdict"][1] and "per step" in path["verdict"][1]
    assert d["advice"][0].startswith(
        "use bf16 autocast"
    )  # CPU autocast has bf16; gpt2-tiny tolerates it


def test_fp16_verdict_flags_a_faster_path_than_autos():
    r = lambda dt, ms: DtypeResult(dt, step_ms=ms, eval_loss=5.0)  # noqa: E731
    results = {"fp16-native": r("fp16-native", 10.0), "fp16-emulated": r("fp16-emulated", 40.0)}
    lines = fp16_verdict("emulated", "why", results)
    assert lines[0] == "emulated (auto: why)"
    assert "native is 4.00x faster" in lines[1]
    assert "pass --fp16 native" in lines[2]
    agree = fp16_verdict("native", "why", results)
    assert len(agree) == 2  # no hint when auto already takes the faster path
    assert fp16_verdict("native", "cuda", {"fp16-native": r("fp16-native", 1.0)}) == [
        "native (auto: cuda)"
    ]


def test_recommendation_rules():
    info = {"bf16_ok": True, "fp16_native": True}
    r = lambda dt, ms, loss: DtypeResult(dt, step_ms=ms, eval_loss=loss)  # noqa: E731
    fp16 = lambda ms: {"fp16-native": r("fp16-native", ms, 5.0)}  # noqa: E731
    ok = recommend(info, {"fp32": r("fp32", 10, 5.0), "bf16": r("bf16", 5, 5.01), **fp16(5)})
    assert len(ok) == 1 and ok[0].startswith("use bf16 autocast")
    drift = recommend(info, {"fp32": r("fp32", 10, 5.0), "bf16": r("bf16", 5, 5.5), **fp16(5)})
    assert "moves this model's held-out loss by 10.0%" in drift[0] and "loss scaler" in drift[0]
    faster = recommend(info, {"fp32": r("fp32", 10, 5.0), "bf16": r("bf16", 10, 5.0), **fp16(4)})
    assert "fp16 is 2.5x faster than bf16" in faster[1]
    none = recommend(
        {"bf16_ok": False, "fp16_native": True},
        {"fp32": r("fp32", 1, 5.0), "bf16": DtypeResult("bf16", error="x"), **fp16(1)},
    )
    assert none[0].startswith("no bf16 on this device")
    emulated = recommend(
        {"bf16_ok": True, "fp16_native": False},
        {
            "fp32": r("fp32", 10, 5.0),
            "bf16": r("bf16", 10, 5.0),
            "fp16-native": r("fp16-native", 90, 5.0),
            "fp16-emulated": r("fp16-emulated", 14, math.nan),
        },
        "emulated",
    )
    assert "an fp16 step takes 1.4x the fp32 step time (emulated path)" in emulated[-1]
    busy = recommend(
        {"bf16_ok": True, "fp16_native": True, "busy": "load average 5.0 on 2 cores"},
        {"fp32": r("fp32", 1, 5.0), "bf16": r("bf16", 1, 5.0), **fp16(1)},
    )
    assert (
        "the CPU is busy (load average 5.0 on 2 cores)" in busy[1]
        and "OMP_NUM_THREADS=1" in busy[1]
    )
