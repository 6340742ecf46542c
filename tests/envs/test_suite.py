"""Suite specs: members from workloads x scenarios, the split into train, validation and test
members (and the older left-out form), errors; the suite env."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from autoscale.envs.suite import SuiteSpec, as_suite, load_spec
from autoscale.envs.suite_env import SuiteEnv, split_instance, suite_instances
from autoscale.errors import ConfigError, UnknownNameError

ROOT = Path(__file__).resolve().parents[2]


def tiny_suite(**changes) -> dict:
    data = {
        "name": "tiny-suite",
        "workload": {"dtype": "fp16", "lr": 0.001},
        "suite": {
            "workloads": {
                "mlp": {"model": "mlp", "batch_size": 16},
                "ae": {"model": "autoencoder"},
            },
            "scenarios": {
                "clean": {},
                "bad-batches": {"every": 4},
                "small": {"scenario": "small-grads"},
            },
            "split": {"validation": {"workloads": ["ae"]}, "test": {"scenarios": ["small"]}},
        },
        "episode": {
            "steps": 8,
            "horizon": 16,
            "init_scale": 65536,
            "min_scale": 1.0,
            "max_scale": 2**30,
        },
        "instances": {"train": [{"seed": 0}, {"seed": 1}], "test": [{"seed": 5}]},
    }
    for key, value in changes.items():
        node = data
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        if value is None:
            node.pop(last)
        else:
            node[last] = value
    return data


def test_members_are_workloads_times_scenarios_split_in_train_validation_and_test():
    suite = load_spec(tiny_suite())
    assert isinstance(suite, SuiteSpec)
    assert [m.name for m in suite.members] == ["mlp/clean", "mlp/bad-batches"]
    assert [m.name for m in suite.left_out] == [
        "mlp/small", "ae/clean", "ae/bad-batches", "ae/small",
    ]  # fmt: skip
    # a member touching a test workload or scenario is test, even when validation names it too
    assert [m.name for m in suite.validation] == ["ae/clean", "ae/bad-batches"]
    assert [m.name for m in suite.test] == ["mlp/small", "ae/small"]
    bad = suite.member("mlp/bad-batches")
    assert bad.workload.model == "mlp" and bad.workload.batch_size == 16
    assert bad.workload.scenario_params == {"every": 4} and bad.workload.dtype == "fp16"
    assert suite.member("ae/small").workload.scenario == "small-grads"
    assert suite.episode.horizon == 16 and not suite.is_single
    assert SuiteSpec.from_dict(suite.to_dict()) == suite
    assert SuiteSpec.from_dict(suite.to_dict()).test == suite.test
    single = as_suite(load_spec("bad-batches"))
    assert single.is_single and single.members[0].name == "bad-batches"
    assert single.validation == single.test == ()
    # narrowed with dataclasses.replace, the members kept keep their kind
    narrow = replace(suite, left_out=(suite.member("ae/clean"), suite.member("ae/small")))
    assert [m.name for m in narrow.validation] == ["ae/clean"]
    assert [m.name for m in narrow.test] == ["ae/small"]
    assert replace(suite, left_out=()).test_names == frozenset()


def test_the_older_left_out_form_loads_as_test_members():
    old = tiny_suite(**{"suite.split": None})
    old["suite"]["left_out"] = {"workloads": ["ae"], "members": ["mlp/bad-batches"]}
    suite = load_spec(old)
    assert [m.name for m in suite.members] == ["mlp/clean", "mlp/small"]
    assert suite.validation == ()
    assert [m.name for m in suite.test] == [
        "mlp/bad-batches",
        "ae/clean",
        "ae/bad-batches",
        "ae/small",
    ]
    # a suite stored before the split (no test list) reads the same way
    stored = suite.to_dict()
    del stored["test"]
    assert SuiteSpec.from_dict(stored) == suite
    with pytest.raises(ConfigError, match="older form of suite.split.test; give one of them"):
        load_spec({**old, "suite": {**old["suite"], "split": {"test": {"workloads": ["ae"]}}}})


def test_the_shipped_suite_crosses_five_workloads_with_seven_scenarios():
    suite = load_spec("suite")
    models = {m.workload.model for m in suite.members + suite.left_out}
    scenarios = {m.workload.scenario for m in suite.members + suite.left_out}
    cnn, denoise = (
        str((ROOT / "experiments" / "workloads" / f"{name}.py").resolve()) + ":make"
        for name in ("cnn", "denoise")
    )
    # the user-style workloads read from envs/'s folder
    assert models == {"gpt2-tiny", "mlp", "autoencoder", cnn, denoise}
    assert scenarios == {
        "clean",
        "bad-batches",
        "small-grads",
        "moving",
        "preference",
        "rl-finetune",
        "token-sum",
    }
    # a user workload takes no preference; RL fine-tuning samples from gpt2-tiny alone
    assert len(suite.members) + len(suite.left_out) == 29
    assert not {"cnn/preference", "denoise/preference"} & {m.name for m in suite.left_out}
    assert [m.name for m in suite.left_out if m.workload.scenario == "rl-finetune"] == [
        "gpt2-tiny/rl-finetune"
    ]
    # validation holds a workload and scenarios no train member has; test holds workloads and a
    # scenario no other member has (rl-finetune, a test member until it shaped a rule, chooses now)
    train, val, test = suite.members, suite.validation, suite.test
    assert all(m.workload.model not in ("autoencoder", cnn, denoise) for m in train)
    assert all(m.workload.scenario not in ("preference", "rl-finetune") for m in train)
    assert {m.workload.model for m in val} - {m.workload.model for m in train} == {"autoencoder"}
    others = {m.workload.model for m in train + val}
    assert {m.workload.model for m in test} - others == {cnn, denoise}
    others = {m.workload.scenario for m in train + val}
    assert {m.workload.scenario for m in test} - others == {"token-sum"}
    assert {m.name for m in test if m.workload.scenario == "token-sum"} == {
        f"{w}/token-sum" for w in ("gpt2-tiny", "mlp", "autoencoder", "cnn", "denoise")
    }
    assert {m.workload.scenario for m in val} - {m.workload.scenario for m in train} == {
        "preference",
        "rl-finetune",
    }
    for m in suite.members:
        train = {i.seed for i in m.instances["train"]}
        assert train.isdisjoint(i.seed for i in m.instances["test"])


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {"suite.workloads.mlp": {"model": "mlpp"}},
            UnknownNameError,
            r"member 'mlp/clean'.*unknown model 'mlpp'; did you mean 'mlp'",
        ),
        (
            {"suite.scenarios.clean": {"scenario": "clena"}},
            UnknownNameError,
            r"member 'mlp/clean'.*unknown scenario 'clena'; did you mean 'clean'",
        ),
        (
            {"suite.split": {"validation": {"workloads": ["mpl"]}}},
            UnknownNameError,
            r"unknown workload 'mpl'; did you mean 'mlp'",
        ),
        (
            {"suite.split": {"test": {"workloads": ["mlp", "ae"]}}},
            ConfigError,
            r"no member to search on",
        ),
        (
            {"suite.split": {"test": {"members": ["mlp/clen"]}}},
            UnknownNameError,
            r"unknown member 'mlp/clen'; did you mean 'mlp/clean'",
        ),
        ({"suite.split": {"tset": {}}}, ConfigError, r"unknown key 'tset'; did you mean 'test'"),
        (
            {"instances": {"train": [{"seed": 0}], "test": []}},
            ConfigError,
            r"instance set 'test' is missing or empty",
        ),
        (
            {"instances": {"train": [{"seed": 0}], "test": [{"seed": 0}]}},
            ConfigError,
            r"repeat a train instance's seed and start",
        ),
        ({"suite.workloads": {}}, ConfigError, r"suite.workloads must be a non-empty mapping"),
        ({"suite.exclude": ["mlp/nothing"]}, UnknownNameError, r"unknown member 'mlp/nothing'"),
        ({"suite.colour": 1}, ConfigError, r"unknown key 'colour'"),
    ],
)
def test_bad_suites_say_which_member_and_what_to_fix(change, error, match):
    with pytest.raises(error, match=match):
        load_spec(tiny_suite(**change))


@pytest.mark.slow  # a subprocess or a 124M model: seconds
def test_a_bad_suite_file_is_one_line_exit_2_and_writes_nothing(tmp_path):
    from tests.search.conftest import run_cli

    bad = tiny_suite(**{"suite.workloads.mlp": {"model": "mlpp"}})
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    empty = tiny_suite(instances={"train": [{"seed": 0}], "test": []})
    (tmp_path / "empty.yaml").write_text(yaml.safe_dump(empty))
    for name, fragment in (
        ("bad.yaml", "unknown model 'mlpp'"),
        ("empty.yaml", "'test' is missing or empty"),
    ):
        run = run_cli("search", "--env", str(tmp_path / name), "--budget", "30s", cwd=tmp_path)
        assert run.rc == 2 and "Traceback" not in run.err
        errors = [line for line in run.err.splitlines() if "error:" in line]
        assert len(errors) == 1 and fragment in errors[0], run.err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bad.yaml",
        "empty.yaml",
    ]  # nothing written


def test_model_and_scenario_flags_do_not_apply_to_a_suite():
    from autoscale.search.workload import base_spec

    with pytest.raises(ConfigError, match="do not apply to the suite 'suite'"):
        base_spec("suite", model="mlp")
    bf16 = base_spec("suite", dtype="bf16")
    assert {m.workload.dtype for m in bf16.members} == {"bf16"}


def test_the_suite_env_draws_episodes_over_every_member(tiny_spec):
    suite = load_spec(tiny_suite())
    env = SuiteEnv(suite, "train")
    assert env.observation_space.shape == (11,) and env.action_space.n == 5
    names = suite_instances(suite, "train")
    assert env.instance_names == names and len(names) == 4
    members = set()
    for seed in range(8):
        obs, info = env.reset(seed=seed)
        members.add(info["member"])
        assert info["instance"] in names and np.all(np.isfinite(obs))
    assert members == {"mlp/clean", "mlp/bad-batches"}
    obs, info = env.reset(options={"instance": "mlp/bad-batches:train-s1-t0"})
    assert info["member"] == "mlp/bad-batches"
    for _ in range(suite.episode.steps):
        obs, reward, term, trunc, info = env.step(2)
        assert info["member"] == "mlp/bad-batches"
    assert trunc and env.scorecard().skipped >= 1  # a bad batch every 4 steps
    assert split_instance("mlp/clean:test-s5-t0") == ("mlp/clean", "test-s5-t0")
    with pytest.raises(UnknownNameError, match="unknown suite member 'mlp/dirty'"):
        env.reset(options={"instance": "mlp/dirty:train-s0-t0"})


@pytest.mark.slow
def test_train_agent_accepts_a_suite_on_replay(tmp_path):
    from autoscale.agents.train import train_agent
    from autoscale.envs.traces import load_suite_traces, record_suite
    from autoscale.scalers import make_scaler
    from autoscale.scalers.policies import read_manifest

    suite = load_spec(tiny_suite())
    record_suite(suite, 16, tmp_path / "traces")
    assert set(load_suite_traces(suite, tmp_path / "traces")) == {
        m.name for m in suite.members + suite.left_out
    }
    result = train_agent(
        suite, "ppo", 256, replay=tmp_path / "traces", export_name="suite-ppo",
        export_dir=str(tmp_path / "policies"),
    )  # fmt: skip
    m = read_manifest(result.policy_dir)
    assert m.workload["suite"] == "tiny-suite" and m.workload["members"] == [
        "mlp/clean", "mlp/bad-batches",
    ]  # fmt: skip
    assert "trained on suite 'tiny-suite' (2 members)" in m.describe()
    assert make_scaler(str(result.policy_dir), device="cpu").name == "suite-ppo"


def test_a_workload_file_in_a_spec_is_read_from_the_spec_s_folder(tmp_path, monkeypatch):
    """``model: ../work/cnn.py:make`` in a suite or env spec means the file beside the spec, from
    any working directory; a module reference and a path that is not there stay as written."""
    from autoscale.envs.spec import load_env_spec

    (tmp_path / "work").mkdir()
    (tmp_path / "specs").mkdir()
    cnn = (ROOT / "experiments" / "workloads" / "cnn.py").read_text()
    (tmp_path / "work" / "cnn.py").write_text(cnn)
    seeds = "instances: {train: [{seed: 0}], test: [{seed: 1}]}\n"
    (tmp_path / "specs" / "s.yaml").write_text(
        "suite:\n  workloads:\n    cnn: {model: ../work/cnn.py:make}\n"
        "    mod: {model: mypkg.train:make}\n  scenarios: {clean: {}}\n" + seeds
    )
    (tmp_path / "specs" / "e.yaml").write_text("workload: {model: ../work/cnn.py:make}\n" + seeds)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    want = f"{(tmp_path / 'work' / 'cnn.py').resolve()}:make"
    suite = load_spec(tmp_path / "specs" / "s.yaml")
    assert {m.name: m.workload.model for m in suite.members} == {
        "cnn/clean": want,
        "mod/clean": "mypkg.train:make",
    }
    assert load_env_spec(tmp_path / "specs" / "e.yaml").workload.model == want
    (tmp_path / "specs" / "gone.yaml").write_text(
        "workload: {model: ../nowhere/cnn.py:make}\n" + seeds
    )
    assert (
        load_env_spec(tmp_path / "specs" / "gone.yaml").workload.model == "../nowhere/cnn.py:make"
    )
