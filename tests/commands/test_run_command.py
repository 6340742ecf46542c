"""``autoscale run`` end to end."""

import json

from autoscale.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def test_run_mlp_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    rc = main(
        ["run", "--scaler", "torch", "--model", "mlp", "--scenario", "bad-batches", "--param", "every=4",
         "--steps", "20", "--json", str(out), "--plot", str(png), "--quiet", "--scaler-param", "growth_interval=100"]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    # mlp's products are too small for the emulation to pay: auto keeps torch's fp16 kernels
    assert "scorecard: torch on mlp / bad-batches(every=4) / fp16 (native) / seed 0" in text
    assert "skipped            5 (25.00%)" in text and "2^12 .. 2^16" in text
    d = json.loads(out.read_text())
    assert set(d) == {"spec", "fp16_path", "scaler", "model", "scorecard", "trajectory"}
    assert d["spec"]["fp16"] == "auto" and d["fp16_path"] == "native"
    assert d["spec"]["scenario_params"] == {"every": 4} and d["spec"]["model"] == "mlp"
    assert (
        d["scaler"]["name"] == "torch"
        and d["scaler"]["init_scale"] == 65536.0
        and d["scaler"]["growth_interval"] == 100
    )
    assert (
        d["scorecard"]["steps"] == 20
        and d["scorecard"]["skipped"] == 5
        and d["scorecard"]["min_scale"] == 4096.0
    )
    assert len(d["trajectory"]["scale"]) == 20 and d["trajectory"]["found_inf"][3] is True
    assert d["trajectory"]["loss"][3] is None  # inf written as null: strict JSON
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000


def test_run_gpt2_tiny(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["run", "--steps", "6", "--seq-len", "32", "--json", str(out), "--quiet"]
    assert main([*argv, "--fp16", "emulated"]) == 0
    d = json.loads(out.read_text())
    assert d["spec"]["model"] == "gpt2-tiny" and d["model"]["init"] == "random"
    assert d["spec"]["fp16"] == "emulated" and d["fp16_path"] == "emulated"
    assert d["scorecard"]["steps"] == 6 and 3.0 < d["scorecard"]["eval_loss"] < 6.0
    text = capsys.readouterr().out
    assert "eval loss" in text and "gpt2-tiny / clean / fp16 (emulated) / seed 0" in text
