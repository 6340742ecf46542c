"""Bad input to run/compare/doctor: one clear line on stderr, exit status 2, no traceback."""

import os
import subprocess
import sys

import pytest

from autoscale.cli import main


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["run", "--model", "gpt2-tinny", "--steps", "5"],
            "unknown model 'gpt2-tinny'; did you mean 'gpt2-tiny'?",
        ),
        (
            ["run", "--scenario", "bad-batch"],
            "unknown scenario 'bad-batch'; did you mean 'bad-batches'?",
        ),
        (
            ["run", "--model", "someorg/no-such-model"],
            "model 'someorg/no-such-model': no weights on this machine",
        ),
        (
            ["run", "--model", "mlp", "--steps", "0"],
            "--steps must be a positive number of optimizer steps, got 0",
        ),
        (["run", "--data", "/no/such/file.txt"], "data path '/no/such/file.txt' does not exist"),
        (
            ["run", "--scenario", "bad-batches", "--param", "evry=3"],
            "has no parameter 'evry'; did you mean 'every'?",
        ),
        (["run", "--param", "every"], "--param expects KEY=VALUE, got 'every'"),
        (
            ["run", "--scaler", "torh", "--model", "mlp"],
            "unknown scaler 'torh'; did you mean 'torch'?",
        ),
        # a name that is no near miss gets no suggestion (it shared three letters with torch)
        (["run", "--scaler", "nosuch", "--model", "mlp"], "unknown scaler 'nosuch' (autoscale"),
        (
            ["run", "--model", "mlp", "--scenario", "pref"],
            "unknown scenario 'pref'; did you mean 'preference'?",
        ),  # a name cut short
        (["run", "--dtype", "fp8"], "dtype must be one of fp16, bf16, fp32"),
        (
            ["run", "--model", "mlp", "--fp16", "emulate"],
            "unknown fp16 path 'emulate'; did you mean 'emulated'?",
        ),
        (
            ["compare", "--model", "mlp", "--fp16", "nativ"],
            "unknown fp16 path 'nativ'; did you mean 'native'?",
        ),
        (
            [
                "record",
                "--env",
                "mlp-bad-batches",
                "--steps",
                "1",
                "--out",
                "x.npz",
                "--fp16",
                "fast",
            ],
            "unknown fp16 path 'fast'",
        ),
        (
            ["search", "--model", "mlp", "--budget", "1m", "--fp16", "emulatd"],
            "unknown fp16 path 'emulatd'; did you mean 'emulated'?",
        ),
        (
            ["run", "--model", "mlp", "--steps", "1", "--json", "/no/such/dir/out.json"],
            "--json /no/such/dir/out.json: folder /no/such/dir does not exist",
        ),
        (
            ["compare", "--scalers", "torch,deepspeeed", "--model", "mlp"],
            "unknown scaler 'deepspeeed'; did you mean 'deepspeed'?",
        ),
        (
            ["compare", "--model", "mlp", "--plot", "/no/dir/c.png"],
            "--plot /no/dir/c.png: folder /no/dir does not exist",
        ),
        (
            ["compare", "--model", "mlp", "--seeds", "0"],
            "--seeds must be a positive number of seeds, got 0",
        ),
        (
            ["compare", "--model", "mlp", "--steps", "-3"],
            "--steps must be a positive number of optimizer steps, got -3",
        ),
        (["doctor", "--steps", "0"], "--steps must be a positive number of steps, got 0"),
        (["doctor", "--model", "mlpp"], "unknown model 'mlpp'; did you mean 'mlp'?"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith(f"autoscale {argv[0]}: error: ")
    assert message in err


@pytest.mark.slow  # a subprocess or a 124M model: seconds
def test_bad_input_in_a_real_process():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "autoscale.cli", "run", "--model", "gpt2-tinny", "--steps", "5"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "autoscale run: error: unknown model 'gpt2-tinny'; did you mean 'gpt2-tiny'? (autoscale run --help shows all: "
        "autoencoder, gpt2, gpt2-medium, gpt2-tiny, mlp); a Hugging Face model id or local model folder also works when its files "
        "are on this machine"
    ]


@pytest.mark.slow  # a subprocess or a 124M model: seconds
def test_a_reader_that_leaves_ends_the_command_quietly():
    """``autoscale list --json | head -1``: the pipe closes under the writer; no traceback."""
    import os
    import subprocess
    import sys

    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written: every write fails with EPIPE
    try:
        out = subprocess.run(
            [sys.executable, "-m", "autoscale.cli", "list", "--json"],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(w)
    assert out.returncode == 141 and "Traceback" not in out.stderr, out.stderr
