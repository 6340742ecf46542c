"""``autoscale train-agent`` keeps the checkpoint that is best on a train instance held out of
training, never on the test instances ``autoscale eval`` then reports on (as the search's RL
trials and the build select theirs); a spec with one train instance keeps the last model and
says so in one line."""

from __future__ import annotations

import dataclasses

import yaml

from autoscale.agents.train import train_agent
from autoscale.cli import main

TEST_NAMES = ("test-s5-t0", "test-s6-t2")  # tiny_spec's test instances


def _train_agent_cli(spec, trace, tmp_path, name: str) -> list[str]:
    spec_file = tmp_path / f"{name}.yaml"
    spec_file.write_text(yaml.safe_dump(spec.to_dict()))
    argv = ["train-agent", "--env", str(spec_file), "--replay", str(trace), "--timesteps", "64"]
    argv += ["--eval-freq", "16", "--out", name, "--policy-dir", str(tmp_path / "pol"), "--quiet"]
    assert main(argv) == 0
    assert (tmp_path / "pol" / name / "weights.pt").is_file()
    return argv


def test_the_checkpoint_is_selected_on_a_held_out_train_instance(
    tiny_spec, tiny_trace, tmp_path, capsys
):
    _train_agent_cli(tiny_spec, tiny_trace, tmp_path, "sel")
    trained, exported = capsys.readouterr().out.strip().splitlines()
    assert (
        "checkpoint selected on the held-out train instance(s) train-s1-t3 (mean reward" in trained
    )
    assert not any(name in trained for name in TEST_NAMES)
    assert exported.startswith("exported ")

    result = train_agent(tiny_spec, "ppo", 64, replay=tiny_trace, eval_freq=16, hold_out=True)
    assert result.selected_on == ("train-s1-t3",)
    assert len(result.eval_history) >= 2  # the checkpoints were weighed there


def test_a_single_train_instance_keeps_the_last_model_and_says_so(
    tiny_spec, tiny_trace, tmp_path, capsys
):
    one = dataclasses.replace(
        tiny_spec, instances={**tiny_spec.instances, "train": tiny_spec.instances["train"][:1]}
    )
    _train_agent_cli(one, tiny_trace, tmp_path, "last")
    trained, _ = capsys.readouterr().out.strip().splitlines()
    assert "no checkpoint selection: a member has a single train instance" in trained
    assert "the last model is kept" in trained
    result = train_agent(one, "ppo", 64, replay=tiny_trace, eval_freq=16, hold_out=True)
    assert result.selected_on == () and result.eval_history == []


def test_held_out_moves_each_members_last_train_instance_to_its_test_set(tiny_spec):
    from autoscale.agents.train import held_out

    spec = held_out(tiny_spec)
    assert [i.name for i in spec.instances["train"]] == ["train-s0-t0"]
    assert [i.name for i in spec.instances["test"]] == ["train-s1-t3"]
    one = dataclasses.replace(
        tiny_spec, instances={**tiny_spec.instances, "train": tiny_spec.instances["train"][:1]}
    )
    assert held_out(one) is None
