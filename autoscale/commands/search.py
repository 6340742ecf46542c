"""``autoscale search``: a budgeted Optuna search of loss-scale policies, validated and exported."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from autoscale.commands.base import POLICY_DIR_HELP, Command
from autoscale.processes import sticky_interrupt

EPILOG = """examples:
  autoscale search --budget 5m                        gpt2-tiny / bad-batches, parametric rules
  autoscale search --model gpt2 --scenario small-grads --budget 2h
  autoscale search --env envs/moving.yaml --space both --budget 1h30m --export moving-best
  autoscale search --storage runs.log --study shared --budget 30m      (run it in several shells)
  autoscale search --storage postgresql://user:pw@db-host/autoscale --study team --budget 8h

budgets: 90s, 30m, 2h, 1h30m. The search measures the step time, records traces of real steps,
searches on their replay, validates the best candidates and every built-in rule on real steps of
held-out instances, exports the winner, and ends within the budget. Ctrl-C keeps every finished
trial; the same command resumes the study. Review it with: autoscale dashboard
"""


def add_storage_arguments(parser: Any) -> None:
    """``--storage`` and ``--artifacts`` on a parser or argument group, shared by search,
    dashboard and export."""
    from autoscale.search.storage import DEFAULT_STORAGE

    parser.add_argument(
        "--storage",
        default=DEFAULT_STORAGE,
        help=f"Optuna URL, SQLite file, or FILE.log for a JournalFile (default {DEFAULT_STORAGE})",
    )
    parser.add_argument(
        "--artifacts",
        metavar="DIR",
        help="plots, traces, RL policies (default: artifacts/ next to the storage file)",
    )


class SearchCommand(Command):
    """Search loss-scale policies within a wall-clock budget; validate and export the best."""

    epilog = EPILOG

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        wl = parser.add_argument_group("workload (default: gpt2-tiny, bad-batches)")
        wl.add_argument(
            "--env", help="env spec: a YAML path or a name in envs/ (sets the workload)"
        )
        wl.add_argument(
            "--model",
            "--workload",
            dest="model",
            help="model preset, Hub id, local folder, or your own workload module:factory or "
            "path/to/file.py:factory (default gpt2-tiny)",
        )
        wl.add_argument("--scenario", help="failure mode (default bad-batches)")
        wl.add_argument(
            "--traces",
            nargs="+",
            metavar="DIR",
            help="search on the replay of your recorded runs (autoscale wrap --record DIR) "
            "instead of a workload's real steps",
        )
        wl.add_argument(
            "--param", action="append", default=[], metavar="KEY=VALUE", help="scenario parameter"
        )
        wl.add_argument("--dtype", help="autocast dtype (default: the spec's, fp16)")
        wl.add_argument(
            "--fp16", help="fp16 products on a CPU: auto, native or emulated (default: the spec's)"
        )
        s = parser.add_argument_group("search")
        s.add_argument(
            "--budget", default="10m", help="wall clock: 90s, 30m, 2h, 1h30m (default 10m)"
        )
        s.add_argument(
            "--space",
            default="parametric",
            choices=("parametric", "rl", "both"),
            help="rule families with their knobs, RL agents, or both (default parametric)",
        )
        s.add_argument(
            "--family",
            action="append",
            metavar="RULE",
            help="search only this rule family (repeatable; default: every family whose scale "
            "adapts: a fixed scale, static, only when named here)",
        )
        s.add_argument(
            "--no-warm-start",
            dest="warm_start",
            action="store_false",
            help="with --space rl|both: every agent starts from auto with no offset learned "
            "(default: the first fine-tunes the residual agent shipped with autoscale)",
        )
        s.add_argument("--n-trials", type=int, help="stop this worker after N trials")
        s.add_argument("--seed", type=int, default=0, help="seed of the sampler and the agents")
        st = parser.add_argument_group("storage and export")
        add_storage_arguments(st)
        st.add_argument(
            "--study", help="study name (default MODEL-SCENARIO-SPACE); same name resumes"
        )
        st.add_argument(
            "--export", metavar="NAME", help="policy name to export (default: the study name)"
        )
        st.add_argument(
            "--force", action="store_true", help="overwrite another policy of that name"
        )
        st.add_argument("--policy-dir", metavar="DIR", help=POLICY_DIR_HELP)
        parser.add_argument(
            "--quiet",
            action="store_true",
            help="no progress bars (drawn only on a terminal: a log keeps the phase lines)",
        )

    def run(self, args: argparse.Namespace) -> int:
        from autoscale.search.budget import Budget, parse_budget

        budget = Budget.from_process_start(parse_budget(args.budget))
        from autoscale.errors import ConfigError
        from autoscale.search import SearchConfig, SearchRunner
        from autoscale.search.report import draw_bars

        if args.n_trials is not None and args.n_trials <= 0:
            raise ConfigError(f"--n-trials must be a positive number, got {args.n_trials}")
        if args.family:
            from autoscale.search.space import searched_families

            searched_families(args.family)  # an unknown name: one line, before any work
        source, spec, study, explicit = self._source(args)
        cfg = SearchConfig(
            spec,
            study=study,
            export=args.export or study,
            explicit=explicit,
            space=args.space,
            storage=args.storage,
            n_trials=args.n_trials,
            seed=args.seed,
            force=args.force,
            artifacts=args.artifacts,
            policy_dir=args.policy_dir,
            progress=draw_bars(not args.quiet),
            command=shlex.join(["autoscale", *sys.argv[1:]]) if sys.argv else "autoscale search",
            budget_text=args.budget,
            families=tuple(args.family) if args.family else None,
            warm_start=args.warm_start,
        )
        runner = SearchRunner(cfg, budget, source=source)
        held = ""
        try:
            with sticky_interrupt():
                result = runner.run()
        except Exception as exc:
            _lost_storage(exc, runner.counts, args.storage, study)
            raise
        except KeyboardInterrupt:
            if source is not None:
                held = f" (it holds {source.held(runner.study)})"
            print(_interrupted(runner.counts, study, runner.result, held), file=sys.stderr)
            return 130
        if source is None:
            _print_done(result, _dashboard_storage(args.storage))
        else:
            _print_records_done(result, runner, source)
        return 0

    def _source(self, args: argparse.Namespace) -> tuple[Any, Any, str, bool]:
        """(the records' source or None, the workload or the records' windows, the study's name,
        whether the user named the workload) for the arguments; a bad record or flag is one line
        before anything is written."""
        from autoscale.commands.run import parse_pairs
        from autoscale.errors import ConfigError
        from autoscale.search import base_spec, default_study_name

        if args.traces:
            other = [
                f
                for f, v in (
                    ("--env", args.env),
                    ("--model/--workload", args.model),
                    ("--scenario", args.scenario),
                    ("--param", args.param),
                )
                if v
            ]
            if other or args.space != "parametric":
                raise ConfigError(
                    f"--traces searches parametric rules on your records; it takes no "
                    f"{', '.join(other) or '--space ' + args.space} (drop it, or search a workload instead)"
                )
            from autoscale.search.on_traces import RecordsSource

            source = RecordsSource(tuple(args.traces))
            return source, source.suite, args.study or source.default_study(), True
        params = parse_pairs(args.param, "--param")
        explicit = any(v is not None for v in (args.env, args.model, args.scenario)) or bool(params)
        spec = base_spec(
            args.env,
            model=args.model,
            scenario=args.scenario,
            params=params,
            dtype=args.dtype,
            fp16=args.fp16,
        )
        from autoscale.search.workload import check_user_workloads

        check_user_workloads(spec)
        return None, spec, args.study or default_study_name(spec, args.space), explicit


def _lost_storage(exc: Exception, counts: dict[str, int], storage: str, study: str) -> None:
    """Raise the one line a lost storage is (what this worker keeps), where ``exc`` is that."""
    from autoscale.errors import AutoscaleError, StorageError
    from autoscale.search.storage import lost_connection, mask_url

    reason = None if isinstance(exc, AutoscaleError) else lost_connection(exc)
    if reason is not None:
        raise StorageError(
            f"lost the storage '{mask_url(storage)}' ({reason}); this worker's "
            f"{counts['complete']} complete trials are kept in study '{study}'; the same command "
            "resumes it once the storage is reachable"
        ) from None


def _interrupted(counts: dict[str, int], study: str, result: Any, held: str = "") -> str:
    """The line a Ctrl-C leaves, for a search on a workload or on records: what is kept, what
    was exported."""
    exported = (
        "nothing was exported"
        if result.exported is None
        else f"{result.exported} stays as an earlier round exported it: {result.winner}"
    )
    return (
        f"interrupted: this worker's {counts['complete']} complete and {counts['pruned']} pruned "
        f"trials are kept in study '{study}'{held}; {exported}; the same command resumes it"
    )


def _print_records_done(result: Any, runner: Any, source: Any) -> None:
    """A search on records' last line: its time, its trials and the study's, the dashboard."""
    from autoscale.search.budget import format_duration

    stopped = " (stopped early: see the search line)" if result.stopped_early else ""
    print(
        f"done in {format_duration(result.wall_s)} of a {format_duration(result.budget_s)} "
        f"budget{stopped}; this run: {sum(runner.counts.values())} trials; the study holds "
        f"{source.held(runner.study)} finished; review it with: autoscale dashboard --storage "
        f"{_dashboard_storage(runner.cfg.storage)}"
    )


def _dashboard_storage(storage: str) -> str:
    """The storage as the dashboard line gives it: from any folder (a file by its absolute
    path), any password masked, quoted for a shell where it must be."""
    import shlex

    from autoscale.search.storage import storage_id

    return shlex.quote(storage_id(storage))


def _print_done(result: Any, storage: str) -> None:
    """A workload search's last lines: its time and where it went, the answer, the dashboard."""
    from autoscale.search.budget import format_duration

    ledger, wall = result.ledger, max(result.wall_s, 1e-9)
    work, alg, bk = (ledger.total(k) for k in ("work:", "alg:", "bk:"))
    print(
        f"done in {format_duration(result.wall_s)} of a {format_duration(result.budget_s)} budget; "
        f"training and evaluation {100 * work / wall:.0f}%, Optuna's sampler and pruner "
        f"{100 * alg / wall:.0f}%, bookkeeping (storage, plots, notes, artifacts) "
        f"{100 * bk / wall:.1f}%; this worker ran {sum(result.trials.values())} trials"
    )
    for line in result.answer:
        print(line)
    print(f"review it with: autoscale dashboard --storage {storage}")
