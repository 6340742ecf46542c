"""``autoscale export --trial best`` exports what the search exports: the search's own pick (the
bar against ``auto``, the families it was asked for, the stored no-harm verdicts), and a trial
exported by number that the search refused comes with one warning line; the manifest carries
the evidence either way. Real Optuna studies in SQLite, as a search leaves them."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from autoscale.cli import main
from autoscale.envs import load_env_spec
from autoscale.envs.suite import as_suite
from autoscale.envs.suite_env import suite_instances
from autoscale.scalers.policies import read_manifest
from autoscale.search.choose import VERDICT_PREFIX
from autoscale.search.no_harm import Verdict
from autoscale.search.storage import open_storage
from autoscale.search.validate import PREFIX
from autoscale.training.scorecard import Scorecard

optuna.logging.set_verbosity(optuna.logging.WARNING)
SUITE = as_suite(load_env_spec("mlp-bad-batches"))
NAMES = suite_instances(SUITE, "test")
# what a search of every family that adapts plans: static (a fixed scale) only with --family static
PLAN_RULES = ["torch", "deepspeed", "megatron", "jmp", "fairseq", "metaseq", "amax-history"]


def _card(skip_rate: float, precision: float, eval_loss: float = 2.0) -> dict:
    steps = 64
    return Scorecard(
        steps, round(skip_rate * steps), skip_rate, precision, eval_loss, eval_loss, 2.0**10,
        2.0**16, False, False, 1.0, 64.0,
    ).to_dict()  # fmt: skip


def _validated(study, key: str, skip_rate: float, precision: float) -> None:
    """``key`` validated on every test episode (what a search's validator stores)."""
    cards = {n: _card(skip_rate, precision) for n in NAMES}
    study.set_user_attr(PREFIX + key, {"cards": cards, "worker": "test"})


def _trial(study, rule: str, value: float, params: dict) -> int:
    policy = {"kind": "parametric", "rule": rule, "params": params}
    study.add_trial(
        optuna.trial.create_trial(params={}, distributions={}, value=value, user_attrs={"policy": policy})
    )  # fmt: skip
    return study.trials[-1].number


def _verdict(study, key: str, passed: bool, reasons=()) -> None:
    verdict = Verdict(key, passed, list(reasons))
    study.set_user_attr(VERDICT_PREFIX + key, verdict.to_dict())


def _study(root: Path, name: str, *, torch_validated: bool = True):
    storage = open_storage(f"sqlite:///{root / 's.db'}")
    study = optuna.create_study(study_name=name, storage=storage)
    for key, value in (("suite", SUITE.to_dict()), ("validation", SUITE.to_dict())):
        study.set_user_attr(key, value)
    study.set_user_attr("plan", {"rules": PLAN_RULES, "space": "parametric"})
    if torch_validated:
        _validated(study, "rule:torch", 0.125, 0.30)
    _validated(study, "policy:auto", 0.0, 0.05)
    return study


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AUTOSCALE_POLICY_PATH", raising=False)
    return tmp_path


def _export(capsys, study: str, trial: str, name: str) -> tuple[int, str, str]:
    argv = ["export", "--study", study, "--storage", "s.db", "--trial", trial, "--name", name]
    rc = main([*argv, "--policy-dir", "pol"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_best_is_auto_where_the_search_refused_a_static_trial_that_failed_its_check(work, capsys):
    """The review's study: trial 0 is static (not asked for), with a failed stored verdict, and
    ranks above torch; auto's row is better still. The search exports auto, and so does best."""
    study = _study(work, "s")
    static = _trial(study, "static", -0.5, {"init_scale": 1024.0})
    _validated(study, f"trial:{static}", 0.0, 0.10)  # beats torch, behind auto
    _verdict(study, f"trial:{static}", False, ["mlp/drift seed 1: kept 80% (torch 99%)"])

    rc, out, err = _export(capsys, "s", "best", "mine")
    assert rc == 0, err
    assert "auto, the shipped general policy, unchanged" in out, out
    assert "the search's pick: auto is the best found for this run" in out
    assert "trial 0" not in out and err == ""
    m = read_manifest(work / "pol" / "mine")
    assert m.workload["exported_policy"] == "auto" and "trial" not in m.workload
    ev = m.scorecard["evidence"]
    assert ev["search_exports"] == "auto" and ev["why"].startswith("auto is the best found")
    assert set(ev["held_out"]) == {"exported", "torch", "auto"}
    assert m.scorecard["evaluated_on"].startswith("real steps: 3 test episodes")


def test_a_refused_trial_goes_out_only_by_number_with_one_warning_and_the_evidence(work, capsys):
    study = _study(work, "s")
    static = _trial(study, "static", -0.5, {"init_scale": 1024.0})
    _validated(study, f"trial:{static}", 0.0, 0.01)  # leads auto beyond the noise
    _verdict(study, f"trial:{static}", False, ["mlp/drift seed 1: kept 80% (torch 99%)"])

    rc, out, err = _export(capsys, "s", "best", "best")
    assert rc == 0 and out.startswith("exported pol/best (auto, the shipped general policy")
    assert "led it beyond the seed noise, but 'static' cannot follow drifting gradients" in out
    rc, out, err = _export(capsys, "s", str(static), "by-number")
    assert rc == 0, err
    (line,) = err.strip().splitlines()
    assert line.startswith("warning: static, trial 0 is not what the search exports (")
    assert "'static' cannot follow drifting gradients (ask for it with --family static)" in line
    assert "it fails the no-harm check: mlp/drift seed 1: kept 80%" in line
    assert "exported by number" in out and "static, trial 0" in out
    m = read_manifest(work / "pol" / "by-number")
    assert m.family == "static" and m.workload["trial"] == static
    ev = m.scorecard["evidence"]
    assert ev["why"].startswith("exported by number") and ev["search_exports"] == "auto"
    assert any("cannot follow drifting gradients" in why for why in ev["not_the_pick"])
    assert ev["no_harm"]["passed"] is False and ev["no_harm"]["reasons"]
    assert ev["held_out"]["exported"]["precision_loss"] == pytest.approx(0.01)
    # and autoscale list says so in its row
    assert "; exported by number, not the search's pick: 'static' cannot follow" in m.describe()


def test_best_is_the_trial_that_cleared_auto_and_passed_its_check(work, capsys):
    """Two trials lead auto beyond the noise: the better one was never checked (no verdict,
    so the search cannot export it); the other passed. best is the one that passed."""
    study = _study(work, "s")
    unchecked = _trial(study, "amax-history", -0.9, {})
    passed = _trial(study, "deepspeed", -0.8, {})
    _validated(study, f"trial:{unchecked}", 0.0, 0.0)
    _validated(study, f"trial:{passed}", 0.0, 0.01)
    _verdict(study, f"trial:{passed}", True)

    rc, out, err = _export(capsys, "s", "best", "mine")
    assert rc == 0, err
    assert (
        f"deepspeed, trial {passed}; the search's pick: deepspeed, trial {passed} beat auto" in out
    )
    assert out.count("passed the no-harm check") == 1
    m = read_manifest(work / "pol" / "mine")
    assert m.family == "deepspeed" and m.workload["trial"] == passed
    assert m.scorecard["evidence"]["no_harm"]["passed"] is True
    rc, out, err = _export(capsys, "s", str(unchecked), "other")
    assert rc == 0 and "the study holds no no-harm verdict for it" in err


def test_best_without_torchs_validation_exports_nothing_and_says_so(work, capsys):
    study = _study(work, "bare", torch_validated=False)
    _trial(study, "deepspeed", -0.8, {})
    rc, out, err = _export(capsys, "bare", "best", "mine")
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert "holds no real-step validation of torch" in line and "--trial N" in line
    assert not (work / "pol" / "mine").exists()


def test_best_keeps_a_lead_the_search_refused_on_the_horizon_refused_torchs_included(work, capsys):
    """torch leads auto on the short real-step episodes, and the search refused that lead on the
    horizon's replay (auto is slow to start, not worse): it exported auto. best, which has no
    replay to weigh the lead on, read it as torch's win before the search stored its reasons."""
    from autoscale.search.choose import REFUSED_PREFIX

    study = _study(work, "s")
    _validated(study, "policy:auto", 0.125, 0.40)  # behind torch on these short episodes
    why = "its lead does not hold on the 1024-step replay of the same held-out runs"
    study.set_user_attr(REFUSED_PREFIX + "rule:torch", why)
    rc, out, err = _export(capsys, "s", "best", "mine")
    assert rc == 0, err
    assert "auto, the shipped general policy, unchanged" in out, out
    assert f"torch led it beyond the seed noise, but {why}" in out


def test_best_reads_the_verdicts_of_the_check_the_search_last_decided_with(work, capsys):
    """A resumed search with another budget checked another shape of the check: its own verdict
    decided its pick, whatever was stored last of another shape (export read the latest)."""
    from autoscale.search.choose import CHECK_SHAPE, verdict_key

    study = _study(work, "s")
    trial = _trial(study, "deepspeed", -0.8, {})
    _validated(study, f"trial:{trial}", 0.0, 0.01)
    key = f"trial:{trial}"
    passed = {**Verdict(key, True, [], shape="P").to_dict(), "stored_at": 1.0}
    failed = {**Verdict(key, False, ["gpt2 seed 0: worse"], shape="R").to_dict(), "stored_at": 2.0}
    study.set_user_attr(verdict_key(key, "P"), passed)
    study.set_user_attr(verdict_key(key, "R"), failed)
    study.set_user_attr(CHECK_SHAPE, "P")  # the search that picked last ran the check of shape P
    rc, out, err = _export(capsys, "s", "best", "mine")
    assert rc == 0, err
    assert f"deepspeed, trial {trial}; the search's pick: deepspeed, trial {trial} beat auto" in out
    study.set_user_attr(CHECK_SHAPE, "R")
    rc, out, err = _export(capsys, "s", "best", "other")
    assert rc == 0 and "auto, the shipped general policy, unchanged" in out, out


def test_a_name_taken_says_the_option_that_names_the_export(work, capsys):
    """The second export under the same name is refused in one line that names --name (the
    search's own line names --export, train-agent's --out: tests/search, tests/agents)."""
    _study(work, "s")
    assert _export(capsys, "s", "best", "mine")[0] == 0
    rc, out, err = _export(capsys, "s", "best", "mine")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.strip().endswith("choose another name (--name NAME) or pass --force"), err


def test_list_shows_the_studies_and_a_studys_rows_and_trials_in_text(work, capsys):
    """Without a browser (a training server over SSH): --list names the storage's studies, what
    each search exports, and a study's ranking (its pick marked, each verdict) and best trials;
    it exports nothing, and an export without --name says where to look."""
    study = _study(work, "s")
    passed = _trial(study, "deepspeed", -0.8, {})
    _trial(study, "amax-history", -0.9, {})
    _validated(study, f"trial:{passed}", 0.0, 0.01)
    _verdict(study, f"trial:{passed}", True)
    _study(work, "bare", torch_validated=False)

    assert main(["export", "--list", "--storage", "s.db"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "2 studies in s.db:"
    assert out[1].startswith("  bare: mlp/bad-batches (fp16); 0 trials (0 complete, ")
    assert out[1].endswith("; exports nothing yet (torch not validated)")
    assert out[2].startswith(
        "  s: mlp/bad-batches (fp16); 2 trials (2 complete, 0 pruned, 0 failed)"
    )
    assert out[2].endswith(f"; exports deepspeed, trial {passed}")

    assert main(["export", "--list", "--study", "s", "--storage", "s.db"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("validated on real steps (objective vs torch")
    rows = [line.split()[:3] for line in out[2:5]]
    assert rows[0][:2] == ["*", "deepspeed,"] and out[2].endswith("no-harm passed")
    assert [r[0] for r in rows[1:]] == ["auto", "torch"]
    assert out[5].startswith("best trials on the train replay")
    assert out[6].split()[:3] == ["trial", "1", "amax-history"] and out[6].endswith("-0.9000")
    assert not (work / "pol").exists()

    assert main(["export", "--study", "s", "--storage", "s.db"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "autoscale export: error: export needs --name; autoscale export --list lists the studies "
        "and their trials"
    ]
