"""The ``auto`` build (:mod:`autoscale.build`): what decides what ships, and a whole build of a
tiny suite on real steps, from traces to the exported policy."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autoscale.build.auto import AutoBuild, BuildSettings, choose, fresh_seeds, parse_extra

ROOT = Path(__file__).resolve().parents[2]


def _stage(fails: set[str], ran: list[str], name: str):
    def judge(c: str) -> list[str]:
        ran.append(f"{name}:{c}")
        return [f"{name} fails {c}"] if c in fails else []

    return judge


def test_choose_ships_the_first_through_every_check_when_fresh_seeds_agree():
    ran: list[str] = []
    checks = [_stage({"a"}, ran, "bar"), _stage({"b"}, ran, "long")]
    pick, verdicts = choose(["a", "b", "c", "d"], checks, _stage(set(), ran, "fresh"))
    assert pick == "c"
    assert verdicts == {
        "a": {"passed": False, "reasons": ["bar fails a"]},
        "b": {"passed": False, "reasons": ["long fails b"]},
        "c": {"passed": True, "reasons": []},
    }
    # fresh seeds are measured for the pick alone, after every other check
    assert ran == ["bar:a", "bar:b", "long:b", "bar:c", "long:c", "fresh:c"]


def test_choose_ships_nothing_when_the_pick_misses_on_fresh_seeds():
    """Fresh seeds are spent once: the next candidate is not tried on seeds already seen."""
    ran: list[str] = []
    pick, verdicts = choose(["a", "b"], [_stage(set(), ran, "bar")], _stage({"a"}, ran, "fresh"))
    assert pick is None
    assert verdicts == {"a": {"passed": False, "reasons": ["fresh fails a"]}}
    assert ran == ["bar:a", "fresh:a"]
    # nothing passes: nothing is measured on fresh seeds
    ran.clear()
    assert choose(["a"], [_stage({"a"}, ran, "bar")], _stage(set(), ran, "fresh"))[0] is None
    assert ran == ["bar:a"]


def test_parse_extra_labels_a_candidate_and_names_a_bad_value():
    assert parse_extra("amax-history") == ("amax-history", ("amax-history", {}))
    label, (rule, params) = parse_extra("amax-loss:probe_after=8,guard_margin=2.5")
    assert label == "amax-loss(probe_after=8, guard_margin=2.5)"
    assert (rule, params) == ("amax-loss", {"probe_after": 8, "guard_margin": 2.5})
    with pytest.raises(ValueError, match=r"probe_after='eight' is not a number"):
        parse_extra("amax-loss:probe_after=eight")


def test_fresh_seeds_are_the_test_seeds_moved_by_a_thousand():
    from autoscale.envs.suite import load_spec

    suite = load_spec(ROOT / "envs" / "suite.yaml")
    fresh = fresh_seeds(suite)
    for before, after in zip(suite.members + suite.left_out, fresh.members + fresh.left_out):
        assert [i.seed + 1000 for i in before.instances["test"]] == [
            i.seed for i in after.instances["test"]
        ]
        assert before.instances["train"] == after.instances["train"]


def _tiny_suite():
    from autoscale.envs.suite import load_spec

    suite = load_spec(ROOT / "envs" / "suite.yaml")
    return dataclasses.replace(
        suite,
        members=tuple(m for m in suite.members if m.name == "mlp/clean"),
        left_out=tuple(m for m in suite.left_out if m.name == "autoencoder/clean"),
    )


def test_a_bad_extra_candidate_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="no-such-knob"):
        AutoBuild(
            _tiny_suite(),
            BuildSettings(),
            tmp_path,
            extras=dict([parse_extra("torch:no-such-knob=1")]),
        )
    assert not any(tmp_path.iterdir())  # nothing recorded, trained or written


@pytest.mark.slow
def test_a_tiny_build_ships_the_first_candidate_through_every_check(tmp_path):
    """A whole build on real steps (one searched and one left-out member, tiny budgets). A copy
    of torch's own rule is among the candidates, so at least it passes every check: the build
    must ship the first in the objective's order that does, with its evidence in the manifest."""
    from autoscale.scalers import get_scaler
    from autoscale.scalers.policies import read_manifest

    settings = BuildSettings(
        timesteps=64, horizon=16, history=2, steps=8, gate_steps=16, long_steps=16,
        confirm_episodes=2,
    )  # fmt: skip
    extras = dict([parse_extra("torch:growth_interval=2000")])
    lines: list[str] = []
    build = AutoBuild(
        _tiny_suite(), settings, tmp_path / "cache", extras=extras, log=lines.append,
        no_harm_cache=tmp_path / "no-harm",
    )  # fmt: skip
    result = build.run()

    assert result.searched == ["mlp/clean"] and result.left_out == ["autoencoder/clean"]
    agents = {"rl-ppo-h2", "rl-dqn-h2", "rl-ppo-h1"}
    agents |= {f"{n}-now" for n in agents}  # each also acting at scale time
    assert set(result.ranked) == agents | {"amax-history", "torch(growth_interval=2000)"}
    for name in ("rl-ppo-h1-now", "rl-dqn-h2-now"):  # they act at scale time, with drops
        p = read_manifest(tmp_path / "cache" / "policies" / name).parameters
        assert p["scale_time"] is True and p["action"]["drops"] == [4.0, 8.0, 12.0, 16.0]
    assert result.ranked == sorted(result.ranked, key=result.objective.__getitem__)
    assert result.pick is not None
    # everything ranked before the pick failed a check and says why; nothing after it was judged
    at = result.ranked.index(result.pick)
    for name in result.ranked[:at]:
        assert not result.verdicts[name]["passed"] and result.verdicts[name]["reasons"]
    assert set(result.verdicts) == set(result.ranked[: at + 1])
    assert result.verdicts[result.pick] == {"passed": True, "reasons": []}
    # the pick met the bar on the test instances and on fresh seeds, every member
    assert all(a["met"] for a in result.acceptance[result.pick].values())
    assert set(result.evidence_acceptance) == {"mlp/clean", "autoencoder/clean"}
    assert all(a["met"] for a in result.evidence_acceptance.values())
    assert set(result.evidence) == {result.pick, "amax-history", "torch"}
    long = result.long_runs[result.pick]
    assert set(long.runs) == {"mlp/clean", "autoencoder/clean"}
    assert all(card["torch"]["card"].steps == 16 for card in long.runs.values())
    assert not any(long.harm.values())
    assert any((tmp_path / "no-harm").rglob("torch-*.json"))  # torch's runs, cached there

    manifest = build.export(result, tmp_path / "policies", "a test")
    again = read_manifest(tmp_path / "policies" / "auto")
    assert again.name == "auto" and again.workload["built_by"] == "a test"
    assert again.workload["members"] == ["mlp/clean"]
    assert again.scorecard["evidence"]["bar_met_on"] == ["mlp/clean", "autoencoder/clean"]
    assert set(again.scorecard["long_runs"]["members"]) == {"mlp/clean", "autoencoder/clean"}
    assert again.scorecard == manifest.scorecard
    scaler = get_scaler(str(tmp_path / "policies" / "auto"), device="cpu")
    assert scaler.get_scale() == pytest.approx(65536.0)

    # a second build with the same settings reuses the agents from the ledger, and, on the same
    # seeds, ranks and decides the same
    again_build = AutoBuild(
        _tiny_suite(), dataclasses.replace(settings, reuse_agents=True), tmp_path / "cache",
        extras=extras, log=lines.append, no_harm_cache=tmp_path / "no-harm",
    )  # fmt: skip
    second = again_build.run()
    assert set(second.agent_runs) == agents
    assert all(r["reused"] for r in second.agent_runs.values())
    assert "train rl-ppo-h2" not in second.timings
    assert second.objective == result.objective and second.pick == result.pick
    assert second.verdicts == result.verdicts
