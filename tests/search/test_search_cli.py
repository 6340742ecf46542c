"""``autoscale search``, ``dashboard`` and ``export`` end to end, as real subprocesses."""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from wsgiref.simple_server import WSGIRequestHandler, make_server

import optuna
import pytest

from autoscale.scalers import LossScaler, make_scaler
from autoscale.scalers.policies import read_manifest
from autoscale.search.budget import parse_budget
from autoscale.search.export import study_suites
from autoscale.search.storage import artifact_store, artifacts_dir, open_storage
from tests.search.conftest import RULES, SEARCH_BUDGET_S, run_cli, spawn

optuna.logging.set_verbosity(optuna.logging.WARNING)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.paced,
]  # real `autoscale` subprocesses, seconds to a minute each


def _study(url: str, name: str):
    return optuna.load_study(study_name=name, storage=open_storage(url, must_exist=True))


def _trials(study, *states):
    return study.get_trials(deepcopy=False, states=states or None)


def test_ninety_second_search_spends_its_budget_and_exports_a_loadable_policy(searched):
    run = searched.run
    assert run.rc == 0, run.err[-3000:]
    assert run.wall_s <= SEARCH_BUDGET_S * 1.05, f"took {run.wall_s:.1f} s of {SEARCH_BUDGET_S} s"
    done = re.search(r"done in ([\dms.]+) of a 1m30s budget", run.out)
    assert done, run.out[-2000:]
    # the dashboard line works from any folder: the storage by its absolute path
    assert f"review it with: autoscale dashboard --storage sqlite:///{searched.db.resolve()}\n" in (
        run.out
    ), run.out[-500:]
    # the budget is spent, but for what the search says it left and why (a slow machine's tail)
    stop = re.search(r"stopping with ([\dms.]+) left: (.+)", run.out)
    left = parse_budget(stop.group(1)) if stop else 0.0
    assert parse_budget(done.group(1)) + left >= 0.9 * SEARCH_BUDGET_S, run.out[-2000:]
    assert stop is None or stop.group(2).startswith("less than a round is left"), stop.group(0)
    for k, phase in enumerate(("measure", "plan", "record", "search", "validate", "export"), 1):
        assert f"[{k}/6 {phase}]" in run.out
    # the ranking: every built-in rule and the candidates on the same real test episodes
    table = run.out[run.out.rindex(" real steps; mean ± std over them") :]
    rows = [
        line.split("  ")[0].lstrip("* ").strip()
        for line in table.splitlines()[3:]
        if line and not line.startswith("objective")
    ]
    assert set(RULES) <= set(rows)
    assert "* " in table  # the exported row is marked
    assert "hindsight limit: precision loss" in table  # and how close each came to the limit

    study = _study(searched.url, searched.study)
    attrs = study.user_attrs
    assert attrs["versions"]["optuna"] == optuna.__version__ and "torch" in attrs["versions"]
    assert attrs["budget"]["seconds"] == SEARCH_BUDGET_S and attrs["command"].startswith(
        "autoscale search"
    )
    assert attrs["plan"]["horizon"] >= 64 and attrs["plan"]["no_harm"]["steps"] >= 1000

    policy = searched.policies / searched.study
    manifest = read_manifest(policy)
    assert not (searched.root / "policies").exists()  # not the working directory's
    assert manifest.kind == "parametric" and manifest.workload["study"] == searched.study
    assert manifest.scorecard["evaluated_on"].startswith("real steps")
    evidence = manifest.scorecard["evidence"]
    assert evidence["bar"] == "auto" and f"why: {evidence['why']}" in run.out
    assert f"answer: exported '{searched.study}' = " in run.out
    held_out = evidence["held_out"]
    assert "torch" in held_out and "auto" in held_out  # the answer is measured against both
    if "exported_policy" in manifest.workload:  # nothing cleared auto: auto itself, said so
        assert manifest.workload["exported_policy"] == "auto"
        assert evidence["why"].startswith("auto is the best found for this run")
        assert manifest.workload["built"]["built_by"].startswith("experiments/build_auto.py")
    elif "builtin_rule" in manifest.workload:  # a built-in rule cleared auto: exported as itself
        rule = manifest.workload["builtin_rule"]
        assert f"(the built-in rule {rule} with its defaults)" in run.out
        assert manifest.family == rule and "beat auto by" in evidence["why"]
    else:
        assert study.trials[manifest.workload["trial"]].state == optuna.trial.TrialState.COMPLETE
        assert "beat auto by" in evidence["why"] and "passed the no-harm check" in evidence["why"]
    assert manifest.family != "static"  # a fixed scale only when asked for (--family static)
    scaler = make_scaler(str(policy), device="cpu")
    assert isinstance(scaler, LossScaler) and scaler.name == searched.study
    assert (
        scaler.rule.params()
        == make_scaler(manifest.family, device="cpu", **manifest.parameters).rule.params()
    )


def test_every_trial_keeps_a_summary_and_the_best_a_note_and_a_plot(searched):
    from optuna.artifacts import get_all_artifact_meta
    from optuna_dashboard import get_note

    study = _study(searched.url, searched.study)
    suite, _, _ = study_suites(study)
    members = {m.name for m in suite.members}
    complete = _trials(study, optuna.trial.TrialState.COMPLETE)
    assert len(complete) >= 8  # at least the enqueued defaults of every rule family
    store = artifact_store(artifacts_dir(searched.url))
    noted = 0
    for t in complete:
        scores = t.user_attrs["scores"]
        assert set(scores["members"]) == members and "test_replay" in scores
        assert scores["objective_terms"]["objective"] == pytest.approx(t.value)
        metas = get_all_artifact_meta(t, storage=study._storage)
        if not metas:
            continue
        noted += 1
        note = get_note(optuna.trial.Trial(study, t._trial_id))
        assert f"Trial {t.number}:" in note and f"**objective {t.value:+.4f}**" in note
        assert "0 = `torch`" in note
        (meta,) = metas
        assert meta.mimetype == "image/svg+xml"
        with store.open_reader(meta.artifact_id) as fh:
            assert fh.read(4) == b"<svg"
    assert noted >= min(10, len(complete))
    for t in _trials(study, optuna.trial.TrialState.PRUNED):
        assert sum(m["episodes"] for m in t.user_attrs["scores"]["members"].values()) > 0


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as resp:
        body = resp.read()
        return json.loads(body) if resp.headers.get_content_type() == "application/json" else body


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass


def test_dashboard_api_lists_the_study_its_trials_notes_and_artifacts(searched):
    from optuna_dashboard import wsgi

    storage = open_storage(searched.url, must_exist=True)
    app = wsgi(storage, artifact_store=artifact_store(artifacts_dir(searched.url)))
    server = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        studies = {
            s["study_name"]: s["study_id"] for s in _get(f"{base}/api/studies")["study_summaries"]
        }
        sid = studies[searched.study]
        detail = _get(f"{base}/api/studies/{sid}")
        assert "## " + searched.study in detail["note"]["body"]
        assert "Result on real steps" in detail["note"]["body"]
        complete = [t for t in detail["trials"] if t["state"] == "Complete"]
        assert len(complete) == len(
            _trials(_study(searched.url, searched.study), optuna.trial.TrialState.COMPLETE)
        )
        trial = next(t for t in complete if t["artifacts"])
        assert "objective" in trial["note"]["body"]
        (art,) = trial["artifacts"]
        svg = _get(f"{base}/artifacts/{sid}/{trial['trial_id']}/{art['artifact_id']}")
        assert svg.startswith(b"<svg") and b"polyline" in svg
        keys = {a["key"] for a in trial["user_attrs"]}
        assert {"policy", "scores", "worker"} <= keys
    finally:
        server.shutdown()


def test_export_command_exports_best_and_named_trials(searched):
    def export(*args: str):
        return run_cli(
            "export", "--study", searched.study, "--name", "from-cli", *args,
            cwd=searched.root, env=searched.env,
        )  # fmt: skip

    run = export()
    assert run.rc == 0, run.err
    assert "the search's pick: " in run.out and run.err == ""
    m = read_manifest(searched.policies / "from-cli")
    assert m.name == "from-cli" and m.workload["study"] == searched.study
    # best is what the search itself exported (its pick is decided by the same code)
    searched_export = read_manifest(searched.policies / searched.study)
    for what in ("trial", "builtin_rule", "exported_policy"):
        assert m.workload.get(what) == searched_export.workload.get(what), what
    assert m.scorecard["evaluated_on"].startswith("real steps")
    assert m.scorecard["evidence"]["why"] and m.scorecard["evidence"]["bar"] == "auto"
    assert isinstance(make_scaler(str(searched.policies / "from-cli"), device="cpu"), LossScaler)
    again = export("--trial", "0")
    assert again.rc == 2 and "already exists" in again.err and "--force" in again.err
    forced = export("--trial", "0", "--force")
    assert forced.rc == 0 and read_manifest(searched.policies / "from-cli").workload["trial"] == 0


def _one_line_error(run, *fragments):
    assert run.rc == 2, (run.out, run.err)
    lines = [line for line in run.err.splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1, run.err
    assert "Traceback" not in run.err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_bad_input_is_one_line_exit_2_and_loses_nothing(searched):
    study = _study(searched.url, searched.study)
    before = [(t.number, t.state, t.value) for t in study.get_trials(deepcopy=False)]
    _one_line_error(
        run_cli("search", "--budget", "5x", cwd=searched.root, env=searched.env),
        "'5x'",
        "90s, 30m, 2h or 1h30m",
    )
    _one_line_error(
        run_cli(
            "search", "--model", "gpt3", "--budget", "30s", cwd=searched.root, env=searched.env
        ),
        "unknown model 'gpt3'",
        "did you mean 'gpt2'",
    )
    _one_line_error(
        run_cli(
            "search",
            "--storage",
            "postgresql://nobody@127.0.0.1:1/x",
            "--budget",
            "30s",
            cwd=searched.root,
            env=searched.env,
        ),
        "cannot open storage 'postgresql://nobody@127.0.0.1:1/x'",
    )
    _one_line_error(
        run_cli("export", "--study", "nope", "--name", "x", cwd=searched.root, env=searched.env),
        "unknown study 'nope'",
        searched.study,
    )
    # the shipped policy's name: an export of it would stand for it in every run and search
    _one_line_error(
        run_cli(
            "export",
            "--study",
            searched.study,
            "--name",
            "auto",
            cwd=searched.root,
            env=searched.env,
        ),  # fmt: skip
        "policy name 'auto' is a policy shipped with autoscale",
        "choose another name",
    )
    assert not (searched.policies / "auto").exists()
    study = _study(searched.url, searched.study)
    assert [(t.number, t.state, t.value) for t in study.get_trials(deepcopy=False)] == before
    names = optuna.study.get_all_study_names(open_storage(searched.url, must_exist=True))
    assert names == [searched.study]
    assert not (searched.policies / "x").exists()


def test_slow_model_ends_in_budget_saying_what_it_would_need(tmp_path):
    run = run_cli("search", "--model", "gpt2", "--budget", "20s", "--quiet", cwd=tmp_path)
    _one_line_error(run, "the budget cannot hold a search of gpt2 here", "of budget")
    assert re.search(r"needs (about|more than) (\d+h)?\d+m", run.err)  # 1h51m40s when slower
    assert run.wall_s < 20 * 1.05
    assert "[1/6 measure] gpt2: " in run.out  # each workload's step time, the check's too


def test_dashboard_command_serves_the_storage_on_localhost(searched):
    import signal
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = spawn("dashboard", "--storage", searched.url, "--port", str(port), cwd=searched.root)
    try:
        meta = None
        deadline = time.monotonic() + 60
        while meta is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                meta = _get(f"http://127.0.0.1:{port}/api/meta")
            except OSError:
                time.sleep(0.3)
        assert meta is not None, proc.stderr.read() if proc.poll() is not None else "no answer"
        assert meta["artifact_is_available"] is True
        names = [
            s["study_name"] for s in _get(f"http://127.0.0.1:{port}/api/studies")["study_summaries"]
        ]
        assert names == [searched.study]
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert f"http://127.0.0.1:{port}/" in out


def _spin(stop) -> None:  # someone else's CPU-bound process
    while not stop.is_set():
        sum(range(100_000))


# a search beside a busy process: its smallest plan needed 1m09s-1m29s of budget here
BUSY_BUDGET_S = 120.0


@pytest.mark.solo  # with its busy process
def test_a_search_beside_a_busy_process_without_omp_num_threads_ends_in_budget(
    tmp_path, autoscale_home
):
    """The README's main job as a user runs it: no OMP_NUM_THREADS, another CPU-bound process
    on the machine. The search picks its torch threads from the load it sees, says so, and ends
    within its budget with an export."""
    import multiprocessing as mp

    from tests.search.conftest import cli_env

    stop = mp.Event()
    other = mp.Process(target=_spin, args=(stop,), daemon=True)
    other.start()
    try:
        run = run_cli(
            "search",
            "--model",
            "mlp",
            "--budget",
            f"{BUSY_BUDGET_S:.0f}s",
            "--quiet",
            cwd=tmp_path,
            timeout=BUSY_BUDGET_S + 120,
            env=cli_env(threads=None),
        )
    finally:
        stop.set()
        other.join()
    assert run.rc == 0, run.err[-3000:]
    assert run.wall_s <= BUSY_BUDGET_S * 1.05, f"took {run.wall_s:.1f} s\n{run.out[-3000:]}"
    measured = re.search(
        r"\[1/6 measure\] .*; (\d+) torch threads? on (\d+) cores \(([\d.]+) busy", run.out
    )
    assert measured, run.out[:2000]
    threads, cores, busy = int(measured[1]), int(measured[2]), float(measured[3])
    assert busy >= 0.5 and threads <= max(1, cores - 1)  # the busy core is left to its owner
    # its export, in the test's own user folder (cli_env copies $AUTOSCALE_HOME)
    make_scaler(str(autoscale_home / "policies" / "mlp-bad-batches-parametric"), device="cpu")
