"""Build the general policy ``auto`` from scratch, with its evidence.

The build is :class:`autoscale.selection.AutoBuild` (what it records, trains, ranks and how it decides
what ships: its docstring; envs/suite.yaml's split says which members train, which choose and
which only report); this driver sets its paths, runs it, exports the pick to policies/auto
and writes experiments/results/auto.md, auto_selection.json, auto_evidence.json and the block
between the auto markers of experiments/results/README.md.

    python experiments/build_auto.py [--timesteps 300000] [--horizon 512] [--steps 256]
                                     [--long-steps 2000] [--reuse-agents] [--knobs]
                                     [--no-residual] [--residual-timesteps 20000] [--window 16]
                                     [--residual-as-recorded]

Prints how long each part took, and the total. ``--reuse-agents`` takes the agents an earlier run
trained with the same settings (experiments/.cache/auto/policies, listed in agents.json there)
instead of training them again; the report says so, and gives their training times from then.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
RESULTS = ROOT / "experiments" / "results"
RESULTS_PAGE = RESULTS / "README.md"  # the block this script writes
CACHE = ROOT / "experiments" / ".cache" / "auto"
SEARCHED_PICK = ROOT / "experiments" / ".cache" / "policies" / "suite-parametric"
NO_HARM_CACHE = ROOT / "experiments" / ".cache" / "no-harm"  # torch's runs, shared with no_harm.py
START, END = "<!-- auto:start -->", "<!-- auto:end -->"

from auto_report import (  # noqa: E402  (experiments/ on sys.path above)
    build_report,
    cards_dict,
    not_built_block,
    shipped_block,
)
from suite_pages import write_readme_block  # noqa: E402


def shipped_label() -> str | None:
    """The candidate ``policies/auto`` holds, as the build labels it (None: no policy there)."""
    from autoscale.scalers.policies import read_manifest

    if not (ROOT / "policies" / "auto" / "policy.yaml").is_file():
        return None
    m = read_manifest(ROOT / "policies" / "auto")
    if m.kind != "parametric":
        return m.name
    bounds = ("init_scale", "min_scale", "max_scale")
    params = {k: v for k, v in (m.parameters or {}).items() if k not in bounds}
    return f"{m.family}({', '.join(f'{k}={v}' for k, v in params.items())})" if params else m.family


def readme_only() -> int:
    """Rewrite the results block from the last run's saved results."""
    import json

    from autoscale.selection.suite_eval import load_cards

    sel = json.loads((RESULTS / "auto_selection.json").read_text())
    # since the split the file names what shipped; before it, the one candidate that passed
    shipped = (
        sel["shipped"]
        if "shipped" in sel
        else [s for s, v in sel["verdicts"].items() if v["passed"]]
    )
    split = (sel["validation"], sel["test"]) if "validation" in sel else ()
    if shipped:  # the last build shipped its pick (else policies/auto is an earlier build's)
        from autoscale.envs.suite import load_spec
        from autoscale.scalers.policies import read_manifest

        manifest = read_manifest(ROOT / "policies" / "auto")
        evidence, extra = load_cards(RESULTS / "auto_evidence.json")
        suite = load_spec(ROOT / "envs" / "suite.yaml")
        block = shipped_block(
            evidence, extra["acceptance"], extra["pick"], sel["timings"], sel["agents"],
            manifest.scorecard["long_runs"], manifest.workload["members"],
            manifest.workload["left_out"], suite.reward,
            (sel["objective"], sel["zero_shot"], sel["acceptance"], *split),
        )  # fmt: skip
    else:
        rank_by = sel.get("validation") or sel["objective"]
        ranked = sorted((s for s in sel["objective"] if s != "torch"), key=rank_by.get)
        block = not_built_block(
            sel["objective"], sel["zero_shot"], sel["acceptance"], sel["verdicts"], ranked, *split,
            chosen=sel.get("chosen"), current=shipped_label(),
        )  # fmt: skip
    write_readme_block(RESULTS_PAGE, START, END, block)
    print("\n".join(block))
    return 0


def main(argv=None) -> int:
    from autoscale.selection.auto import BuildSettings, parse_extra

    d = BuildSettings()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--timesteps", type=int, default=d.timesteps)
    p.add_argument("--horizon", type=int, default=d.horizon, help="replayed episode length for RL")
    p.add_argument("--history", type=int, default=d.history, help="stacked feature vectors")
    p.add_argument("--steps", type=int, default=d.steps, help="real steps of each held-out episode")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-harm-steps", type=int, default=d.no_harm_steps)
    p.add_argument("--long-steps", type=int, default=d.long_steps,
                   help="steps of the pick's long run on every member next to torch's (0: none)")  # fmt: skip
    p.add_argument("--confirm-episodes", type=int, default=d.confirm_episodes,
                   help="paired episodes more of a member missed on eval loss alone (0: none)")  # fmt: skip
    p.add_argument("--extra", action="append", default=[], metavar="RULE:KEY=VALUE,...",
                   help="a parametric candidate more, e.g. amax-history:history_len=256")  # fmt: skip
    p.add_argument("--reuse-agents", action="store_true",
                   help="take agents trained with these settings before")  # fmt: skip
    p.add_argument("--no-scale-time", action="store_true",
                   help="train no agent acting at scale time (rl-...-now)")  # fmt: skip
    p.add_argument("--knobs", action="store_true",
                   help="train the agents under scenario knobs drawn per episode (rl-...-knobs)")  # fmt: skip
    p.add_argument("--no-residual", action="store_true",
                   help="train no residual agent on auto (rl-res-...)")  # fmt: skip
    p.add_argument("--residual-timesteps", type=int, default=d.residual_timesteps,
                   help="decisions each residual agent trains for")  # fmt: skip
    p.add_argument("--window", type=int, default=d.window,
                   help="steps a residual agent's offset holds")  # fmt: skip
    p.add_argument("--residual-as-recorded", action="store_true",
                   help="train the residual agents on the recorded steps, without scenario knobs")  # fmt: skip
    p.add_argument("--readme-only", action="store_true",
                   help="rewrite the results block from experiments/results/auto_*.json and stop")  # fmt: skip
    args = p.parse_args(argv)
    if args.readme_only:
        return readme_only()

    import torch

    from autoscale.envs.suite import load_spec
    from autoscale.selection.auto import AutoBuild
    from autoscale.selection.suite_eval import save_cards

    torch.set_num_threads(1)
    settings = BuildSettings(
        timesteps=args.timesteps, horizon=args.horizon, history=args.history, steps=args.steps,
        seed=args.seed, no_harm_steps=args.no_harm_steps, long_steps=args.long_steps,
        confirm_episodes=args.confirm_episodes, reuse_agents=args.reuse_agents,
        scale_time=not args.no_scale_time, knobs=args.knobs, residual=not args.no_residual,
        residual_timesteps=args.residual_timesteps, window=args.window,
        residual_knobs=not args.residual_as_recorded,
    )  # fmt: skip
    t_all = time.monotonic()
    suite = load_spec(ROOT / "envs" / "suite.yaml")
    try:
        extras = dict(parse_extra(e) for e in args.extra)  # label -> (rule, parameters)
        build = AutoBuild(
            suite, settings, CACHE, searched_pick=SEARCHED_PICK, no_harm_cache=NO_HARM_CACHE,
            extras=extras, log=lambda t: print(t, flush=True),
        )  # fmt: skip
    except ValueError as exc:
        print(f"build_auto.py: error: --extra {exc}", file=sys.stderr)
        return 2
    result = build.run()
    built_by = "experiments/build_auto.py " + " ".join(argv if argv is not None else sys.argv[1:])
    manifest = None
    if result.pick is not None:
        manifest = build.export(result, ROOT / "policies", built_by.strip())
    result.timings["total"] = time.monotonic() - t_all

    (RESULTS / "auto.md").write_text("\n".join(build_report(result, manifest, extras, argv)) + "\n")
    save_cards(
        result.cards, RESULTS / "auto_selection.json", objective=result.objective,
        zero_shot=result.zero_shot, verdicts=result.verdicts, timings=result.timings,
        agents=result.agent_runs, acceptance=result.acceptance,
        confirmed={k: cards_dict(v) for k, v in result.confirmed.items() if v},
        validation=result.objective_validation, test=result.objective_test,
        ranked_on=result.ranked_on, chosen=result.chosen, shipped=result.pick,
        members={"train": result.searched, "validation": result.validation, "test": result.test},
        test_confirmed=cards_dict(result.test_confirmed), limits=result.limits,
        limit_shares=result.limit_shares,
    )  # fmt: skip
    if result.evidence is not None:
        save_cards(
            result.evidence, RESULTS / "auto_evidence.json",
            acceptance=result.evidence_acceptance, pick=result.pick,
            confirmed=cards_dict(result.evidence_confirmed),
        )  # fmt: skip
    if manifest is not None:
        block = shipped_block(
            result.evidence, result.evidence_acceptance, result.pick, result.timings,
            result.agent_runs, manifest.scorecard["long_runs"], result.searched, result.left_out,
            result.weights,
            (result.objective, result.zero_shot, result.acceptance, result.objective_validation,
             result.objective_test),
        )  # fmt: skip
    else:
        block = not_built_block(
            result.objective, result.zero_shot, result.acceptance, result.verdicts, result.ranked,
            result.objective_validation, result.objective_test, chosen=result.chosen,
            current=shipped_label(),
        )  # fmt: skip
    if not write_readme_block(RESULTS_PAGE, START, END, block):
        print(f"{RESULTS_PAGE} has no {START} ... {END} markers; its block was not written")
    print("\n".join(block))
    print("took " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in result.timings.items()))
    if manifest is None:
        why = (
            f"the choice, {result.chosen}, does harm on a test member"
            if result.chosen is not None
            else "no candidate meets the bar everywhere and passes the no-harm check"
        )
        print(f"{why}: auto not built (report: {RESULTS / 'auto.md'})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
