"""The markdown of the ``auto`` build's reports (experiments/build_auto.py): the selection, the
long runs, the block of experiments/results/README.md whether or not ``auto`` ships, and the
members judged on confirming episodes. Formatting only: what ships is decided by
:mod:`autoscale.training.bar` (the bar, the harm of a long run, the first candidate through every
stage)."""

from __future__ import annotations

import sys

from suite_pages import table

from autoscale.selection.suite_eval import (
    REFERENCE_EVERY,
    kept_share,
    objective_of,
    structural_share,
    zeroed_steps,
)
from autoscale.training.bar import mean


def report_head(title: str, argv, timings: dict) -> list[str]:
    """The report's title, the command that made it and how long each part took."""
    args = " ".join(argv if argv is not None else sys.argv[1:])
    return [
        title,
        "",
        f"`python experiments/build_auto.py {args}`".replace(" `", "`"),
        "",
        "Time: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()) + ".",
        "",
    ]


def build_report(result, manifest, extras: dict, argv) -> list[str]:
    """experiments/results/auto.md of a build (:class:`autoscale.selection.BuildResult`): its
    selection, the long runs of every candidate that got them, and the pick's evidence on fresh
    seeds; ``manifest`` is the exported ``auto``'s (None: nothing shipped)."""
    r = result
    if manifest is None and r.chosen is not None:
        head = [
            *report_head("# The general policy `auto`: not built", argv, r.timings),
            f"The build chose **{r.chosen}** on the train and validation members, but it does harm "
            "on a test member (read only after the choice; see its verdict below), so nothing was "
            "exported. The next candidate is not tried: test members that chose it would no "
            "longer measure it.",
            "",
        ]
    elif manifest is None:
        head = [
            *report_head("# The general policy `auto`: not built", argv, r.timings),
            "No candidate meets the bar on every train and validation member (skip rate at most "
            "torch's + 0.5 points, eval loss within seed noise, precision loss lower where torch "
            "underflows), on the test instances and again on fresh seeds, and does no harm (the "
            "no-harm check's clean runs, long runs of those members), so nothing was exported.",
            "",
        ]
    else:
        params = f", {extras[r.pick][1]}" if r.pick in extras else ""
        head = [
            *report_head("# The general policy `auto`", argv, r.timings),
            f"Picked: **{r.pick}** ({manifest.kind}, {manifest.family}{params}).",
            "",
        ]
    members = r.searched + r.left_out
    lines = [*head, *selection_report(r)]
    for name, long in r.long_runs.items():
        ran = [m for m in members if m in long.runs]
        lines += long_table(long.runs, long.harm, name, ran, r.settings.long_steps)
    if r.evidence is not None:
        shown = [s for s in r.evidence if s != "torch"] + ["torch"]
        ev_obj = objective_of(r.evidence, r.searched, r.weights)
        on_val = objective_of(r.evidence, r.validation, r.weights) if r.validation else {}
        lines += [
            "",
            "## Evidence: fresh seeds (test seeds + 1000) of the train and validation members, "
            "real steps",
            "",
            "objective, train members: "
            + ", ".join(f"{s} {ev_obj[s]:+.4f}" for s in shown if s != "torch")
            + (
                "; validation members: "
                + ", ".join(f"{s} {on_val[s]:+.4f}" for s in shown if s != "torch")
                if on_val
                else ""
            )
            + " (torch: 0).",
            "",
            *table(r.evidence, r.chosen_on, _kinds(r), r.weights, shown),
            *confirm_lines(r.evidence_acceptance),
        ]
    return lines


def _objective_cells(s: str, objective, validation, test) -> str:
    """Markdown cells: ``s``'s objective on the train, validation and test members ("-" where a
    suite has none of a kind, or where a build from before the split did not measure it)."""
    return " | ".join(
        f"{by[s]:+.4f}" if by and s in by else "-" for by in (objective, validation, test)
    )


OBJECTIVE_HEAD = (
    "objective, train members | objective, validation members (ranks) | "
    "objective, test members (read after the choice)"
)


def selection_report(r) -> list[str]:
    """The report's agents, candidates and selection table (whether or not anything shipped)."""
    agent_runs, same_as_builtin, ranked = r.agent_runs, r.same_as_builtin, r.ranked
    objective, accept, verdicts = r.objective, r.acceptance, r.verdicts
    scalers = [s for s in r.candidates if s != "torch"] + ["torch"]
    lines = [
        "Agents (SB3, replay episodes of "
        f"{r.settings.horizon} steps; best eval reward on one held-out train instance per member):",
        "",
        *(
            f"- {n}: {r['timesteps']} steps in {r['wall_s'] / 60:.1f} min, best eval reward "
            f"{r['best_eval_reward']:.3f}"
            + (" (reused: trained by an earlier run)" if r["reused"] else "")
            for n, r in agent_runs.items()
        ),
        "",
        (
            f"The suite search (experiments/reproduce.py) picked the built-in `{same_as_builtin}` with "
            "its defaults; it is ranked as that rule."
            if same_as_builtin
            else "The suite search's pick is ranked as `suite-parametric`."
            if "suite-parametric" in r.candidates
            else "The suite search's pick is not ranked: experiments/reproduce.py has not exported "
            "one here (experiments/.cache/policies/suite-parametric)."
        ),
        "",
        "## Selection: test instances (seeds 100-102), real steps",
        "",
        f"Ranked by the objective on the {r.ranked_on} members; the test members were read once, "
        "after the choice, to report (and to stop a choice that harms one from shipping).",
        "",
        f"| candidate | {OBJECTIVE_HEAD} | share of the limit, train / validation / test | "
        "bar met on | no-harm |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in ranked:
        met = sum(r["met"] for r in accept[s].values())
        v = verdicts.get(s)
        if v is None:
            no_harm_text = "-" if met < len(accept[s]) else NOT_REACHED
        else:
            no_harm_text = "passed" if v["passed"] else "; ".join(v["reasons"])
        cells = _objective_cells(s, objective, r.objective_validation, r.objective_test)
        lines.append(f"| {s} | {cells} | {_share_cells(r, s)} | {met} of {len(accept[s])} | "
                     f"{no_harm_text} |")  # fmt: skip
    lines += ["", *table(r.cards, r.searched + r.left_out, _kinds(r), r.weights, scalers)]
    lines += limit_table(r, ranked)
    for s in ranked:
        lines += confirm_lines(accept[s], f"{s}: e")
    return lines


def _share_cells(r, s: str) -> str:
    """``s``'s mean share of the limit on the train, validation and test members."""
    out = []
    for members in (r.searched, r.validation, r.test):
        share = r.mean_limit_share(s, members) if getattr(r, "limit_shares", None) else None
        out.append("-" if share is None else f"{share:.3f}")
    return " / ".join(out)


def limit_table(r, ranked: list[str]) -> list[str]:
    """Per member: the hindsight limit's precision loss beside torch's, and each candidate's share
    of the achievable gain (the results' headline number for how good a policy is)."""
    if not getattr(r, "limits", None):
        return []
    lines = [
        "",
        "## How close each candidate came: the share of the hindsight limit",
        "",
        "Per member: torch's precision loss and the limit's (the largest power-of-two scale that "
        "does not overflow each step, from a recording of the same held-out instances), then each "
        "candidate's share of the gain over torch there was to win, (P_torch - P) / (P_torch - "
        "P_limit): 1 is all of it, below 0 worse than torch, '-' no gain to win.",
        "",
        "| member | torch; limit | " + " | ".join(ranked) + " |",
        "|---" * (len(ranked) + 2) + "|",
    ]
    for m in r.searched + r.left_out:
        p_torch = [c.precision_loss for c in r.cards["torch"].get(m, [])]
        p_torch = sum(p_torch) / len(p_torch) if p_torch else float("nan")
        cells = []
        for s in ranked:
            share = r.limit_shares.get(s, {}).get(m)
            cells.append("-" if share is None else f"{share:.2f}")
        lines.append(f"| {m} | {100 * p_torch:.2f}%; {100 * r.limits.get(m, float('nan')):.2f}% | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return lines


NOT_REACHED = (
    "meets the bar on the test instances; not checked further (fresh seeds are spent once, on the "
    "first candidate through the other gates)"
)


def not_built_block(
    objective,
    zero_shot,
    accept,
    verdicts,
    ranked,
    validation=None,
    test=None,
    chosen=None,
    current=None,
) -> list[str]:
    """The results block when no candidate ships: each candidate's objective and where it missed
    (``validation``, ``test``: the objectives on those members, where the build measured them;
    ``zero_shot`` stands in for both in a build from before the split). ``chosen``: the build's
    choice where only a test member refused it; ``current``: the candidate ``policies/auto``
    holds from the last build that shipped (None: nothing is shipped)."""
    bar = (
        "(skip rate at most torch's + 0.5 points, eval loss within seed noise, precision loss "
        "lower where torch underflows)"
    )
    if chosen is not None:
        why = (
            f"its choice on the validation members, `{chosen}`, meets the bar {bar} on every "
            "train and validation member, passes the no-harm check and does no harm in their long "
            "runs, but does harm on a test member (below); the test members, read after the "
            "choice, do not choose another, or they would stop measuring it"
        )
    else:
        why = (
            f"no candidate meets the bar {bar} on every member it is chosen on, on the test "
            "instances and again on fresh seeds, and does no harm in long runs"
        )
    if current is None:
        now = "Until one ships, search your own workload, or keep `torch` where losses spike."
    else:
        same = ", the same candidate as this choice" if current == chosen else ""
        now = (
            f"`policies/auto` is still the last shipped build's `{current}`{same}: where it does "
            "harm (the misses below), use `amax-history` or search your own workload."
        )
    lines = [
        "Regenerated by `python experiments/build_auto.py` ([auto.md](auto.md)). "
        f"**This build ships nothing**: {why}. Each candidate's misses are listed below (on test "
        "members too: read after the choice, they rank nothing); the best objective is no guide "
        "on a member it misses (on spiky preference losses `amax-history` skips several times "
        f"more steps than `torch`). {now}",
        "",
        *(
            ["| candidate | objective, searched members | objective, left-out members | "
             "bar missed on |", "|---|---|---|---|"]
            if validation is None
            else [f"| candidate | {OBJECTIVE_HEAD} | bar missed on |", "|---|---|---|---|---|"]
        ),
    ]  # fmt: skip
    for s in ranked:
        misses = [m for m, r in accept[s].items() if not r["met"]]
        v = verdicts.get(s)
        if v is not None and not misses and not v["passed"]:
            fresh = [
                r
                for r in v["reasons"]
                if r.startswith(("on fresh seeds", "long runs", "on test members"))
            ]
            misses = fresh or ["the no-harm check"]
        elif v is None and not misses:
            misses = [NOT_REACHED]
        cells = (
            f"{objective[s]:+.4f} | {zero_shot[s]:+.4f}"
            if validation is None
            else _objective_cells(s, objective, validation, test)
        )
        lines.append(f"| `{s}` | {cells} | {', '.join(misses) or '-'} |")
    zeros = "+0.0000 | +0.0000" + ("" if validation is None else " | +0.0000")
    lines += [f"| `torch` | {zeros} | (the reference) |"]
    return lines


def long_table(runs, harm, scaler: str, members: list[str], steps: int) -> list[str]:
    """Markdown: a candidate's long run of every member next to torch's."""

    def cells(run) -> str:
        c = run["card"]
        return (
            f"{100 * c.skip_rate:.2f}% | {c.eval_loss:.4g} | {100 * c.precision_loss:.2f}% | "
            f"{100 * kept_share(run):.2f}% | {100 * structural_share(run):.1f}% | "
            f"{zeroed_steps(run)}"
        )

    return [
        "",
        f"## Long runs: {steps} real steps of every member (seed 100), {scaler} next to torch",
        "",
        "Skip rate, eval loss, precision loss (share of the elements left non-zero by the fp16 "
        "backward that lie below fp16's normal range), kept (on the first applied step of each "
        f"window of {REFERENCE_EVERY} whose exact gradient is not all zero, the share of the "
        "gradient elements that an fp32 backward of the same step leaves non-zero which reach "
        "the optimizer non-zero and at fp16 normal precision), exact zeros (the share of all elements that the fp32 backward "
        "leaves zero too, the model's and not the scale's: mean over every step that took a "
        "reference, those whose exact gradient is all zero included) and zeroed (applied steps whose every "
        "gradient element is zero after the fp16 backward: flushed, or zero in exact arithmetic "
        "too, as where every advantage of an RL rollout is zero). Harm: a divergence torch avoids, "
        "skips above torch's + 0.5 points, eval loss above torch's beyond the member's seed "
        "noise, or kept more than 0.5 points below torch's. Precision loss and exact zeros are "
        "shown, not judged: a scale low enough to zero whole gradients lowers the first, and two "
        "runs that drifted apart differ in the second.",
        "",
        f"| member | {scaler}: skip rate | eval loss | precision loss | kept | exact zeros | "
        "zeroed | torch: skip rate | eval loss | precision loss | kept | exact zeros | zeroed | "
        "harm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {m} | {cells(runs[m][scaler])} | {cells(runs[m]['torch'])} | "
            f"{'; '.join(harm[m]) or '-'} |"
            for m in members
        ),
    ]


def shipped_block(
    evidence, accept, pick, timings, agent_runs, long_runs, searched, left, weights, selection
) -> list[str]:
    """The results block of a shipped ``auto``: the selection's ranking (``selection``: objective,
    zero-shot objective and acceptance of every candidate on the test instances, then, from a
    build with the split, the validation and test objectives), its evidence on fresh seeds
    (``accept``: its bar there, confirmations included; the members it was chosen on) and its
    long runs."""
    left = [m for m in left if m in evidence["torch"]]  # fresh seeds: no test member
    # a build with the split (validation objectives follow the first three): what is left here
    # is its validation members
    split = len(selection) > 3 and bool(selection[3])
    kind, left_head = ("validation", "train") if split else ("left out", "searched")
    reused = [n for n, r in agent_runs.items() if r["reused"]]
    took = (
        f"built from scratch in {timings['total'] / 60:.0f} min"
        if not reused
        else (
            f"built in {timings['total'] / 60:.0f} min with {len(reused)} agents reused from an "
            f"earlier run ({sum(agent_runs[n]['wall_s'] for n in reused) / 60:.0f} min of "
            "training then)"
        )
    )
    objective = objective_of(evidence, searched, weights)
    zero_shot = objective_of(evidence, left, weights)
    met = sum(r["met"] for r in accept.values())
    rows = []
    for m in searched + left:
        cells = " | ".join(
            f"{100 * mean(evidence[s][m], 'skip_rate'):.2f}% | "
            f"{100 * mean(evidence[s][m], 'precision_loss'):.2f}% | "
            f"{mean(evidence[s][m], 'eval_loss'):.4g}"
            for s in (pick, "amax-history", "torch")
        )
        rows.append(f"| {m}{f' ({kind})' if m in left else ''} | {cells} |")
    long_members = long_runs["members"]
    if long_members:
        worst_skip = max(
            v[pick]["skip_rate"] - v["torch"]["skip_rate"] for v in long_members.values()
        )
        long_text = (
            f"in {long_runs['steps']}-step runs of all {len(long_members)} members it does no harm "
            f"next to torch: no divergence, at most {100 * worst_skip:+.2f} points of skip rate "
            "above torch's (0.5 allowed), eval loss within seed noise, and no fewer gradient "
            "elements kept at fp16 precision (of those an fp32 backward leaves non-zero; 0.5 "
            "points allowed)"
        )
    else:
        long_text = "it was not run long next to torch (the build ran with --long-steps 0)"
    return [
        f"Regenerated by `python experiments/build_auto.py` ([auto.md](auto.md)); {took}.",
        "",
        f"`auto` is **`{pick}`**. On fresh seeds (the test seeds + 1000: never used to train or "
        f"select), it meets the bar against torch on {met} of {len(accept)} members (skip rate at "
        "most torch's + 0.5 points, eval loss within seed noise, precision loss lower where torch "
        f"underflows); {long_text}. Mean over three episodes of "
        f"{mean(evidence['torch'][searched[0]], 'steps'):.0f} real steps per member:",
        "",
        "| member | `auto`: skip rate | precision loss | eval loss | `amax-history`: skip rate | "
        "precision loss | eval loss | `torch`: skip rate | precision loss | eval loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        *confirm_lines(accept),
        "",
        "On the fresh seeds above (the selection below ran on the test seeds, so its numbers differ):",
        "",
        f"| | objective, {left_head} members | objective, {kind} members |",
        "|---|---|---|",
        f"| `auto` | {objective[pick]:+.4f} | {zero_shot[pick]:+.4f} |",
        f"| `amax-history` | {objective['amax-history']:+.4f} | {zero_shot['amax-history']:+.4f} |",
        "| `torch` | +0.0000 | +0.0000 |",
        *test_lines(selection, pick),
        *selection_lines(*selection[:3], pick, *selection[3:]),
    ]


def test_lines(selection, pick) -> list[str]:
    """Markdown: what shipped on the test members next to the best of the others (empty for a
    build from before the split, or a suite without test members)."""
    test = selection[4] if len(selection) > 4 else None
    if not test:
        return []
    others = [s for s in test if s not in (pick, "torch")]
    best = min(others, key=test.__getitem__) if others else None
    return [
        "",
        f"On the test members (read once, after the choice): `auto` {test[pick]:+.4f}"
        + (f", the best of the others `{best}` {test[best]:+.4f}" if best else "")
        + " (torch: 0).",
    ]


def selection_lines(objective, zero_shot, accept, pick, validation=None, test=None) -> list[str]:
    """Markdown: every candidate's objective and bar on the test instances (the selection), in
    the order that ranked them: the validation objective's, or, for a build from before the
    split (``validation`` None), the searched members'."""
    by = validation or objective
    ranked = sorted((s for s in objective if s != "torch"), key=lambda s: by[s])
    if validation is None:
        head = (
            "| candidate | objective, searched members | objective, left-out members | bar met on |"
        )
        cells = {s: f"{objective[s]:+.4f} | {zero_shot[s]:+.4f}" for s in ranked}
        sep = "|---|---|---|---|"
    else:
        head = f"| candidate | {OBJECTIVE_HEAD} | bar met on |"
        cells = {s: _objective_cells(s, objective, validation, test) for s in ranked}
        sep = "|---|---|---|---|---|"
    return [
        "",
        "The selection, on the test instances (seeds 100-102; RL agents `rl-*`, parametric rules "
        f"otherwise), in the {'validation ' if validation else ''}objective's order. Bar met on: "
        "members that pass on their three episodes, or on confirming ones; only candidates the "
        "ranking reached before the pick got those:",
        "",
        head,
        sep,
        *(
            f"| `{s}`{' (auto)' if s == pick else ''} | {cells[s]} | "
            f"{sum(r['met'] for r in accept[s].values())} of {len(accept[s])} |"
            for s in ranked
        ),
        *(line for s in ranked for line in confirm_lines(accept[s], f"`{s}`: e")),
    ]


def confirm_lines(accept, lead: str = "E") -> list[str]:
    """Markdown: the members judged on confirming episodes, with their paired eval-loss test."""
    rows = [(m, r) for m, r in accept.items() if r["values"]["paired"] is not None]
    if not rows:
        return []
    return [
        "",
        f"{lead}val loss judged on more paired episodes (three did not tell it from seed noise): "
        "worse beyond noise when the mean difference to torch on the same seeds exceeds "
        "2 standard errors.",
        "",
        "| member | episodes | eval loss | torch | mean difference | standard error | "
        "skip rate | torch | precision loss | torch | bar |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {m} | {v['episodes']} | {v['eval_loss']:.4g} | {v['torch_eval_loss']:.4g} | "
            f"{v['paired']['mean_difference']:+.4g} | {v['paired']['standard_error']:.4g} | "
            f"{100 * v['skip_rate']:.2f}% | {100 * v['torch_skip_rate']:.2f}% | "
            f"{100 * v['precision_loss']:.2f}% | {100 * v['torch_precision_loss']:.2f}% | "
            f"{'met' if r['met'] else 'missed'} |"
            for m, r in rows
            for v in [r["values"]]
        ),
    ]


def cards_dict(more: dict[str, dict[str, list]]) -> dict:
    """JSON-ready: member -> scaler -> scorecard dicts of confirming episodes."""
    return {m: {s: [c.to_dict() for c in cs] for s, cs in by.items()} for m, by in more.items()}


def _kinds(r) -> dict[str, str] | set[str]:
    """Member -> "validation" or "test" (a build with the split), else the left-out members."""
    if r.validation or r.test:
        return {**dict.fromkeys(r.validation, "validation"), **dict.fromkeys(r.test, "test")}
    return set(r.left_out)
