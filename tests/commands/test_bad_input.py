"""Bad input, widely: env and suite specs, policy manifests and weights, command-line values and
storage URLs. Each row is a command run on a folder of malformed files; each must print one line
(``autoscale CMD: error: ...``) that names the value and says the fix, exit with status 2, and
leave every file of the folder as it was (no storage, cache or policy created or touched).

The rows run in-process through ``autoscale.cli.main`` (the command line is the same code);
``test_rows_in_real_processes`` runs one row of each kind as a real ``autoscale`` process and
checks that it prints the same line.
"""

from __future__ import annotations

import gc
import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest

from autoscale.cli import main
from autoscale.envs import load_env_spec
from autoscale.envs.suite import as_suite
from autoscale.errors import AutoscaleError
from autoscale.search.storage import open_storage

ROOT = Path(__file__).resolve().parents[2]
GOOD_SPEC = (ROOT / "envs" / "mlp-bad-batches.yaml").read_text()
GOOD_SUITE = (ROOT / "envs" / "suite.yaml").read_text()
NEURAL = ROOT / "tests" / "scalers" / "fixtures" / "policies" / "fixture-neural"
PARAMETRIC = ROOT / "tests" / "scalers" / "fixtures" / "policies" / "fixture-parametric"


def _spec(old: str, new: str) -> str:
    assert old in GOOD_SPEC, old
    return GOOD_SPEC.replace(old, new, 1)


def _suite(old: str, new: str) -> str:
    assert old in GOOD_SUITE, old
    return GOOD_SUITE.replace(old, new, 1)


# the malformed files the rows read, by name in the work folder
SPECS = {
    "tabs.yaml": _spec("  model: mlp", "\tmodel: mlp"),
    "twice.yaml": GOOD_SPEC + "name: again\n",
    "empty.yaml": "",
    "list.yaml": "- mlp\n- bad-batches\n",
    "typo.yaml": _spec("episode:", "episod:"),
    "reward-list.yaml": _spec("reward: {skip: 1.0, precision: 4.0, progress: 0.1, divergence: 10.0}", "reward: [1, 2]"),
    "batch.yaml": _spec("batch_size: 32", "batch_size: many"),
    "scale0.yaml": _spec("init_scale: 65536", "init_scale: 0"),
    "huge.yaml": _spec("max_scale: 2**40", "max_scale: 2**4000"),
    "deltas.yaml": _spec("deltas: [-2, -1, 0, 1, 2]", "deltas: up"),
    "steps0.yaml": _spec("steps: 64", "steps: 0"),
    "notest.yaml": _spec(
        "  test:\n    - {seed: 100, start: 0}\n    - {seed: 101, start: 32}\n    - {seed: 102, start: 0}",
        "  test: []",
    ),
    "seed.yaml": _spec("- {seed: 0, start: 0}", "- {seed: 0.5, start: 0}"),
    "start.yaml": _spec("- {seed: 1, start: 0}", "- {seed: 1, start: true}"),
    "model.yaml": _spec("model: mlp", "model: mlpp"),
    "every.yaml": _spec("scenario_params: {every: 8}", "scenario_params: {every: 0}"),
    "leak.yaml": _spec("- {seed: 100, start: 0}", "- {seed: 0, start: 0}"),
    "suite-left.yaml": _suite("validation: {workloads: [autoencoder]", "validation: {workloads: [autoencodr]"),
    "suite-exclude.yaml": _suite("exclude: [cnn/preference,", "exclude: [mlp/clen, cnn/preference,"),
    "suite-none.yaml": _suite(
        "test: {workloads: [cnn, denoise],",
        "test: {workloads: [gpt2-tiny, mlp, cnn, denoise],",
    ),
    "suite-member.yaml": _suite("mlp: {model: mlp, batch_size: 32}", "mlp: {model: mlp, batch_size: 0}"),
    "suite-key.yaml": _suite("  split:", "  leftout: {}\n  split:"),
}  # fmt: skip
SPECS["episode5.yaml"] = re.sub(r"episode:\n(  .*\n)+", "episode: 5\n", GOOD_SPEC)
SPECS["suite-list.yaml"] = re.sub(r"  workloads:\n(    .*\n)+", "  workloads: [mlp]\n", GOOD_SUITE)


def _make_policies(pol: Path) -> None:
    """Policy folders, each broken in one way."""
    (pol / "nomanifest").mkdir(parents=True)
    shutil.copy(NEURAL / "weights.pt", pol / "nomanifest" / "weights.pt")
    manifest = (PARAMETRIC / "policy.yaml").read_text()
    for name, text in {
        "cut": manifest[: manifest.index("parameters:") + len("parameters: {growth")],
        "kind": manifest.replace("kind: parametric", "kind: quantum"),
        "newer": manifest.replace("format: 1", "format: 99"),
        "twice": manifest + "kind: parametric\n",
        "knob": manifest.replace("loss_scale_window: 3", "loss_scale_window: -1"),
        "word": manifest.replace("loss_scale_window: 3", "loss_scale_window: abc"),
    }.items():
        (pol / name).mkdir()
        (pol / name / "policy.yaml").write_text(text)
    shutil.copytree(NEURAL, pol / "weights-cut")
    weights = (pol / "weights-cut" / "weights.pt").read_bytes()
    (pol / "weights-cut" / "weights.pt").write_bytes(weights[: len(weights) // 2])
    shutil.copytree(NEURAL, pol / "weights-gone")
    (pol / "weights-gone" / "weights.pt").unlink()


@dataclass(frozen=True)
class Row:
    argv: tuple[str, ...]
    value: str  # the bad value, as the message must name it
    fix: str  # what the message must say to do


def _run(*a: str) -> tuple[str, ...]:
    return ("run", "--model", "mlp", "--steps", "1", *a)


def _record(spec: str) -> tuple[str, ...]:
    return ("record", "--env", spec, "--steps", "2", "--out", "t.npz")


def _agent(*a: str) -> tuple[str, ...]:
    return ("train-agent", "--env", "mlp-bad-batches", "--timesteps", "64", "--out", "x", *a)


ROWS: dict[str, Row] = {
    # ---------------------------------------------------------------- env specs (YAML)
    "spec: tab indentation": Row(_record("tabs.yaml"), "'\\t'", "fix that line"),
    "spec: a key given twice": Row(_record("twice.yaml"), "key 'name' is given twice (line 27", "fix that line"),
    "spec: empty file": Row(_record("empty.yaml"), "empty.yaml is empty", "write an env spec"),
    "spec: a list, not a mapping": Row(_record("list.yaml"), "got list", "expected a mapping"),
    "spec: misspelt key": Row(_record("typo.yaml"), "'episod'", "did you mean 'episode'?"),
    "spec: episode not a mapping": Row(_record("episode5.yaml"), "got 5", "must be a mapping"),
    "spec: reward not a mapping": Row(_record("reward-list.yaml"), "got [1, 2]", "must be a mapping"),
    "spec: batch size a word": Row(_record("batch.yaml"), "'many'", "must be a positive integer"),
    "spec: zero initial scale": Row(_record("scale0.yaml"), "got 0", "positive finite number"),
    "spec: scale past float range": Row(_record("huge.yaml"), "'2**4000'", "use at most 2**1023"),
    "spec: deltas not a list": Row(_record("deltas.yaml"), "got 'up'", "a list of numbers"),
    "spec: zero steps": Row(_record("steps0.yaml"), "got 0", "positive integer"),
    "spec: no test instances": Row(_record("notest.yaml"), "'test'", "is missing or empty"),
    "spec: fractional seed": Row(_record("seed.yaml"), "got 0.5", "must be an integer"),
    "spec: boolean start": Row(_record("start.yaml"), "got True", "integer >= 0"),
    "spec: unknown model": Row(_record("model.yaml"), "'mlpp'", "did you mean 'mlp'?"),
    "spec: scenario parameter 0": Row(_record("every.yaml"), "got 0", "must be > 0"),
    "spec: test repeats train": Row(_record("leak.yaml"), "'test-s0-t0'", "repeat a train instance"),
    "spec: not found": Row(_record("nosuch"), "'nosuch'", "ls envs/ shows all"),
    "spec: no such file": Row(_record("specs/nosuch.yaml"), "'specs/nosuch.yaml' does not exist", "give the path of a YAML spec"),
    # ---------------------------------------------------------------- suite specs
    "suite: workloads a list": Row(("search", "--env", "suite-list.yaml"), "suite.workloads", "non-empty mapping"),
    "suite: left-out typo": Row(("search", "--env", "suite-left.yaml"), "'autoencodr'", "did you mean 'autoencoder'?"),
    "suite: exclude typo": Row(("search", "--env", "suite-exclude.yaml"), "'mlp/clen'", "did you mean 'mlp/clean'?"),
    "suite: everything left out": Row(("search", "--env", "suite-none.yaml"), "suite 'suite'", "keep at least one pair"),
    "suite: a bad member": Row(("search", "--env", "suite-member.yaml"), "member 'mlp/clean'", "positive integer, got 0"),
    "suite: misspelt key": Row(("search", "--env", "suite-key.yaml"), "'leftout'", "did you mean 'left_out'?"),
    # ---------------------------------------------------------------- policy manifests and weights
    "policy: no manifest": Row(_run("--scaler", "pol/nomanifest"), "'pol/nomanifest'", "export the policy again"),
    "policy: manifest cut short": Row(_run("--scaler", "pol/cut"), "pol/cut/policy.yaml", "re-export the policy"),
    "policy: unknown kind": Row(_run("--scaler", "pol/kind"), "'quantum'", "install the package that adds it"),
    "policy: newer format": Row(_run("--scaler", "pol/newer"), "format 99", "upgrade autoscale"),
    "policy: a key given twice": Row(_run("--scaler", "pol/twice"), "key 'kind' is given twice", "re-export"),
    "policy: invalid parameter": Row(_run("--scaler", "pol/knob"), "got -1", "loss_scale_window"),
    "policy: a parameter in words": Row(_run("--scaler", "pol/word"), "got 'abc'", "loss_scale_window must be a number"),
    "policy: weights cut short": Row(("eval", "--policy", "pol/weights-cut", "--env", "mlp-bad-batches"), "weights.pt", "re-export the policy"),
    "policy: weights missing": Row(_run("--scaler", "pol/weights-gone"), "no weights.pt", "re-export it"),
    # ---------------------------------------------------------------- command-line values
    "cli: budget in words": Row(("search", "--budget", "10 minutes"), "'10 minutes'", "write it like 90s"),
    "cli: negative budget": Row(("search", "--budget=-5m"), "'-5m'", "write it like 90s"),
    "cli: negative budget, spaced": Row(("search", "--budget", "-1m"), "'-1m'", "write it like 90s"),
    "cli: zero trials": Row(("search", "--model", "mlp", "--n-trials", "0"), "got 0", "positive number"),
    "cli: trials not a number": Row(("search", "--n-trials", "abc"), "'abc'", "--help shows the usage"),
    "cli: unknown space": Row(("search", "--space", "genetic"), "'genetic'", "choose from"),
    "cli: export name with a path": Row(("search", "--model", "mlp", "--export", "../up"), "'../up'", "letters, digits"),
    "cli: export name of a rule": Row(("search", "--model", "mlp", "--export", "torch"), "'torch'", "choose another"),
    "cli: export name of a shipped policy": Row(("search", "--model", "mlp", "--export", "auto"), "'auto'", "choose another name"),
    "cli: policy dir is a file": Row(("search", "--model", "mlp", "--policy-dir", "t.txt"), "'t.txt'", "pass --policy-dir DIR"),
    "cli: NaN learning rate": Row(_run("--lr", "nan"), "got nan", "positive finite number"),
    "cli: unknown trial": Row(("export", "--study", "made", "--storage", "made.db", "--trial", "x", "--name", "p"), "'x'", "trial number or 'best'"),
    "cli: study from elsewhere": Row(("export", "--study", "bare", "--storage", "made.db", "--name", "p"), "study 'bare'", "search it again under a new --study"),
    "cli: port out of range": Row(("dashboard", "--storage", "made.db", "--port", "99999"), "got 99999", "from 1 to 65535"),
    "cli: host not of this machine": Row(("dashboard", "--storage", "made.db", "--host", "999.1.1.1"), "999.1.1.1", "give --host an address of this machine"),
    "cli: misspelt study": Row(("export", "--study", "mde", "--storage", "made.db", "--name", "p"), "'mde'", "did you mean 'made'?"),
    "cli: data a model does not read": Row(_run("--data", "/nonexistent/x.txt"), "'/nonexistent/x.txt'", "drop --data, or train a language model"),
    "cli: data compare's mlp does not read": Row(("compare", "--model", "mlp", "--steps", "1", "--data", "t.txt"), "'t.txt'", "drop --data"),
    "cli: data that does not exist": Row(("compare", "--model", "gpt2-tiny", "--steps", "1", "--data", "nosuch.txt"), "'nosuch.txt'", "give a text file or a folder"),
    "cli: trace to an unwritable path": Row(("record", "--model", "mlp", "--steps", "5", "--out", "/proc/nope"), "'/proc/nope'", "pick a path in a writable folder"),
    "cli: suite traces under a file": Row(("record", "--env", "suite", "--steps", "5", "--out", "t.txt/traces"), "t.txt is a file", "pick another path"),
    "cli: JSON to an unwritable path": Row(_run("--json", "/proc/nope.json"), "'/proc/nope.json'", "pick a path in a writable folder"),
    "cli: agent export folder unwritable": Row(("train-agent", "--env", "mlp-bad-batches", "--timesteps", "64", "--out", "x", "--policy-dir", "/proc/nope"), "'/proc/nope'", "pick a path in a writable folder"),
    "cli: agent replay missing": Row(_agent("--replay", "gone.npz"), "no trace file 'gone.npz'", "autoscale record --env mlp-bad-batches --steps N --out gone.npz"),
    "cli: search export folder unwritable": Row(("search", "--model", "mlp", "--budget", "90s", "--policy-dir", "/proc/nope"), "'/proc/nope'", "pass --policy-dir DIR"),
    "cli: scaler parameter in words": Row(_run("--scaler", "amax-loss", "--scaler-param", "probe_after=x"), "got 'x'", "probe_after must be a number"),
    "cli: switch neither true nor false": Row(_run("--scaler-param", "raise_at_min=maybe"), "got 'maybe'", "must be true or false"),
    "cli: JSON to a folder": Row(_run("--json", "adir"), "--json adir", "give the path of a file"),
    "cli: trace to a folder": Row(("record", "--model", "mlp", "--steps", "5", "--out", "adir"), "--out adir", "give the path of a file"),
    "cli: eval plot to an unwritable path": Row(("eval", "--policy", "torch", "--env", "mlp-bad-batches", "--plot", "/proc/e.png"), "'/proc/e.png'", "pick a path in a writable folder"),
    "cli: residual window 0": Row(_agent("--residual", "--window", "0"), "got 0", "--window must be a positive number"),
    "cli: window without residual": Row(_agent("--window", "4"), "--window", "add --residual or drop it"),
    "cli: negative evaluation interval": Row(_agent("--eval-freq", "-5"), "got -5", "--eval-freq must be a positive number"),
    "cli: TensorBoard logs under a file": Row(_agent("--tensorboard", "t.txt/tb"), "t.txt is a file", "pick another path"),
    # ---------------------------------------------------------------- storage URLs
    "storage: neither URL nor file": Row(("search", "--model", "mlp", "--storage", "autoscale"), "'autoscale'", "use e.g. sqlite:///autoscale.db"),
    "storage: driver not installed": Row(("search", "--model", "mlp", "--storage", "mysql://u:pw@127.0.0.1:1/x"), "'mysql://u:***@127.0.0.1:1/x'", "is not installed"),
    "storage: server not running": Row(("search", "--model", "mlp", "--storage", "postgresql://u:secret@127.0.0.1:1/x"), "'postgresql://u:***@127.0.0.1:1/x'", "that the server runs"),
    "storage: missing folder": Row(("search", "--model", "mlp", "--storage", "sqlite:////no-such-dir/a.db"), "'/no-such-dir'", "does not exist"),
    "storage: unknown scheme": Row(("search", "--model", "mlp", "--storage", "nosuch://x"), "'nosuch://x'", "check the URL"),
    "storage: a log that is no journal": Row(("search", "--model", "mlp", "--storage", "junk.log"), "'junk.log': line 1", "fix or remove that line"),
    "storage: a journal cut short": Row(("search", "--model", "mlp", "--storage", "cut.log"), "line 2 is cut short", "fix or remove that line"),
    "storage: under a file": Row(("search", "--model", "mlp", "--storage", "sqlite:///t.txt/a.db"), "folder 't.txt' is a file", "give a file in an existing folder"),
    "cli: a report replaying no scaler": Row(("report", "rec", "--scalers", " ,"), "--scalers", "needs at least one scaler name"),
    "cli: a report of a file": Row(("report", "t.txt"), "'t.txt' is a file", "give the folder that autoscale wrap --record DIR wrote"),
    "storage: no such file": Row(("export", "--study", "made", "--storage", "gone.db", "--name", "p"), "'gone.db'", "run autoscale search first"),
}  # fmt: skip


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The folder of malformed inputs, and a storage with two studies for ``export``."""
    root = tmp_path_factory.mktemp("bad")
    for name, text in SPECS.items():
        (root / name).write_text(text)
    (root / "t.txt").write_text("a file where a folder belongs\n")
    (root / "adir").mkdir()  # a folder where a file belongs
    shutil.copytree(ROOT / "tests" / "observe" / "fixtures" / "record-v1", root / "rec")
    (root / "junk.log").write_text("garbage{")  # Optuna would write its next entry onto it
    (root / "cut.log").write_text('{"op_code": 0, "worker_id": "w", "study_name": "s"}\n{"op_code"')
    _make_policies(root / "pol")
    storage = open_storage(f"sqlite:///{root / 'made.db'}")
    made = optuna.create_study(study_name="made", storage=storage)
    suite = as_suite(load_env_spec("mlp-bad-batches")).to_dict()
    made.set_user_attr("suite", suite)  # what a search stores: export reads it first
    made.set_user_attr("validation", suite)
    optuna.create_study(study_name="bare", storage=storage)
    storage.engine.dispose()
    return root


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def _check(row: Row, rc: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith(f"autoscale {row.argv[0]}: error: "), line
    assert row.value in line, f"the value {row.value!r} is not named in: {line}"
    assert row.fix in line, f"the fix {row.fix!r} is not said in: {line}"
    return line


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(name, work, monkeypatch, capsys):
    row = ROWS[name]
    monkeypatch.chdir(work)
    monkeypatch.delenv("AUTOSCALE_POLICY_PATH", raising=False)
    before = _snapshot(work)
    try:
        rc = main(list(row.argv))
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    _check(row, rc, capsys.readouterr().err)
    if _snapshot(work) != before:
        gc.collect()  # closes SQLite's connections (and its -wal/-shm files), as an exit does
    assert _snapshot(work) == before  # nothing written, changed or removed


def test_there_are_at_least_30_rows_across_every_kind():
    kinds = {name.split(":")[0] for name in ROWS}
    assert kinds == {"spec", "suite", "policy", "cli", "storage"} and len(ROWS) >= 30


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["spec: a key given twice", "suite: exclude typo", "policy: weights cut short",
     "cli: trials not a number", "storage: server not running"],
)  # fmt: skip
def test_rows_in_real_processes(name, work):
    """The same line and status from a real ``autoscale`` process."""
    row = ROWS[name]
    before = _snapshot(work)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("AUTOSCALE_POLICY_PATH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "autoscale.cli", *row.argv],
        cwd=work, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    _check(row, proc.returncode, proc.stderr)
    assert _snapshot(work) == before


def _prefixes(text: str) -> list[str]:
    lines = text.splitlines(keepends=True)
    cuts = [len("".join(lines[:k])) for k in range(len(lines))]
    return [text[:c] for c in cuts] + [text[: c + 7] for c in cuts]  # at and inside each line


@pytest.mark.parametrize("kind", ["env spec", "suite spec", "manifest"])
def test_every_file_cut_short_loads_or_is_one_line(kind, tmp_path):
    """A file written half-way (cut at the start of each line, and 7 characters into it) either
    still loads or is refused with one line: never another exception."""
    from autoscale.envs.suite import load_spec
    from autoscale.scalers.policies import load_policy

    source = {"env spec": GOOD_SPEC, "suite spec": GOOD_SUITE}.get(kind)
    if kind == "manifest":
        source = (PARAMETRIC / "policy.yaml").read_text()
    refused = 0
    for i, text in enumerate(_prefixes(source)):
        folder = tmp_path / f"cut{i}"
        folder.mkdir()
        path = folder / ("policy.yaml" if kind == "manifest" else "spec.yaml")
        path.write_text(text)
        try:
            if kind == "manifest":
                load_policy(folder, device="cpu")
            else:
                load_spec(path)
        except AutoscaleError as exc:
            refused += 1
            assert "\n" not in str(exc) and str(exc), (text, exc)
    assert refused > 0
