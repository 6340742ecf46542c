"""``autoscale search --traces`` as a user runs it: records made by ``autoscale wrap --record`` of a
small script (tests/search/scripts/tiny_loss.py), searched in a subprocess, exported, interrupted
and resumed."""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.search.conftest import cli_env, run_cli, spawn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.paced,
]  # real `autoscale` subprocesses and searches, seconds to a minute each

SCRIPT = Path(__file__).resolve().parent / "scripts" / "tiny_loss.py"
# a loss weighted by 2^-14, a non-finite loss every 25th step (torch's rule halves its scale each
# time and never grows it back within the run), and gradients spread over 40 more bits (so that
# no scale keeps every element in fp16's range, and the hindsight limit leaves room above auto)
SPREAD = ("600", "25", "14", "0", "0", "40")
TIED = ("600", "25", "14")  # the same without the spread: every scale above 2^20 loses nothing


def wrap_record(folder: Path, *script_args: str) -> Path:
    """``autoscale wrap --record folder -- python tiny_loss.py ARGS``."""
    run = run_cli(
        "wrap", "--record", str(folder), "--", sys.executable, str(SCRIPT), *script_args,
        cwd=folder.parent,
    )  # fmt: skip
    assert run.rc == 0, run.err
    return folder


def home_env(home: Path) -> dict[str, str]:
    """A CLI run's environment whose exports given no folder go to ``home/policies``."""
    return {**cli_env(), "AUTOSCALE_HOME": str(home)}


def _study(root: Path, name: str = "run-traces"):
    import optuna

    return optuna.load_study(study_name=name, storage=f"sqlite:///{root / 'autoscale.db'}")


def _line(out: str, phase: str) -> str:
    return next(line for line in out.splitlines() if f" {phase}] " in line)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A 30-second search on one record that separates the rules, in a fresh folder."""
    root = tmp_path_factory.mktemp("records-search")
    home = tmp_path_factory.mktemp("records-home")
    wrap_record(root / "run", *SPREAD)
    run = run_cli(
        "search", "--traces", "run", "--budget", "30s", "--export", "mine",
        cwd=root, env=home_env(home), timeout=150,
    )  # fmt: skip
    assert run.rc == 0, run.err
    return root, home, run


def test_the_search_separates_the_rules_and_the_policy_describes_the_records(searched):
    root, home, run = searched
    out = run.out
    # its own phases, numbered without gaps (nothing is measured or recorded)
    phases = re.findall(r"^\[(\d)/(\d) (\w+)\]", out, re.M)
    order = ["plan", "search", "validate", "export"]
    names = [p[2] for p in phases]
    assert sorted(set(names), key=order.index) == order, out  # each phase said
    assert names == sorted(names, key=order.index), out  # in order
    assert all((n, total) == (str(order.index(p) + 1), "4") for n, total, p in phases), out
    assert "[2/4 search]" in out and "[3/4 validate]" in out and "[4/4 export]" in out
    # torch's rule loses: it halves its scale at every non-finite loss and never grows back
    validate = _line(out, "validate")
    scores = dict(re.findall(r"([\w-]+(?:, trial \d+)?) ([+-]\d+\.\d{4})", validate))
    assert float(scores["torch"]) == 0.0 and float(scores["auto"]) < -5.0, validate
    assert len(set(scores.values())) > 2, validate  # the rows are told apart
    assert "cannot separate a candidate from auto" not in out  # the search ran
    assert re.search(r"\[2/4 search\] \d{2,} trials", out), out
    # the best trial named is one the validation lists, or it says where its row went
    search = _line(out, "search")
    best = re.search(r"best: trial (\d+) \(([^)]*)\)", search)
    assert best, search
    assert f"trial {best.group(1)}" in validate or "validated as the rule" in best.group(2)
    # the policy describes the records it was searched on, not a made-up workload
    manifest = (home / "policies" / "mine" / "policy.yaml").read_text()
    import yaml

    workload = yaml.safe_load(manifest)["workload"]
    for made_up in ("scenario", "batch_size", "lr", "model", "seq_len"):
        assert made_up not in workload, workload
    (described,) = workload["records"]
    assert described["path"] == str((root / "run").resolve())
    assert described["steps"] == 600 and described["skipped"] == 24
    assert "tiny_loss.py 600 25 14" in described["command"]
    assert workload["note"].startswith("searched on the replay of 1 recorded run")
    # the workload search's pick, its verdicts kept in the study; the report beside the policy
    from autoscale.search.choose import VERDICT_PREFIX

    export = [line for line in out.splitlines() if line.startswith("[4/4 export]")][-1]
    attrs = _study(root).user_attrs
    verdicts = {k: v for k, v in attrs.items() if k.startswith(VERDICT_PREFIX)}
    assert verdicts and all(
        v["where"] == "on the replay of the whole records" for v in verdicts.values()
    )
    if "auto is the best found" in export:
        assert verdicts[VERDICT_PREFIX + "policy:auto"]["passed"]
    else:
        lead = re.search(
            r"beat auto by (\d\.\d+) on the objective, more than the seed noise", export
        )
        assert (
            lead
            and float(lead.group(1)) <= float(re.search(r"up to (\d\.\d+)", out).group(1)) + 1e-4
        )
    assert "on the replay of the whole records, on their clean steps: skipped" in export
    assert "mine" in (home / "policies" / "mine" / "report.html").read_text()
    assert attrs["validated_on"].startswith("validated on the replay of held-out windows")


def test_autoscale_export_exports_from_a_records_study(searched, tmp_path):
    """`autoscale export --study X --trial best` and `--trial N` on a study made by --traces."""
    root, home, run = searched
    env = home_env(home)
    best = run_cli("export", "--study", "run-traces", "--trial", "best", "--name", "again",
                   cwd=root, env=env)  # fmt: skip
    assert best.rc == 0, best.err
    assert "expected a mapping" not in best.err
    exported = re.search(r"exported \S+ \(([^;]*);", best.out)
    assert exported, best.out
    # the search's own pick: the same policy as its export
    import yaml

    mine = yaml.safe_load((home / "policies" / "mine" / "policy.yaml").read_text())
    again = yaml.safe_load((home / "policies" / "again" / "policy.yaml").read_text())
    assert (again["family"], again["parameters"]) == (mine["family"], mine["parameters"])
    assert again["scorecard"]["evaluated_on"].startswith("replay of 2 held-out windows")
    study = _study(root)
    number = next(
        t.number
        for t in study.trials
        if t.state.name == "COMPLETE" and not t.user_attrs.get("baseline")
    )
    by_number = run_cli("export", "--study", "run-traces", "--trial", str(number), "--name",
                        "by-number", cwd=root, env=env)  # fmt: skip
    assert by_number.rc == 0, by_number.err
    manifest = yaml.safe_load((home / "policies" / "by-number" / "policy.yaml").read_text())
    assert manifest["workload"]["trial"] == number
    assert manifest["workload"]["records"][0]["steps"] == 600


def test_the_export_target_is_checked_before_any_work(searched, tmp_path):
    """A folder of another policy under the export name: one line before the storage is
    touched, not after the budget is spent."""
    root, home, _ = searched
    (tmp_path / "policies" / "taken").mkdir(parents=True)
    (tmp_path / "policies" / "taken" / "policy.yaml").write_text(
        (home / "policies" / "mine" / "policy.yaml").read_text().replace("run-traces", "another")
    )
    run = run_cli(
        "search", "--traces", str(root / "run"), "--budget", "20s", "--export", "taken",
        "--policy-dir", "policies", cwd=tmp_path,
    )  # fmt: skip
    assert run.rc == 2, run.err
    assert run.err.strip().splitlines()[-1].startswith("autoscale search: error: ")
    assert "taken" in run.err.strip().splitlines()[-1]
    assert run.wall_s < 15, run.wall_s
    assert not (tmp_path / "autoscale.db").exists()


def test_records_that_cannot_separate_the_rules_stop_the_search_and_say_why(tmp_path):
    """Without the spread, every adaptive rule reaches what the held-out windows allow: past each
    window's first step (the scale the run had there) no element is lost below fp16's range, and
    only the non-finite losses are skipped. No candidate can lead auto there: the search says so
    and stops instead of spending its budget."""
    wrap_record(tmp_path / "run", *TIED)
    run = run_cli("search", "--traces", "run", "--budget", "30s", cwd=tmp_path)
    assert run.rc == 0, run.err
    out = run.out
    assert run.wall_s < 20, (run.wall_s, out)
    assert "cannot separate" in out
    assert "hindsight limit" in out
    assert "record a longer run" in out
    validate = _line(out, "validate")
    tied = re.search(r"tie at ([+-]\d+\.\d{4})", validate)
    assert tied and "auto" in validate.split("tie at")[0], validate
    assert float(tied.group(1)) < -5.0  # torch's rule still loses to them
    assert "auto is the best found" in out
    # no trial was spent on windows that cannot tell (the rules' defaults wait for a resume)
    assert {t.state.name for t in _study(tmp_path).trials} == {"WAITING"}
    assert "this run: 0 trials" in out.strip().splitlines()[-1]


def test_ctrl_c_keeps_the_trials_and_the_same_command_says_it_resumes(searched, tmp_path):
    """A SIGINT to a running records search: no traceback, the trials kept, none left running;
    the same command then says it resumes the study, with the trials it keeps."""
    root, _, _ = searched
    args = ("search", "--traces", str(root / "run"), "--budget", "40s")
    proc = spawn(*args, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            if (tmp_path / "autoscale.db").exists():
                try:
                    if len(_study(tmp_path).trials) >= 20:
                        break
                except Exception:
                    pass  # the study is being created
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    study = _study(tmp_path)
    states = [t.state.name for t in study.trials]
    assert "RUNNING" not in states
    held = sum(1 for s in states if s in ("COMPLETE", "PRUNED", "FAIL"))
    interrupted = err.strip().splitlines()[-1]
    assert interrupted.startswith("interrupted: ")
    assert f"kept in study 'run-traces' (it holds {held}); nothing was exported" in interrupted
    assert interrupted.endswith("the same command resumes it")
    again = run_cli(*args, "--n-trials", "5", cwd=tmp_path)
    assert again.rc == 0, again.err
    n = sum(1 for s in states if s == "COMPLETE")
    assert f"resuming study 'run-traces': {held} trials ({n} complete, " in again.out, again.out
    assert "this run's 40s budget" in again.out
    done = again.out.strip().splitlines()[-1]
    assert f"this run: 5 trials; the study holds {held + 5}" in done, done


def test_one_held_out_window_cannot_tell_a_lead(tmp_path):
    """Three windows (a record of 192-255 steps, or windows asked that long) leave one held out:
    a lead over auto is weighed against the spread of the paired window differences, and one
    window has none, so no candidate can be exported over auto whatever the search finds."""
    import autoscale
    from autoscale.envs.from_records import suite_from_records
    from autoscale.observe import watch_scaler
    from autoscale.search.bench import ReplayBench
    from autoscale.search.headroom import headroom
    from tests.observe.helpers import fp16_loop

    scaler = autoscale.get_scaler("torch", device="cpu", growth_interval=100)
    watch = watch_scaler(scaler, record=str(tmp_path / "r"))
    fp16_loop(scaler, 400, bad_every=50, weight=2.0**-10)
    watch.close()
    suite, traces = suite_from_records([tmp_path / "r"], horizon=128)  # 3 windows of 400 steps
    room = headroom(ReplayBench(suite, traces))
    assert room.windows == 1
    assert "one held-out window" in room.reason()


def test_a_record_given_twice_is_refused(tmp_path):
    """The same run twice would count its held-out windows twice, narrowing the noise a lead is
    weighed against: one line, before anything is stored."""
    import autoscale
    from autoscale.envs.from_records import suite_from_records
    from autoscale.errors import ConfigError
    from autoscale.observe import watch_scaler
    from tests.observe.helpers import fp16_loop

    scaler = autoscale.get_scaler("torch", device="cpu")
    watch = watch_scaler(scaler, record=str(tmp_path / "r"))
    fp16_loop(scaler, 200, bad_every=50, weight=2.0**-10)
    watch.close()
    with pytest.raises(ConfigError, match="record '.*r' is given twice"):
        suite_from_records([tmp_path / "r", tmp_path / "." / "r"], horizon=64)
    run = run_cli("search", "--traces", "r", "./r/", "--budget", "20s", cwd=tmp_path)
    assert run.rc == 2, run.err
    assert run.err.strip().splitlines() == [
        "autoscale search: error: record 'r' is given twice; pass each record once"
    ], run.err
    assert not (tmp_path / "autoscale.db").exists()


def test_a_ctrl_c_inside_optunas_tell_leaves_no_trial_running(searched, tmp_path, monkeypatch):
    """Optuna fails a trial on a Ctrl-C inside the objective, not on one inside its ask or tell:
    the trial being told would stay RUNNING in the study for ever. The records search runs its
    trials through the workload search's loop, which holds such a Ctrl-C until the tell is done."""
    import optuna.study._optimize as optimize

    import autoscale
    from autoscale.cli import main

    root, _, _ = searched
    real, told = optimize._tell_with_warning, []

    def tell(*args, **kwargs):
        told.append(kwargs["trial"].number)
        if len(told) == 3:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while Optuna tells the third trial
        return real(*args, **kwargs)

    monkeypatch.setattr(optimize, "_tell_with_warning", tell)
    monkeypatch.setattr(autoscale, "IMPORT_TIME", time.monotonic())  # the budget starts now
    monkeypatch.chdir(tmp_path)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rc = main(["search", "--traces", str(root / "run"), "--budget", "20s"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert rc == 130
    trials = _study(tmp_path).trials
    assert [t.state.name for t in trials if t.state.name == "RUNNING"] == []
    assert trials[told[2]].state.name in ("COMPLETE", "PRUNED")  # told before the Ctrl-C came out
