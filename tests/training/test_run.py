"""TrainingRun: the instrumented step, snapshots, data, models and their errors."""

import dataclasses
import logging
import math

import pytest
import torch

from autoscale.errors import ConfigError
from autoscale.scalers import make_scaler
from autoscale.training import TrainingRun, WorkloadSpec
from autoscale.training.data import EVAL_FRACTION, byte_tokens, load_text
from autoscale.training.models import build_model


def same(a, b):
    """Records equal field by field (NaN equal to NaN), wall time aside."""
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    da.pop("wall_s"), db.pop("wall_s")
    return repr(da) == repr(db)


def test_step_record_fields():
    run = TrainingRun(WorkloadSpec(model="mlp", lr=2e-3), "torch")
    rec = run.step()
    assert rec.step == 0 and run.step_index == 1 and run.records == [rec]
    assert rec.scale == 65536.0 and not rec.found_inf and not rec.loss_nonfinite
    assert 1.0 < rec.loss < 4.0 and rec.lr == 2e-3 and rec.wall_s > 0
    assert rec.stats is run.scaler.last_stats and rec.stats.scale == rec.scale
    assert 0 < rec.grad_rms < rec.grad_amax < 10 and rec.precision_loss == 0.0
    assert run.scaler.collect_stats is True
    assert run.step().step == 1


def test_grad_accum_averages_micro_batches():
    run = TrainingRun(WorkloadSpec(model="mlp", grad_accum=3), "torch")
    rec = run.step()
    assert run.data.cursor == 3
    # the scaler saw each micro-batch loss divided by grad_accum
    assert rec.stats.loss == pytest.approx(rec.loss / 3, rel=1e-6)


def test_same_seed_same_run_and_training_lowers_loss():
    a = TrainingRun(WorkloadSpec(model="mlp"), "torch")
    b = TrainingRun(WorkloadSpec(model="mlp"), "torch")
    start = a.eval_loss()
    card = a.run(60)
    assert all(same(x, y) for x, y in zip(a.records, b.run(60) and b.records))
    assert card.eval_loss < 0.5 * start and not card.diverged and card.steps == 60


def test_snapshot_restore_is_bit_identical():
    """gpt2-tiny in fp16 with dropout, skips (bad batches) and growth: all state must come back."""
    spec = WorkloadSpec(scenario="bad-batches", scenario_params={"every": 3})
    run = TrainingRun(spec, "torch", growth_interval=2)
    run.run(3)
    snap = run.snapshot()
    first = [run.step() for _ in range(4)]
    params = [p.detach().clone() for p in run.model.parameters()]
    scale, state = run.scaler.get_scale(), run.scaler.state_dict()
    assert [r.found_inf for r in first] == [False, False, True, False]
    assert [r.scale for r in first] == [
        65536.0,
        65536.0,
        131072.0,
        65536.0,
    ]  # grew after 2 clean steps
    for _ in range(2):  # a snapshot can be restored again and again
        run.restore(snap)
        assert len(run.records) == 3 and run.step_index == 3
        again = [run.step() for _ in range(4)]
        assert all(same(x, y) for x, y in zip(first, again))
        assert all(torch.equal(p, q) for p, q in zip(params, run.model.parameters()))
        assert run.scaler.get_scale() == scale and run.scaler.state_dict() == state
        assert len(run.records) == 7


def test_eval_loss_is_fixed_and_draws_no_random_numbers():
    a = TrainingRun(WorkloadSpec(model="mlp"), "torch")
    b = TrainingRun(WorkloadSpec(model="mlp"), "torch")
    assert a.eval_loss() == a.eval_loss()
    assert same(a.step(), b.step())
    a.eval_loss()
    assert same(a.step(), b.step())


def test_text_split_is_disjoint(tmp_path):
    text = "".join(chr(65 + i % 26) for i in range(5000))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    run = TrainingRun(WorkloadSpec(data=str(path), seq_len=16, eval_batches=2), "torch")
    data = run.data
    n_eval = int(5000 * EVAL_FRACTION)
    assert torch.equal(data.eval_tokens, byte_tokens(text)[-n_eval:])
    assert torch.equal(data.train_tokens, byte_tokens(text)[:-n_eval])
    assert len(data.eval_batches()) == 2 and data.eval_batches()[0].shape == (4, 17)
    assert data.next_batch().shape == (4, 17) and data.cursor == 1
    assert math.isfinite(run.step().loss)


def test_data_folder_and_default_text(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta " * 50)
    (tmp_path / ".hidden").write_text("gamma")
    assert load_text(str(tmp_path)) == "alpha " * 50 + "\n\n" + "beta " * 50
    default = load_text(None)
    assert len(default) > 400_000 and 'The "for" statement' in default


@pytest.mark.parametrize(
    "data,match",
    [
        ("/nonexistent/corpus.txt", "data path '/nonexistent/corpus.txt' does not exist"),
        ("TINY", "has 11 tokens; seq_len 64 needs"),
    ],
)
def test_bad_data(tmp_path, data, match):
    if data == "TINY":
        data = str(tmp_path / "tiny.txt")
        (tmp_path / "tiny.txt").write_text("hello world")
    with pytest.raises(ConfigError, match=match):
        TrainingRun(WorkloadSpec(data=data), "torch")


def test_unreadable_data(tmp_path):
    import socket

    path = tmp_path / "corpus.sock"  # exists, but reading it fails even for root
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(ConfigError, match=f"cannot read data '{path}'"):
            TrainingRun(WorkloadSpec(data=str(path)), "torch")


def test_scaler_instance_and_overrides():
    scaler = make_scaler("torch", device="cpu", init_scale=2.0**10)
    assert scaler.collect_stats is False
    run = TrainingRun(WorkloadSpec(model="mlp"), scaler)
    assert run.scaler is scaler and scaler.collect_stats is True
    assert run.step().scale == 1024.0 and math.isfinite(run.records[0].grad_amax)
    with pytest.raises(ConfigError, match="apply only to a scaler given by name"):
        TrainingRun(WorkloadSpec(model="mlp"), scaler, init_scale=4.0)
    with pytest.raises(ConfigError, match="takes no parameter 'growth'"):
        TrainingRun(WorkloadSpec(model="mlp"), "torch", growth=2.0)


def test_run_arguments_and_callback():
    run = TrainingRun(WorkloadSpec(model="mlp"), "torch")
    with pytest.raises(ConfigError, match="steps must be a positive integer, got 0"):
        run.run(0)
    seen = []
    card = run.run(10, callback=lambda r: seen.append(r.step) or (False if r.step == 3 else None))
    assert seen == [0, 1, 2, 3] and card.steps == 4


def test_non_finite_parameters_mean_diverged():
    run = TrainingRun(WorkloadSpec(model="mlp"), "torch")
    run.run(2)
    with torch.no_grad():
        next(run.model.parameters())[0, 0] = math.nan
    assert not run.params_finite()
    assert run.scorecard().diverged


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda():
    with pytest.raises(ConfigError, match="CUDA is not available here; use --device cpu"):
        TrainingRun(WorkloadSpec(model="mlp", device="cuda"), "torch")


def test_local_model_folder(tmp_path, caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=1,
            n_embd=32,
            n_head=2,
            vocab_size=300,
            n_positions=128,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    model.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="autoscale"):
        run = TrainingRun(WorkloadSpec(model=str(tmp_path), seq_len=32), "torch")
    assert run.built.init == "pretrained" and run.built.vocab_size == 300
    assert torch.equal(
        run.model.transformer.h[0].mlp.c_fc.weight, model.transformer.h[0].mlp.c_fc.weight
    )
    assert "has no local tokenizer; feeding it UTF-8 bytes" in caplog.text
    assert math.isfinite(run.step().loss)
    random_init = build_model(WorkloadSpec(model=str(tmp_path), init="random"))
    assert random_init.init == "random"
    assert not torch.equal(
        random_init.model.transformer.h[0].mlp.c_fc.weight, model.transformer.h[0].mlp.c_fc.weight
    )
    with pytest.raises(ConfigError, match="exceeds model .*128 positions"):
        build_model(WorkloadSpec(model=str(tmp_path), seq_len=200))


def test_hub_model_without_local_files():
    with pytest.raises(
        ConfigError,
        match="model 'someorg/no-such-model': no weights on this machine.*--init random",
    ):
        TrainingRun(WorkloadSpec(model="someorg/no-such-model"), "torch")
    with pytest.raises(
        ConfigError, match="model 'someorg/no-such-model': no config on this machine"
    ):
        build_model(WorkloadSpec(model="someorg/no-such-model", init="random"))


@pytest.mark.slow  # a subprocess or a 124M model: seconds
def test_presets_init_rules(caplog):
    with pytest.raises(
        ConfigError, match="'gpt2-tiny' has no pretrained weights; use --init random"
    ):
        build_model(WorkloadSpec(init="pretrained"))
    with pytest.raises(ConfigError, match="'mlp' has no pretrained weights"):
        build_model(WorkloadSpec(model="mlp", init="pretrained"))
    from autoscale.training import models

    models._WARNED_RANDOM.discard("gpt2")
    built = build_model(WorkloadSpec(model="gpt2", init="auto"))
    if built.init == "pretrained":
        pytest.skip("GPT-2 weights are cached on this machine")
    assert (
        "no local weights for 'gpt2'" in caplog.text
        and "training it from random init" in caplog.text
    )
    caplog.clear()
    build_model(WorkloadSpec(model="gpt2", init="auto"))
    assert "no local weights" not in caplog.text  # once per process: a search builds many runs
    assert built.config["num_parameters"] == 124_439_808 and built.vocab_size == 50257
    with pytest.raises(ConfigError, match="no pretrained weights on this machine"):
        build_model(WorkloadSpec(model="gpt2", init="pretrained"))
