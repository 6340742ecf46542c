"""Live logs of two scalers in one program, and W&B inside the program's own run."""

from __future__ import annotations

import csv

import pytest

import autoscale
from autoscale.observe import watch_scaler
from tests.observe.helpers import fp16_loop


def _rows(path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.read_text().splitlines()))


def test_a_second_scaler_never_truncates_the_first_ones_csv(tmp_path):
    log = f"csv:{tmp_path / 'log.csv'}"
    first = autoscale.get_scaler("torch", device="cpu", log=log)
    fp16_loop(first, 5, bad={1})
    first.observers[0].flush()
    second = autoscale.get_scaler("torch", device="cpu", log=log)  # same spec, same program
    tagged = autoscale.get_scaler("torch", device="cpu")
    watch = watch_scaler(tagged, log=log, log_tag="scaler2")
    fp16_loop(second, 3)
    fp16_loop(tagged, 2)
    for s in (first, second):
        s.observers[0].close()
    watch.close()
    assert [r["skipped"] for r in _rows(tmp_path / "log.csv")] == ["0", "1", "0", "0", "0"]
    assert len(_rows(tmp_path / "log.2.csv")) == 3
    assert len(_rows(tmp_path / "log.scaler2.csv")) == 2


def test_tensorboard_tags_of_a_second_scaler(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install 'autoscale[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scaler = autoscale.get_scaler("torch", device="cpu", init_scale=2.0**10)
    watch = watch_scaler(scaler, log=f"tensorboard:{tmp_path / 'tb'}", log_tag="scaler1")
    fp16_loop(scaler, 3)
    watch.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "autoscale/scale" not in acc.Tags()["scalars"]
    assert [e.value for e in acc.Scalars("autoscale/scaler1/scale")] == [2.0**10] * 3


@pytest.mark.slow  # importing wandb takes over a second
def test_wandb_never_moves_the_programs_own_step(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="W&B logging needs wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="autoscale-test")  # the program's own run
    try:
        scaler = autoscale.get_scaler("torch", device="cpu", log="wandb:ignored")
        watch = scaler.observers[0]

        def program_logs(step: int) -> None:  # the program logs its loss at its own step
            run.log({"loss": float(step)}, step=step)

        for step in range(6):
            fp16_loop(scaler, 1, bad={0} if step == 2 else None)
            watch.flush()  # a batch of rows reaches W&B between the program's steps
            program_logs(step)
        run.log({"loss": 6.0}, step=6)  # commits the program's step 5
        watch.close()
        # W&B's step is the program's: every log(step=...) of the program was kept
        assert run.step == 6 and run.summary["loss"] == 5.0
        assert run.summary["autoscale/skipped_total"] == 1
        assert run.summary["autoscale/step"] == 5  # autoscale's own axis: the scaler's step
    finally:
        run.finish()
    assert wandb.run is None
