"""``autoscale report``: the page, its replay and findings on real recorded steps, in Chromium."""

from __future__ import annotations

import html
import math
import re
import shutil
import subprocess

import numpy as np
import pytest

import autoscale
from autoscale.cli import main
from autoscale.observe import read_record
from autoscale.report import RecordReplay, findings, write_report
from tests.observe.helpers import fp16_loop


def _record(
    path,
    steps: int,
    bad_every: int | None = None,
    weight: float = 1.0,
    lr_decay=False,
    scaler: str = "torch",
    spikes: dict[int, float] | None = None,
):
    """A real fp16 loop under the torch rule (or ``scaler``), recorded (histogram every step)."""
    knobs = {"growth_interval": 20} if scaler == "torch" else {}
    scaler = autoscale.get_scaler(scaler, device="cpu", init_scale=2.0**16, **knobs)
    watch = autoscale.observe.watch_scaler(scaler, record=str(path), hist_every=1)
    # the schedule steps on skipped steps too: what a finding is about
    fp16_loop(scaler, steps, bad_every=bad_every, weight=weight, lr_decay=lr_decay, spikes=spikes)
    watch.close()
    return read_record(path)


def test_replay_of_the_recorded_rule_reproduces_the_record(tmp_path):
    record = _record(tmp_path / "r", 60, bad_every=7)
    replay = RecordReplay(record)
    recorded, again = replay.recorded(), replay.replay("torch")
    # the torch rule replayed from the same start takes the same scales and skips the same steps
    # (replay follows the recorded thresholds; every skip here is a non-finite loss)
    np.testing.assert_array_equal(again.scales, recorded.scales)
    np.testing.assert_array_equal(again.skipped, recorded.skipped)
    assert recorded.skip_rate == pytest.approx(8 / 60)
    auto = replay.replay("auto")
    assert auto.skip_rate == pytest.approx(8 / 60)  # a non-finite loss fails at any scale
    assert auto.scales.min() > recorded.scales.min()  # the guard does not ratchet down
    # a policy acting at scale time replays too, deciding each step from the recorded loss:
    # the same scales as the policy hosted in a scaler fed the same steps
    from pathlib import Path

    from autoscale.scalers.controller import StepStats

    now = str(Path(__file__).parents[1] / "scalers/fixtures/policies/fixture-neural-now")
    out = replay.replay(now)
    scaler = autoscale.get_scaler(now, device="cpu", init_scale=float(replay.inst.start_scale))
    rule, ctrl, t = scaler.rule, scaler.controller, replay.inst
    scale = scaler.get_scale()
    for i in range(t.steps):
        used = rule.step_scale(scale, float(t.loss[i]), ctrl.bounds)
        assert out.scales[i] == used, i
        over = bool(t.nonfinite[i]) or np.log2(used) > t.threshold[i]
        amax = np.inf if over else float(t.amax[i])
        rms = np.inf if over else float(t.rms[i])
        scale = ctrl.step(StepStats(i, used, over, amax, rms, float(t.loss[i]), True))
    assert len(set(out.scales.tolist())) > 1


def test_findings_name_what_the_record_shows(tmp_path):
    record = _record(tmp_path / "r", 80, bad_every=5, weight=2.0**-16, lr_decay=True)
    replay = RecordReplay(record)
    recorded = replay.recorded()
    outcomes = {name: replay.replay(name) for name in ("torch", "auto")}
    titles = [f.title for f in findings(replay, recorded, outcomes)]
    assert titles[0] == "Non-finite losses: no loss scale fixes these"
    assert "Gradients lost to underflow" in titles  # 2^-16 loss weight, scale ratcheted to ~2^0
    assert "The learning-rate schedule counted skipped steps" in titles
    assert recorded.precision_loss > outcomes["auto"].precision_loss

    clean = _record(tmp_path / "c", 30)
    replay = RecordReplay(clean)
    found = findings(replay, replay.recorded(), {"torch": replay.replay("torch")})
    assert [f.title for f in found] == ["Nothing to fix in this run"]


def test_loss_spikes_the_scaler_dropped_and_auto_would_take_are_said_before_auto_is_advised(
    tmp_path,
):
    """GradScaler's overflow drops a finite loss spike; auto takes it at a lower scale, which
    can diverge an unclipped SGD run (experiments/results/spike_harm.md): the report says so
    before any advice to switch, and names the steps."""
    # every 15 steps, as in spike_harm.py: a dropped spike does not hide the next one
    spiky = {14: 1000.0, 29: 1000.0, 44: 10000.0}
    record = _record(tmp_path / "s", 70, spikes=spiky)
    replay = RecordReplay(record)
    recorded = replay.recorded()
    outcomes = {name: replay.replay(name) for name in ("torch", "auto")}
    assert recorded.skipped[list(spiky)].all()  # torch's overflow dropped each spike
    assert not outcomes["auto"].skipped[list(spiky)].any()  # auto's guard takes each one
    # auto whose guard skips spikes (spike_bits) drops each one, and only those beyond torch's
    skipping = replay.replay("auto", spike_bits=8.0)
    assert skipping.skipped[list(spiky)].all()
    assert set(np.flatnonzero(skipping.skipped)) <= set(np.flatnonzero(recorded.skipped))
    assert skipping.scales[-1] == outcomes["auto"].scales[-1]  # nor moved its scale
    found = findings(replay, recorded, outcomes)
    assert [f.title for f in found] == [
        "Loss spikes: this scaler dropped them, auto would take them"
    ]
    assert "3 of the 3 skipped steps (steps 14, 29, 44)" in found[0].detail
    assert "auto takes 3 of them" in found[0].detail
    assert "clip_grad_norm_" in found[0].advice
    assert 'get_scaler("auto", spike_bits=8) skips 3 of these 3 in the replay' in found[0].advice
    # with bad batches and underflow too: every advice to use auto comes after it, pointing to it
    mixed = _record(
        tmp_path / "m", 70, bad_every=7, weight=2.0**-16, spikes={16: 2.0**20, 38: 2.0**20}
    )
    replay = RecordReplay(mixed)
    outcomes = {name: replay.replay(name) for name in ("torch", "auto")}
    found = findings(replay, replay.recorded(), outcomes)
    assert [f.title for f in found] == [
        "Non-finite losses: no loss scale fixes these",
        "Loss spikes: this scaler dropped them, auto would take them",
        "Gradients lost to underflow",
    ]
    assert "(steps 16)" in found[1].detail  # (at step 38 the ratcheted scale took the spike)
    for f in (found[0], found[2]):
        assert f.advice.endswith(
            "--scaler auto -- <your command> (with the gradients clipped: the loss spikes above)."
        )
    # a page of other scalers (--scalers without auto) still warns: auto is replayed for it
    alone = findings(replay, replay.recorded(), {"torch": outcomes["torch"]})
    assert [f.title for f in alone] == [f.title for f in found]
    # the same run without spikes: the advice to use auto as it was, no spike finding
    plain = _record(tmp_path / "u", 70, bad_every=7, weight=2.0**-16)
    replay = RecordReplay(plain)
    found = findings(replay, replay.recorded(), {"torch": replay.replay("torch")})
    assert [f.title for f in found] == [
        "Non-finite losses: no loss scale fixes these",
        "Gradients lost to underflow",
    ]
    assert all(f.advice.endswith("--scaler auto -- <your command>.") for f in found)


def test_a_loss_jump_is_measured_against_the_largest_of_the_remembered_losses():
    from autoscale.report.findings import SPIKE_MEMORY, loss_jumps

    losses = [1.0] * 20 + [math.inf, 0.0, math.nan, 1024.0, -1.0] + [2.0**-20] * 16 + [1.0]
    jumps = loss_jumps(np.array(losses), memory=16)
    assert np.isnan(jumps[0])  # none before it
    assert np.isnan(jumps[20:23]).all()  # inf, 0 and NaN: no jump, and not remembered
    assert jumps[19] == 0.0 and jumps[23] == 10.0 and jumps[24] == -10.0  # |loss|: -1 is 1
    # 16 tiny losses push 1024 out of a memory of 16: 1.0 is 20 bits above the largest left
    assert jumps[-1] == 20.0
    # 1024 exactly 16 remembered steps back still counts (a memory of 15 would say 20)
    assert loss_jumps(np.array([1024.0, 1.0] + [2.0**-20] * 15 + [1.0]), memory=16)[-1] == 0.0
    # the report's memory is long: a loss that collapsed for a while is measured against what
    # it was before (a preference loss's pair ranked wrong is no spike)
    assert SPIKE_MEMORY == 256 and loss_jumps(np.array(losses))[-1] == -10.0
    # a step left out of the memory (a dropped spike) does not hide the next one
    spiky = np.array([1.0] * 5 + [1024.0] + [1.0] * 5 + [1024.0])
    assert loss_jumps(spiky)[-1] == 0.0
    assert loss_jumps(spiky, remembered=spiky < 2)[-1] == 10.0
    assert np.isnan(loss_jumps(np.array([]))).all()


def _findings_text(page: str) -> str:
    return " ".join(
        html.unescape(re.sub(r"<[^>]+>", " ", m))
        for m in re.findall(r"<div class='finding[^']*'>(.*?)</div></div>", page, re.S)
    )


@pytest.mark.parametrize("scaler", ["torch", "auto"])
def test_one_count_of_skipped_steps_in_the_report(tmp_path, scaler):
    # bad batches at steps 4, 9, ..., 39: 8 skipped steps, the last of them the record's last
    record = _record(tmp_path / "r", 40, bad_every=5, lr_decay=True, scaler=scaler)
    skipped = sum(s["found_inf"] for s in record.steps)
    assert skipped == 8 and record.steps[-1]["found_inf"]
    page = write_report(record, tmp_path / "page.html", names=["torch", "auto"]).read_text()
    own = re.search(r"<tr class='own'><td>[^<]*</td><td>40</td><td>(\d+)</td>", page)
    assert own and int(own.group(1)) == skipped
    text = _findings_text(page)
    counts = re.findall(r"(\d+) skipped steps", text)
    assert len(counts) == 2 and set(counts) == {str(skipped)}, text  # non-finite losses, lr
    assert f"All {skipped} skipped steps" in text and f"7 of the {skipped} skipped steps" in text
    assert "the last of them, step 39, ends the record" in text
    assert "after 0 of them" not in text and "7 of the 7" not in text
    if scaler == "torch":  # halves after each: said as a cost, and auto offered
        assert "Yet the scaler lowered its scale after every one of them" in text
        assert "--scaler auto" in text
    else:  # auto keeps its scale: said as right, and auto not offered again
        assert "The scaler kept its scale after each of them" in text and "which is right" in text
        assert "--scaler auto" not in text


def test_the_scale_chart_shows_every_line_it_draws(tmp_path):
    from autoscale.report.page import scale_axis_limits

    # under auto the recorded scale stays high; torch's replay halves on every bad batch
    record = _record(tmp_path / "r", 60, bad_every=5, scaler="auto")
    replay = RecordReplay(record)
    recorded = replay.recorded()
    shown = {"torch": replay.replay("torch"), "auto": replay.replay("auto")}
    assert shown["torch"].scales.min() < recorded.scales.min() / 16
    lo, hi = scale_axis_limits(replay, recorded, shown)
    for o in (recorded, *shown.values()):
        assert lo < np.log2(o.scales.min()) and np.log2(o.scales.max()) < hi


def test_report_command_writes_one_self_contained_page(tmp_path, capsys):
    _record(tmp_path / "r", 40, bad_every=9)
    assert main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "page.html")]) == 0
    html = (tmp_path / "page.html").read_text()
    assert html.count("data:image/png;base64,") == 3
    assert "http://" not in html and "https://" not in html  # nothing fetched
    for name in ("torch", "deepspeed", "amax-history", "auto"):
        assert f"<td>{name}</td>" in html
    assert "Replay of this run&#x27;s recorded steps" in html
    assert "wrote" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no record folder" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "r"), "--scalers", "torh"]) == 2
    assert "did you mean 'torch'" in capsys.readouterr().err
    # a destination it cannot write: one line before the replays, not a traceback after them
    for out, said in (("/proc/x.html", "cannot write the report to '/proc/x.html'"),
                      (str(tmp_path), "is a folder; give the HTML file")):  # fmt: skip
        assert main(["report", str(tmp_path / "r"), "--out", out]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)"
)
@pytest.mark.slow
def test_the_page_renders_in_headless_chromium_with_its_plots(tmp_path):
    record = _record(tmp_path / "r", 40, bad_every=9)
    page = write_report(record, tmp_path / "report.html", names=["torch", "auto"])
    shot = tmp_path / "shot.png"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--hide-scrollbars",
    ]
    dom = subprocess.run(
        [CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert "Loss scale against the gradients" not in dom.stdout  # titles are inside the images
    assert dom.stdout.count("<img") == 3 and "Findings" in dom.stdout
    subprocess.run(
        [CHROMIUM, *flags, "--window-size=1200,1600", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    from matplotlib.image import imread

    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (1600, 1200)
    # the scale plot is drawn: its overflow band (pink) and the black scale line are on screen
    pink = np.all(np.abs(pixels - np.array([0xF4, 0xCC, 0xCC]) / 255) < 0.02, axis=-1).sum()
    black = np.all(pixels < 0.1, axis=-1).sum()
    assert pink > 5000 and black > 2000, (pink, black)
