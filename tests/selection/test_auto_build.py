"""The ``auto`` build (:mod:`autoscale.selection`): what decides what ships, a whole build of a tiny
suite on real steps, from traces to the exported policy, and the proof that its test members
never influence the choice."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from autoscale.selection.auto import AutoBuild, BuildSettings, fresh_seeds, parse_extra, what_ships

ROOT = Path(__file__).resolve().parents[2]


def _stage(fails: set[str], ran: list[str], name: str):
    def judge(c: str) -> list[str]:
        ran.append(f"{name}:{c}")
        return [f"{name} fails {c}"] if c in fails else []

    return judge


def test_choose_ships_the_first_through_every_check_when_fresh_seeds_agree():
    ran: list[str] = []
    checks = [_stage({"a"}, ran, "bar"), _stage({"b"}, ran, "long")]
    pick, verdicts = what_ships(["a", "b", "c", "d"], checks, _stage(set(), ran, "fresh"))
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
    pick, verdicts = what_ships(
        ["a", "b"], [_stage(set(), ran, "bar")], _stage({"a"}, ran, "fresh")
    )
    assert pick is None
    assert verdicts == {"a": {"passed": False, "reasons": ["fresh fails a"]}}
    assert ran == ["bar:a", "fresh:a"]
    # nothing passes: nothing is measured on fresh seeds
    ran.clear()
    assert what_ships(["a"], [_stage({"a"}, ran, "bar")], _stage(set(), ran, "fresh"))[0] is None
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


TEST = ("mlp/token-sum", "cnn/clean")  # the tiny suite's test members, in the suite's order


def _tiny_suite():
    """One member of each kind, as envs/suite.yaml splits them: mlp/clean trains, autoencoder/clean
    validates, cnn/clean and mlp/token-sum test (a test workload, and a test scenario on a
    workload that trains)."""
    from autoscale.envs.suite import load_spec

    suite = load_spec(ROOT / "envs" / "suite.yaml")
    keep = ("autoencoder/clean", *TEST)
    return dataclasses.replace(
        suite,
        members=tuple(m for m in suite.members if m.name == "mlp/clean"),
        left_out=tuple(m for m in suite.left_out if m.name in keep),
    )


TINY = BuildSettings(
    timesteps=64,
    horizon=16,
    history=2,
    steps=8,
    no_harm_steps=16,
    long_steps=16,
    confirm_episodes=2,
    residual_timesteps=32,
    window=4,
)
EXTRAS = dict([parse_extra("torch:growth_interval=2000")])


class ReadWatch:
    """Every real training run a build starts (each real step of every stage goes through
    :class:`~autoscale.training.TrainingRun`), by the suite member whose workload it trains. Fails
    the build the moment a test member's workload runs before :func:`~autoscale.selection.auto.what_ships` has returned."""

    def __init__(self, suite, monkeypatch):
        from autoscale.selection import auto
        from autoscale.training import TrainingRun

        self.test = {self._key(m.workload): m.name for m in suite.test}
        self.chosen = False
        self.after_choice: list[str] = []  # test members' runs, in order
        real_init, real_choose = TrainingRun.__init__, auto.what_ships

        def init(run, spec, *args, **kwargs):
            member = self.test.get(self._key(spec))
            if member is not None:
                if not self.chosen:
                    pytest.fail(f"test member {member} evaluated before what_ships returned")
                self.after_choice.append(member)
            real_init(run, spec, *args, **kwargs)

        def choose_then_open(*args, **kwargs):
            out = real_choose(*args, **kwargs)
            self.chosen = True
            return out

        monkeypatch.setattr(TrainingRun, "__init__", init)
        monkeypatch.setattr(auto, "what_ships", choose_then_open)

    @staticmethod
    def _key(workload):
        return workload.model, workload.scenario, repr(sorted(workload.scenario_params.items()))


@pytest.fixture(scope="module")
def first_build(tmp_path_factory):
    """A whole build of the tiny suite from scratch (traces, agents, choice, test members), its
    test members' reads watched; ``(folder, build, result, reads)``."""
    tmp = tmp_path_factory.mktemp("auto")
    with pytest.MonkeyPatch.context() as mp:
        reads = ReadWatch(_tiny_suite(), mp)
        build = AutoBuild(
            _tiny_suite(), TINY, tmp / "cache", extras=EXTRAS, log=lambda t: None,
            no_harm_cache=tmp / "no-harm",
        )  # fmt: skip
        result = build.run()
    return tmp, build, result, reads


def _again(tmp, **kw) -> AutoBuild:
    """The same build, its agents reused from the first one's ledger (measuring again unless
    ``keep_measured``)."""
    kw.setdefault("keep_measured", False)
    return AutoBuild(
        _tiny_suite(), dataclasses.replace(TINY, reuse_agents=True), tmp / "cache", extras=EXTRAS,
        log=lambda t: None, no_harm_cache=tmp / "no-harm", **kw,
    )  # fmt: skip


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
def test_a_tiny_build_ships_the_first_candidate_through_every_check(first_build):
    """A whole build on real steps (one train, one validation and one test member, tiny
    budgets). A copy of torch's own rule is among the candidates, so at least it passes every
    check: the build must ship the first in the validation objective's order that does, with its
    evidence in the manifest."""
    from autoscale.scalers import make_scaler
    from autoscale.scalers.policies import read_manifest

    tmp_path, build, result, _ = first_build
    assert result.searched == ["mlp/clean"]
    assert result.left_out == ["mlp/token-sum", "autoencoder/clean", "cnn/clean"]  # suite order
    assert result.validation == ["autoencoder/clean"] and result.test == list(TEST)
    agents = {"rl-ppo-h2", "rl-dqn-h2", "rl-ppo-h1"}
    agents |= {f"{n}-now" for n in agents}  # each also acting at scale time
    agents |= {"rl-res-ppo-k4-knobs", "rl-res-dqn-k4-knobs"}  # residual, on auto, under knobs
    assert set(result.ranked) == agents | {"amax-history", "torch(growth_interval=2000)"}
    for name in ("rl-ppo-h1-now", "rl-dqn-h2-now"):  # they act at scale time, with drops
        p = read_manifest(tmp_path / "cache" / "policies" / name).parameters
        assert p["scale_time"] is True and p["action"]["drops"] == [4.0, 8.0, 12.0, 16.0]
    for name in ("rl-res-ppo-k4-knobs", "rl-res-dqn-k4-knobs"):  # an offset on auto, every 4 steps
        m = read_manifest(tmp_path / "cache" / "policies" / name)
        assert m.kind == "residual" and m.parameters["window"] == 4
        assert (
            m.workload["training"]["knobs"]["spike"] > 0
        )  # under drawn spikes: the skip bar binds
        assert m.parameters["base"]["parameters"]["guard_floor"] == 12.0  # the shipped auto's
    assert result.ranked_on == "validation"
    assert result.ranked == sorted(result.ranked, key=result.objective_validation.__getitem__)
    # every candidate has its objective on each kind of member, and the test one is reported
    for kind in (result.objective, result.objective_validation, result.objective_test):
        assert set(kind) == set(result.ranked) | {"torch"} and kind["torch"] == 0.0
    assert result.pick is not None and result.pick == result.chosen
    # everything ranked before the pick failed a check and says why; nothing after it was judged
    at = result.ranked.index(result.pick)
    for name in result.ranked[:at]:
        assert not result.verdicts[name]["passed"] and result.verdicts[name]["reasons"]
    assert set(result.verdicts) == set(result.ranked[: at + 1])
    assert result.verdicts[result.pick] == {"passed": True, "reasons": []}
    # the pick met the bar on the test instances of every member, test members included, and
    # on fresh seeds of the members it was chosen on
    assert set(result.acceptance[result.pick]) == {"mlp/clean", "autoencoder/clean", *TEST}
    assert all(a["met"] for a in result.acceptance[result.pick].values())
    assert set(result.evidence_acceptance) == {"mlp/clean", "autoencoder/clean"}
    assert all(a["met"] for a in result.evidence_acceptance.values())
    assert set(result.evidence) == {result.pick, "amax-history", "torch"}
    long = result.long_runs[result.pick]
    assert set(long.runs) == {"mlp/clean", "autoencoder/clean", *TEST}
    assert all(card["torch"]["card"].steps == 16 for card in long.runs.values())
    assert not any(long.harm.values())
    assert any((tmp_path / "no-harm").rglob("torch-*.json"))  # torch's runs, cached there

    # the hindsight limit of every member's held-out steps, and every candidate's share of it
    assert set(result.limits) == {"mlp/clean", "autoencoder/clean", *TEST}
    assert all(0.0 <= v <= 1.0 for v in result.limits.values())
    assert set(result.limit_shares) == set(result.ranked)
    assert set(result.limit_shares[result.pick]) == set(result.limits)
    sys.path.insert(0, str(ROOT / "experiments"))
    from auto_report import build_report

    text = "\n".join(build_report(result, None, EXTRAS, []))
    assert "## How close each candidate came: the share of the hindsight limit" in text
    assert "| mlp/clean | " in text.split("share of the hindsight limit")[1]

    manifest = build.export(result, tmp_path / "policies", "a test")
    again = read_manifest(tmp_path / "policies" / "auto")
    assert again.name == "auto" and again.workload["built_by"] == "a test"
    assert again.workload["members"] == ["mlp/clean"]
    assert again.workload["validation"] == ["autoencoder/clean"]
    assert again.workload["test"] == list(TEST)
    assert again.scorecard["selection"]["objective_test"] == pytest.approx(result.objective_test)
    assert again.scorecard["evidence"]["bar_met_on"] == ["mlp/clean", "autoencoder/clean"]
    assert set(again.scorecard["long_runs"]["members"]) == {"mlp/clean", "autoencoder/clean", *TEST}
    assert again.scorecard == manifest.scorecard
    scaler = make_scaler(str(tmp_path / "policies" / "auto"), device="cpu")
    assert scaler.get_scale() == pytest.approx(65536.0)

    # a second build with the same settings reuses the agents from the ledger, and, on the same
    # seeds, ranks and decides the same
    second = _again(tmp_path).run()
    assert set(second.agent_runs) == agents
    assert all(r["reused"] for r in second.agent_runs.values())
    assert "train rl-ppo-h2" not in second.timings
    assert second.objective == result.objective and second.pick == result.pick
    assert second.verdicts == result.verdicts


def _changed_test_cards(monkeypatch, test: list[str], change):
    """Make the build read, for its test members, ``change(scaler, card)`` in place of each of
    their real scorecards: their scores change, nothing else does."""
    from autoscale.selection import suite_eval

    real = suite_eval.held_out

    def held_out(suite, factories, steps, progress=True, members="all", measured=None):
        cards = real(suite, factories, steps, progress, members, measured)
        for scaler, by in cards.items():
            for m in set(by) & set(test):
                by[m] = [change(scaler, c) for c in by[m]]
        return cards

    monkeypatch.setattr(suite_eval, "held_out", held_out)


@pytest.mark.slow
def test_test_members_are_read_only_after_the_choice_and_never_change_it(first_build, monkeypatch):
    """The build reads a test member only once :func:`~autoscale.selection.auto.what_ships` has returned (:class:`ReadWatch`
    fails it otherwise), and then for every candidate; test scores that would rank another
    candidate first leave the choice as it was; a choice that misses the bar on a test member
    ships nothing, rather than the next candidate."""
    tmp, _, first, reads = first_build
    assert reads.chosen and set(reads.after_choice) == set(TEST)  # read, and only after
    assert set(first.cards["torch"]) == {"mlp/clean", "autoencoder/clean", *TEST}
    pick = first.pick
    assert pick is not None

    def others_lead(scaler, card):
        """Every other candidate perfect on the test member, the pick a little worse than it
        was, torch far worse (so the pick still meets the bar there)."""
        if scaler == "torch":
            r = dataclasses.replace
            return r(card, skip_rate=card.skip_rate + 0.5, precision_loss=card.precision_loss + 0.5)
        if scaler == pick:
            return dataclasses.replace(card, precision_loss=card.precision_loss + 0.01)
        return dataclasses.replace(card, skip_rate=0.0, precision_loss=0.0)

    with monkeypatch.context() as mp:
        reads = ReadWatch(_tiny_suite(), mp)
        _changed_test_cards(mp, first.test, others_lead)
        second = _again(tmp).run()
    assert set(reads.after_choice) == set(TEST)
    on_test = second.objective_test
    assert all(on_test[s] < on_test[pick] for s in second.ranked if s != pick)  # test: anyone else
    assert second.objective_validation == first.objective_validation
    assert second.ranked == first.ranked and second.chosen == first.chosen
    assert second.pick == pick and second.verdicts == first.verdicts  # ships what it did

    # the choice skipping more than torch on the test member: still the choice, nothing ships
    def pick_skips(scaler, card):
        return dataclasses.replace(card, skip_rate=card.skip_rate + 0.2) if scaler == pick else card

    with monkeypatch.context() as mp:
        ReadWatch(_tiny_suite(), mp)
        _changed_test_cards(mp, first.test, pick_skips)
        third = _again(tmp).run()
    assert third.chosen == pick and third.pick is None
    assert set(third.verdicts) == set(first.verdicts)  # the next candidate was not tried
    assert "on test members misses the bar on cnn/clean" in third.verdicts[pick]["reasons"]


@pytest.mark.slow
def test_a_build_run_again_reads_its_measurements_back_and_decides_the_same(
    first_build, monkeypatch
):
    """A stopped build resumes: every held-out episode, confirming set and long run the first
    build finished is read back (no real-step episode runs for them), and the build ranks and
    decides as it did."""
    from autoscale.envs import episodes

    tmp, _, first, _ = first_build
    driven = []
    real = episodes.drive_episode
    monkeypatch.setattr(
        episodes, "drive_episode", lambda *a, **k: driven.append(a[2]) or real(*a, **k)
    )
    build = _again(tmp, keep_measured=True)
    second = build.run()
    assert driven == [] and build.measured.hits > 0 and build.measured.stored == 0
    assert second.objective == first.objective and second.objective_test == first.objective_test
    assert second.ranked == first.ranked and second.pick == first.pick
    assert second.verdicts == first.verdicts
    long, again = first.long_runs[first.pick].runs, second.long_runs[second.pick].runs
    for member, by in long.items():
        for scaler, run in by.items():
            back = again[member][scaler]
            # by repr: a skipped step keeps NaN, which equals itself only there
            assert repr(back["card"]) == repr(run["card"]) and repr(back["kept"]) == repr(
                run["kept"]
            )
            assert repr([r.to_dict() for r in back["records"]]) == repr(
                [r.to_dict() for r in run["records"]]
            )


def test_measurements_are_keyed_by_what_decides_them(tmp_path):
    """Another identity or other settings miss; a candidate without an identity is never
    stored; a partial file reads as missing."""
    from autoscale.selection.measured import Measured

    m = Measured(tmp_path, {"a": "rule amax-loss []", "b": "rule amax-loss [('probe_after', 8)]"})
    at = m.path("a", "episode", 64)
    assert at is not None and m.get(at) is None
    m.put(at, {"x": float("nan"), "y": [1.0, float("inf")]})
    back = m.get(at)
    assert back["y"] == [1.0, float("inf")] and back["x"] != back["x"]
    assert m.path("b", "episode", 64) != at and m.path("a", "episode", 128) != at
    assert m.path("unnamed", "episode", 64) is None
    m.put(None, {"x": 1})  # not stored, no error
    other = Measured(tmp_path, m.identities)
    other.code = "another version"
    assert other.path("a", "episode", 64) != at
    at.write_text('{"x": ')  # a file cut short
    assert m.get(at) is None
