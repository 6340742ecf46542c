"""Publishing a policy when other exports run at once or were killed half-way: one whole policy
results, nothing half-written is ever listed or loaded, and what a killed export left is cleaned
up (or put back) by the next publish of that name."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

import autoscale
from autoscale.agents.export import export_parametric
from autoscale.errors import ConfigError, PolicyError
from autoscale.processes import host_name
from autoscale.scalers import policies


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
def test_concurrent_publishes_leave_one_whole_policy(tmp_path, force):
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
    assert not [i.name for i in policies.policy_infos() if i.name.startswith(".")]


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
    assert "remove it, choose another name or pass --force" in str(info.value)
    assert "\n" not in str(info.value)
