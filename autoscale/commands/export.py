"""``autoscale export``: export a search trial's policy to ``policies/NAME``."""

from __future__ import annotations

import argparse

from autoscale.commands.base import Command
from autoscale.errors import ConfigError
from autoscale.search.candidates import TORCH


class ExportCommand(Command):
    """Export a trial of a search study (the best, or trial N) as a policy get_scaler can load."""

    epilog = """examples:
  autoscale export --study gpt2-tiny-bad-batches-parametric --name bb-best
  autoscale export --study team --storage runs.log --trial 42 --name team-42 --force

best: the trial with the best objective on real steps of the test instances (validated by any
worker), else the best on the train replay.
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from autoscale.commands.search import add_storage_arguments

        parser.add_argument(
            "--study", required=True, help="study name (autoscale dashboard lists them)"
        )
        add_storage_arguments(parser)
        parser.add_argument("--trial", default="best", help="trial number, or 'best' (default)")
        parser.add_argument("--name", required=True, help="policy name: policies/NAME")
        parser.add_argument("--force", action="store_true", help="overwrite an existing policy")
        parser.add_argument(
            "--policy-dir", metavar="DIR", help="export folder (default ./policies)"
        )

    def run(self, args: argparse.Namespace) -> int:
        import optuna

        from autoscale.envs.suite_env import suite_instances
        from autoscale.search.export import (
            best_trial,
            card_summary,
            check_export_target,
            export_trial,
            policy_label,
            study_suites,
        )
        from autoscale.search.storage import (
            artifact_store,
            artifacts_dir,
            load_study,
            mask_url,
            open_storage,
        )
        from autoscale.search.validate import by_member, real_cards, validated_trials

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = open_storage(args.storage, must_exist=True)
        study = load_study(args.study, storage, args.storage)
        suite, validation, _ = study_suites(study)
        check_export_target(
            args.name, args.policy_dir, study.study_name, args.force, own_study_ok=False
        )
        if args.trial == "best":
            trial, cards, how = best_trial(study, validation)
        else:
            trial = _trial(study, args.trial)
            cards = validated_trials(study, validation).get(trial.number)
            how = "validated on real steps" if cards else "not validated on real steps"
        names = suite_instances(validation, "test")
        torch_cards = real_cards(study.user_attrs, TORCH, names)
        summary: dict = {}
        if cards is not None and len(torch_cards) == len(names):
            where = f"real steps: {len(names)} test episodes of {validation.episode.steps} steps"
            summary = card_summary(cards, by_member(torch_cards, names), suite.reward, where)
        elif trial.user_attrs.get("scores", {}).get("test_replay"):
            replay = trial.user_attrs["scores"]["test_replay"]
            summary = {
                "objective": replay["objective"],
                "members": replay["members"],
                "evaluated_on": "replay of the recorded real test steps",
            }
        path = export_trial(
            study,
            trial,
            args.name,
            suite=suite,
            store=artifact_store(artifacts_dir(args.storage, args.artifacts)),
            out_dir=args.policy_dir,
            force=args.force,
            own_study_ok=False,
            scorecard=summary,
            provenance={"storage": mask_url(args.storage)},
        )
        print(
            f"exported {path} ({policy_label(trial)}; {how}); use it with autoscale.get_scaler('{args.name}')"
        )
        return 0


def _trial(study, text: str):
    import optuna

    try:
        number = int(text)
    except ValueError:
        raise ConfigError(f"--trial takes a trial number or 'best', got {text!r}") from None
    trials = study.get_trials(deepcopy=False)
    match = [t for t in trials if t.number == number]
    if not match:
        raise ConfigError(
            f"study '{study.study_name}' has no trial {number} (trials 0..{len(trials) - 1})"
        )
    trial = match[0]
    if trial.state != optuna.trial.TrialState.COMPLETE:
        raise ConfigError(
            f"trial {number} of study '{study.study_name}' is {trial.state.name.lower()}, not complete; "
            "export a complete trial (or --trial best)"
        )
    return trial
