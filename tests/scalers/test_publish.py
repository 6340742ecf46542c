"""Publishing a policy when other exports run at once or were killed half-way: one whole policy
results, nothing half-written is ever listed or loaded, and what a killed export left is cleaned
up (or put back) by the next publish of that name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

import autoscale
from autoscale.errors import ConfigError, PolicyError
from autoscale.processes import host_name
from autoscale.scalers import policies
from autoscale.search.export import export_parametric


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _host() -> str:
    return "".join(c if c.isalnum() or c == "-" else "-" for c in host_name())


def _whole(folder: Path, growth_interval: int | None = None) -> None:
    manifest = policies.read_manifest(folder)
    assert manifest.family == "torch"
    if growth_interval is not None:
        assert manifest.parameters["growth_interval"] == growth_interval
    assert (
        autoscale.get_scaler(str(folder), device="cpu").get_growth_interval()
        == (manifest.parameters["growth_interval"])
    )


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _race(root: Path, force: bool) -> dict[int, object]:
    """Six threads stage a policy named ``same`` in ``root``, wait for each other, then publish."""
    barrier = threading.Barrier(6)
    outcome: dict[int, object] = {}

    def publish(k: int) -> None:
        try:
            with policies.staged_policy("same", root, force=force) as tmp:
                text = yaml.safe_dump(
                    {"name": "same", "kind": "parametric", "family": "torch",
                     "parameters": {"growth_interval": 100 + k}}
                )  # fmt: skip
                (tmp / "policy.yaml").write_text(text)
                barrier.wait()  # all staged: now the publishes race
            outcome[k] = "ok"
        except Exception as exc:  # anything but a one-line refusal fails the test below
            outcome[k] = exc

    threads = [threading.Thread(target=publish, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


@pytest.mark.parametrize("force", [False, True], ids=["no-force", "force"])
def test_concurrent_publishes_leave_one_whole_policy(tmp_path, force, request):
    """Six threads publish the same name at once, 30 times over (the renames race for real):
    each time one whole policy and nothing else is left; without ``force`` exactly one
    publish succeeds and the others are refused in one line."""
    for round_no in range(30):
        root = tmp_path / f"round{round_no}"
        outcome = _race(root, force)
        assert _entries(root) == ["same"]  # no staging or backup folder left
        winners = [k for k, v in outcome.items() if v == "ok"]
        _whole(root / "same")
        if force:
            assert len(winners) == 6
        else:
            assert len(winners) == 1
            _whole(root / "same", 100 + winners[0])
            assert len(outcome) == 6
            for k, v in outcome.items():
                if k not in winners:
                    assert isinstance(v, ConfigError), repr(v)
                    assert "already exists; choose another name or pass --force" in str(v)
    from tests.search.faults import FaultRecord, report

    report(
        FaultRecord(
            request.node.name,
            f"6 threads publishing one name at once ({'force' if force else 'no force'})",
            "policy folder",
            injected=30,
            outcome="one whole policy each time, no staging folder left",
        )
    )


def test_a_policy_published_while_staging_refuses_without_force(tmp_path):
    """Between the first check and the rename another process publishes the name: refused in
    one line, the other's policy kept whole."""
    export_parametric("torch", {"growth_interval": 7}, "race", out_dir=tmp_path)
    other = tmp_path / "race"
    moved = tmp_path / "elsewhere"
    other.rename(moved)  # not there when the export starts...
    with (
        pytest.raises(ConfigError, match=r"'.*race' already exists; choose another name"),
        policies.staged_policy("race", tmp_path) as tmp,
    ):
        (tmp / "policy.yaml").write_text("name: race\nkind: parametric\nfamily: torch\n")
        moved.rename(other)  # ...and published by someone else before it ends
    assert _entries(tmp_path) == ["race"]
    _whole(other, 7)


def test_hidden_staging_folders_are_not_policies(tmp_path, monkeypatch):
    monkeypatch.setenv(policies.POLICY_PATH_ENV, str(tmp_path))
    export_parametric("torch", {"growth_interval": 9}, "kept", out_dir=tmp_path)
    staging = tmp_path / f".kept.staging.{_host()}.{_dead_pid()}.abc123"
    staging.mkdir()
    (staging / "policy.yaml").write_text((tmp_path / "kept" / "policy.yaml").read_text())
    names = policies.policy_names()
    assert "kept" in names and not [n for n in names if n.startswith(".")]
    assert not [name for name, *_ in policies.policy_rows() if name.startswith(".")]


@pytest.mark.parametrize("kind", ["staging", "old"])
def test_the_next_publish_cleans_what_a_killed_one_left(tmp_path, kind):
    """A staging folder of a dead process is removed; a backup of one (killed between moving the
    old policy away and moving the new one in) is put back first, then replaced as asked."""
    dead = _dead_pid()
    left = tmp_path / f".p.{kind}.{_host()}.{dead}.xyz_1"
    if kind == "staging":
        left.mkdir()
        (left / "policy.yaml").write_text("name: p\n")
    else:
        export_parametric("torch", {"growth_interval": 5}, "p", out_dir=tmp_path)
        left.mkdir()
        (tmp_path / "p").rename(left / "p")
    alive = tmp_path / f".p.staging.{_host()}.1.live"  # pid 1 runs: another export, in progress
    alive.mkdir()

    if kind == "old":  # the backed-up policy is back, so a publish without force is refused
        with pytest.raises(ConfigError, match="already exists"):
            export_parametric("torch", {"growth_interval": 6}, "p", out_dir=tmp_path)
        _whole(tmp_path / "p", 5)
    export_parametric("torch", {"growth_interval": 6}, "p", out_dir=tmp_path, force=True)
    assert _entries(tmp_path) == sorted([alive.name, "p"])
    _whole(tmp_path / "p", 6)


def test_a_policy_folder_written_half_way_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(policies.POLICY_PATH_ENV, str(tmp_path))
    (tmp_path / "nomanifest").mkdir()
    (tmp_path / "nomanifest" / "weights.pt").write_bytes(b"\x80\x02")
    with pytest.raises(PolicyError) as info:
        autoscale.get_scaler("nomanifest", device="cpu")
    assert str(info.value) == (
        f"policy folder '{tmp_path / 'nomanifest'}' has no policy.yaml (a copy or an export that "
        "did not finish); export the policy again, or remove the folder"
    )
    export_parametric("torch", {"growth_interval": 9}, "cut", out_dir=tmp_path)
    manifest = tmp_path / "cut" / "policy.yaml"
    manifest.write_text(manifest.read_text()[:25])
    with pytest.raises(PolicyError, match=r"'.*cut/policy.yaml'.*re-export the policy"):
        autoscale.get_scaler("cut", device="cpu")
    from autoscale.search.export import check_export_target

    with pytest.raises(ConfigError) as info:
        check_export_target("cut", tmp_path, "some-study", force=False)
    assert "already exists and is not a readable policy" in str(info.value)
    assert "remove it, choose another name (--export NAME) or pass --force" in str(info.value)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------- real processes
_KILL_AT = {
    # the policy staged and its manifest written, not published yet
    "staged": """
import autoscale.search.export as export
real = export.write_manifest
def write_then_die(path, manifest):
    real(path, manifest)
    os.kill(os.getpid(), signal.SIGKILL)
export.write_manifest = write_then_die
""",
    # the old policy renamed away, the new one not renamed in yet (a forced replace)
    "between renames": """
real = os.replace
def replace_then_die(src, dst):
    real(src, dst)
    if ".old." in str(dst):
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace_then_die
""",
}


def _export_script(kill: str) -> str:
    return (
        "import os, signal, sys\n"
        + _KILL_AT[kill]
        + "from autoscale.search.export import export_parametric\n"
        "export_parametric('torch', {'growth_interval': 2}, 'p', out_dir=sys.argv[1], force=True)\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize("kill", list(_KILL_AT))
def test_an_export_killed_half_way_publishes_nothing_half(
    tmp_path, monkeypatch, kill, capsys, request
):
    """A real process exporting over a policy is killed with SIGKILL half-way: the policy folder
    never holds half a policy, ``autoscale list`` shows no staging folder, and the next export
    of the name cleans up (putting the old policy back first where it had been moved away)."""
    from autoscale.cli import main
    from tests.search.faults import FaultRecord, report

    monkeypatch.setenv(policies.POLICY_PATH_ENV, str(tmp_path))
    export_parametric("torch", {"growth_interval": 1}, "p", out_dir=tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _export_script(kill), str(tmp_path)], env=env, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL
    left = sorted(p.split(".")[2] for p in _entries(tmp_path) if p.startswith("."))
    # what the killed process staged (and the old policy it had moved away)
    assert left == (["staging"] if kill == "staged" else ["old", "staging"])
    if kill == "staged":
        _whole(tmp_path / "p", 1)  # the old policy, untouched
    else:
        assert not (tmp_path / "p").exists()  # moved away: gone, not half there
    assert main(["list", "--json"]) == 0
    listed = [i["name"] for i in json.loads(capsys.readouterr().out)]
    assert not [n for n in listed if n.startswith(".")]
    assert ("p" in listed) == (kill == "staged")

    export_parametric("torch", {"growth_interval": 3}, "p", out_dir=tmp_path, force=True)
    assert _entries(tmp_path) == ["p"]
    _whole(tmp_path / "p", 3)
    report(
        FaultRecord(
            request.node.name,
            f"SIGKILL of an export {kill}",
            "policy folder",
            outcome="no half policy seen; the next export cleaned up"
            + (" and put the old policy back first" if kill != "staged" else ""),
        )
    )


_RACER = """
import json, os, sys, time
from pathlib import Path
from autoscale.search.export import export_parametric
from autoscale.errors import AutoscaleError
root, k, rounds, force = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
for r in range(rounds):
    (root / f"ready-{r}-{k}").touch()
    while not (root / f"go-{r}").exists():
        time.sleep(0.001)
    try:
        export_parametric("torch", {"growth_interval": 100 + k}, "same", out_dir=root / f"r{r}", force=force)
        result = "ok"
    except AutoscaleError as exc:
        result = str(exc)
    # written whole, then renamed: the test reads it as soon as the name exists
    (root / f"done-{r}-{k}.part").write_text(result)
    os.replace(root / f"done-{r}-{k}.part", root / f"done-{r}-{k}")
"""


@pytest.mark.slow
@pytest.mark.parametrize("force", [False, True], ids=["no-force", "force"])
def test_processes_exporting_one_name_at_once(tmp_path, force, request):
    """Four processes export the same name the moment a file appears, eight times over: each
    time one whole policy results; without ``force`` exactly one export succeeds and the others
    are refused in one line, with it every export succeeds and the last one stays."""
    from tests.search.faults import FaultRecord, report, wait_for

    n, rounds = 4, 8
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = tmp_path / "racer.py"
    script.write_text(_RACER)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), str(k), str(rounds), str(int(force))],
            env=env,
        )
        for k in range(n)
    ]
    for r in range(rounds):
        wait_for(f"{n} exporters ready", lambda r=r: len(list(tmp_path.glob(f"ready-{r}-*"))) == n)
        (tmp_path / f"go-{r}").touch()
        wait_for(
            f"{n} exports done",
            lambda r=r: all((tmp_path / f"done-{r}-{k}").exists() for k in range(n)),
        )
        results = [(tmp_path / f"done-{r}-{k}").read_text() for k in range(n)]
        assert _entries(tmp_path / f"r{r}") == ["same"]
        _whole(tmp_path / f"r{r}" / "same")
        winners = [k for k, text in enumerate(results) if text == "ok"]
        if force:
            assert winners == list(range(n))
        else:
            assert len(winners) == 1, results
            _whole(tmp_path / f"r{r}" / "same", 100 + winners[0])
            assert all(
                "already exists; choose another name or pass --force" in text and "\n" not in text
                for k, text in enumerate(results)
                if k not in winners
            ), results
    assert [p.wait(timeout=120) for p in procs] == [0] * n
    report(
        FaultRecord(
            request.node.name,
            f"{n} processes exporting one name at once ({'--force' if force else 'no --force'})",
            "policy folder",
            injected=rounds,
            outcome="one whole policy each time; "
            + ("every export succeeded" if force else "the others refused in one line"),
        )
    )
