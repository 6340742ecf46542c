"""``autoscale compare`` end to end."""

import json

import pytest

from autoscale.cli import main
from autoscale.training.fp16 import native_fp16_matmul

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # about a second or more
def test_compare_mlp_with_bf16_reference(tmp_path, capsys):
    out, png = tmp_path / "cmp.json", tmp_path / "cmp.png"
    rc = main(
        ["compare", "--scalers", "torch,deepspeed,amax-history", "--model", "mlp", "--scenario", "moving",
         "--steps", "30", "--seeds", "2", "--bf16-reference", "--json", str(out), "--plot", str(png), "--quiet"]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "30 steps of mlp / moving / fp16 (native); mean ± std over 2 seed(s)" in text
    rows = [line.split()[0] for line in text.splitlines()[3:]]
    assert rows == ["torch", "deepspeed", "amax-history", "bf16"]
    d = json.loads(out.read_text())
    assert d["seeds"] == [0, 1] and d["steps"] == 30
    assert list(d["rules"]) == ["torch", "deepspeed", "amax-history", "bf16 (no scaling)"]
    torch_rule = d["rules"]["torch"]
    assert len(torch_rule["scorecards"]) == 2 and set(torch_rule["summary"]["skip_rate"]) == {
        "mean",
        "std",
        "min",
        "max",
    }
    assert torch_rule["summary"]["skip_rate"]["mean"] > 0.1  # the spike overflows the torch rule
    bf16 = d["rules"]["bf16 (no scaling)"]["summary"]
    assert bf16["skip_rate"]["mean"] == 0.0 and bf16["max_scale"]["max"] == 1.0
    assert png.read_bytes()[:8] == PNG


@pytest.mark.slow  # about a second or more
def test_compare_gpt2_tiny(capsys):
    assert (
        main(
            [
                "compare",
                "--scalers",
                "torch,static",
                "--steps",
                "4",
                "--seeds",
                "1",
                "--seq-len",
                "32",
                "--quiet",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    path = "native" if native_fp16_matmul() else "emulated"  # auto's choice for gpt2-tiny
    assert f"4 steps of gpt2-tiny / clean / fp16 ({path}); mean ± std over 1 seed(s)" in text
    assert "\nstatic " in text and "2^7" in text  # the static rule's default scale, 128
