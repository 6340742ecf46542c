"""``autoscale export``: export a search trial's policy to ``DIR/NAME``: ``--policy-dir``, else
the first folder of ``$AUTOSCALE_POLICY_PATH``, else the user's folder (``$AUTOSCALE_HOME/policies``,
else ``$XDG_DATA_HOME/autoscale/policies``, else ``~/.local/share/autoscale/policies``)."""

from __future__ import annotations

import argparse
import sys

from autoscale.commands.base import POLICY_DIR_HELP, Command
from autoscale.errors import ConfigError
from autoscale.search.candidates import AUTO, Candidate


class ExportCommand(Command):
    """Export a trial of a search study (the best, or trial N) as a policy get_scaler can load."""

    epilog = """examples:
  autoscale export --study gpt2-tiny-bad-batches-parametric --name bb-best
  autoscale export --study team --storage runs.log --trial 42 --name team-42 --force
  autoscale export --list                          the storage's studies, in text
  autoscale export --list --study team             its validated rows and best trials

best: what the search exports, decided by the search's own pick from what the study holds: the
rows validated on real steps (by any worker) against auto, the families the search was asked
for, and the stored no-harm verdicts (a candidate without a passed verdict is not exported; where
nothing beats auto, auto is). A trial number exports that trial; where it is not the search's
pick, one warning says why. The manifest's evidence says either way.
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from autoscale.commands.search import add_storage_arguments

        parser.add_argument("--study", help="study name (--list lists them)")
        add_storage_arguments(parser)
        parser.add_argument("--trial", default="best", help="trial number, or 'best' (default)")
        parser.add_argument("--name", help="policy name: exported to DIR/NAME (see --policy-dir)")
        parser.add_argument(
            "--list",
            action="store_true",
            help="list the storage's studies, or with --study its validated rows and best "
            "trials; exports nothing",
        )
        parser.add_argument("--force", action="store_true", help="overwrite an existing policy")
        parser.add_argument("--policy-dir", metavar="DIR", help=POLICY_DIR_HELP)

    def run(self, args: argparse.Namespace) -> int:
        import optuna

        from autoscale.scalers.policies import policy_ref
        from autoscale.search.export import (
            check_export_target,
            export_candidate,
            stored_pick,
            study_suites,
        )
        from autoscale.search.storage import (
            artifact_store,
            artifacts_dir,
            load_study,
            open_storage,
            storage_id,
        )

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        if not args.list and not (args.study and args.name):
            missing = [f for f, v in (("--study", args.study), ("--name", args.name)) if not v]
            raise ConfigError(
                f"export needs {' and '.join(missing)}; autoscale export --list lists the "
                "studies and their trials"
            )
        storage = open_storage(args.storage, must_exist=True)
        if args.list:
            if args.study is None:
                _list_studies(storage, args.storage)
            else:
                _list_study(load_study(args.study, storage, args.storage), args.storage)
            return 0
        study = load_study(args.study, storage, args.storage)
        suite, validation, _ = study_suites(study)
        check_export_target(
            args.name,
            args.policy_dir,
            study.study_name,
            args.force,
            own_study_ok=False,
            flag="--name",
        )
        pick = stored_pick(study, validation, suite.reward)
        if args.trial == "best":
            key, against = pick.key, []
            if key is None:
                raise ConfigError(
                    f"study '{study.study_name}' holds no real-step validation of torch, so its "
                    "search exports nothing; export a trial by number with --trial N"
                )
        else:
            key = Candidate.trial(_trial(study, args.trial).number)
            against = pick.objections(study, key)
        path, how = export_candidate(
            study,
            key,
            args.name,
            suite=suite,
            store=artifact_store(artifacts_dir(args.storage, args.artifacts)),
            out_dir=args.policy_dir,
            force=args.force,
            own_study_ok=False,
            scorecard=_scorecard(study, pick, key, against, validation, suite.reward),
            provenance={"storage": storage_id(args.storage), "exported_by": "autoscale export"},
            flag="--name",
        )
        if against:
            print(
                f"warning: {how} is not what the search exports ({'; '.join(against)}); "
                f"exported by number, the manifest says so",
                file=sys.stderr,
            )
            why = "exported by number"
        else:
            why = f"the search's pick: {pick.choice.why}"
        print(
            f"exported {path} ({how}; {why}); use it with autoscale.get_scaler('{policy_ref(path)}')"
        )
        return 0


LISTED_TRIALS = 10  # the best trials on the train replay that --list --study shows


def _counts(trials: list) -> str:
    from autoscale.search.budget import outcome_counts, trial_counts

    counts = outcome_counts(trials)
    unfinished = len(trials) - sum(counts.values())  # waiting (enqueued defaults) or running
    return trial_counts(counts, f"; {unfinished} waiting or running" if unfinished else "")


def _list_studies(storage, url: str) -> None:
    """Every study of ``storage``: its workload, its trials and what its search exports."""
    import optuna

    from autoscale.search.export import stored_pick, study_suites
    from autoscale.search.storage import mask_url
    from autoscale.search.study import describe_spec

    summaries = sorted(storage.get_all_studies(), key=lambda s: s.study_name)
    print(f"{len(summaries)} stud{'y' if len(summaries) == 1 else 'ies'} in {mask_url(url)}:")
    for summary in summaries:
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        trials = study.get_trials(deepcopy=False)
        try:
            suite, validation, _ = study_suites(study)
        except ConfigError:  # a study this autoscale did not make
            print(f"  {study.study_name}: {_counts(trials)}; not a search's study")
            continue
        pick = stored_pick(study, validation, suite.reward)
        exports = "nothing yet (torch not validated)" if pick.key is None else pick.key.name
        if pick.key is not None and pick.key.is_trial:
            exports = pick.rows[pick.key].label
        print(f"  {study.study_name}: {describe_spec(suite)}; {_counts(trials)}; exports {exports}")
    print("autoscale export --list --study NAME shows a study's rows and best trials")


def _list_study(study, url: str) -> None:
    """``study``'s validated rows (the search's ranking, its pick marked, each verdict) and its
    best trials on the train replay, in text."""
    import optuna

    from autoscale.search.choose import CHECK_SHAPE, stored_verdict
    from autoscale.search.export import policy_label, rank, stored_pick, study_suites
    from autoscale.search.objective import objective
    from autoscale.search.storage import mask_url
    from autoscale.search.study import describe_spec

    suite, validation, _ = study_suites(study)
    trials = study.get_trials(deepcopy=False)
    print(
        f"study '{study.study_name}' in {mask_url(url)}: {describe_spec(suite)}; {_counts(trials)}"
    )
    pick = stored_pick(study, validation, suite.reward)
    if pick.reference is None:
        print("validated: nothing yet (the search exports nothing before torch is validated)")
    else:
        ranked = rank(pick.rows, pick.reference, suite.reward)
        where = "replay of held-out windows" if "traces" in study.user_attrs else "real steps"
        print(
            f"validated on {where} (objective vs torch, lower is better; * = what the search exports):"
        )
        for v in ranked:
            verdict = stored_verdict(study, v.key, study.user_attrs.get(CHECK_SHAPE))
            checked = (
                "" if verdict is None else f"  no-harm {'passed' if verdict.passed else 'failed'}"
            )
            mark = "*" if v.key == pick.key else " "
            value = objective(v.cards, pick.reference.cards, suite.reward)
            print(f"  {mark} {v.label:<28} {value:+.4f}{checked}")
    complete = optuna.trial.TrialState.COMPLETE
    done = [t for t in trials if t.state == complete and "policy" in t.user_attrs]
    best = sorted(done, key=lambda t: t.value)[:LISTED_TRIALS]
    if best:
        print("best trials on the train replay (autoscale export --trial N exports one):")
        for t in best:
            what = policy_label(t).removesuffix(f", trial {t.number}")
            print(f"    trial {t.number:<6} {what:<22} {t.value:+.4f}")


def _scorecard(study, pick, key, against: list[str], validation, weights) -> dict:
    """The manifest's scorecard of ``key``: its real-step rows against ``torch`` and ``auto``
    (else its replay of the test steps), and the evidence: the search's pick and why, the
    stored no-harm verdict, and why the search does not export ``key`` where it does not."""
    from autoscale.search.answer import evidence
    from autoscale.search.choose import stored_verdict
    from autoscale.search.export import card_summary, rows_where

    v, ref = pick.rows.get(key), pick.reference
    summary: dict = {}
    if v is not None and ref is not None:
        summary = card_summary(v.cards, ref.cards, weights, rows_where(v, validation))
        if pick.choice is not None:
            summary["evidence"] = evidence(pick.choice, v, ref, weights)
    elif key.is_trial:
        replay = study.trials[key.number].user_attrs.get("scores", {}).get("test_replay")
        if replay:
            summary = {
                "objective": replay["objective"],
                "members": replay["members"],
                "evaluated_on": "replay of the recorded real test steps",
            }
    ev = summary.setdefault("evidence", {"bar": AUTO.name})
    chosen = pick.choice.winner if pick.choice is not None else None
    ev["search_exports"] = None if pick.key is None else (chosen.label if chosen else AUTO.name)
    ev["search_why"] = pick.choice.why if pick.choice is not None else against[0]
    verdict = stored_verdict(study, key)
    ev["no_harm"] = verdict.to_dict() if verdict is not None else None
    if against:
        ev["why"] = "exported by number (autoscale export --trial), not the search's pick"
        ev["not_the_pick"] = against
    else:
        ev["why"] = pick.choice.why
    return summary


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
