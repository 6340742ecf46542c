"""Agents trained under scenario knobs drawn per episode against the agents trained as the
build trains them today, on the suite's validation members (never trained on; test members are
not touched: this comparison decides how the build trains, so it is a choice).

Each agent is trained the way :class:`autoscale.selection.AutoBuild` trains its candidates (the
replay of the train members' train instances, one held out to select the model), once as today
and once with :class:`autoscale.envs.knobs.Knobs` drawing a loss weight, a drift, a spike and
bad batches for every training episode. All are then run on real steps of the validation
members' held-out instances beside ``torch`` and ``auto``: the validation objective (what the
build ranks by), and the bar on each member.

    OMP_NUM_THREADS=1 python experiments/knob_agents.py [--timesteps 300000] [--steps 256]
                                                        [--agent ppo:1:now ...] [--reuse-agents]
                                                        [--ship]

Writes experiments/results/knob_agents.md and .json; with ``--ship``, the agent that leads on the
validation members ships as the general agent a search's first RL trial starts from
(autoscale/agents/warm/). Agents and traces are cached with the
build's (experiments/.cache/auto), so a build with ``--reuse-agents`` takes them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
CACHE = ROOT / "experiments" / ".cache" / "auto"
DEFAULT_AGENTS = ("ppo:1:now", "dqn:4:now")  # the two that led validation in the last build


def parse_agent(text: str) -> tuple[str, int, bool]:
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit() or parts[2:] not in ([], ["now"]):
        raise ValueError(f"--agent {text!r}: expected ALGO:HISTORY[:now], e.g. ppo:1:now")
    return parts[0], int(parts[1]), parts[2:] == ["now"]


def main(argv=None) -> int:
    from autoscale.selection.auto import BuildSettings

    d = BuildSettings()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--timesteps", type=int, default=d.timesteps)
    p.add_argument("--steps", type=int, default=d.steps, help="real steps of each held-out episode")
    p.add_argument("--agent", action="append", default=[], help="ALGO:HISTORY[:now] (repeatable)")
    p.add_argument("--reuse-agents", action="store_true")
    p.add_argument("--ship", action="store_true",
                   help="ship the agent that leads on validation as autoscale/agents/warm/general")  # fmt: skip
    args = p.parse_args(argv)
    try:
        runs = [parse_agent(a) for a in (args.agent or DEFAULT_AGENTS)]
    except ValueError as exc:
        print(f"knob_agents.py: error: {exc}", file=sys.stderr)
        return 2

    import torch

    from autoscale.envs.episodes import scaler_for
    from autoscale.envs.suite import load_spec
    from autoscale.selection import suite_eval as ev
    from autoscale.selection.agents import train_agents
    from autoscale.selection.auto import AutoBuild

    torch.set_num_threads(1)
    suite = load_spec(ROOT / "envs" / "suite.yaml")
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    base = BuildSettings(timesteps=args.timesteps, steps=args.steps, reuse_agents=args.reuse_agents)
    traces = AutoBuild(suite, base, CACHE).record()
    timings["record"] = time.monotonic() - t0
    from autoscale.selection.agents import agent_name

    agents, info, how = {}, {}, {}
    for knobs in (False, True):
        s = BuildSettings(**{**base.__dict__, "knobs": knobs})
        got, runs_info = train_agents(suite, traces, s, CACHE / "policies", timings, runs=runs)
        agents.update(got)
        info.update(runs_info)
        how.update({agent_name(a, h, now, knobs): (a, h, now) for a, h, now in runs})
    member = suite.members[0]
    factories = {n: (lambda p=p: scaler_for(str(p), member)) for n, p in agents.items()}
    factories["auto"] = lambda: scaler_for("auto", member)
    factories["torch"] = lambda: scaler_for("torch", member)
    validation = [m.name for m in suite.validation]
    t0 = time.monotonic()
    cards = ev.held_out(suite, factories, args.steps, members=validation)
    timings["validation"] = time.monotonic() - t0
    ev.save_cards(cards, CACHE / "knob_agents_cards.json")  # kept before anything reads them
    objective = ev.objective_of(cards, validation, suite.reward)
    misses = {
        n: sorted(m for m, r in ev.acceptance(cards, n).items() if not r["met"])
        for n in factories
        if n != "torch"
    }
    per_member = {
        n: {m: ev.objective_of(cards, [m], suite.reward)[n] for m in validation}
        for n in factories
        if n != "torch"
    }
    out = {
        "command": "python experiments/knob_agents.py " + " ".join(argv or sys.argv[1:]),
        "validation": validation,
        "objective": objective,
        "per_member": per_member,
        "misses_bar": misses,
        "agents": info,
        "timings": timings,
    }
    if args.ship:
        out["shipped"] = ship_best(objective, agents, how, suite, out["command"])
    (RESULTS / "knob_agents.json").write_text(json.dumps(out, indent=1, default=float) + "\n")
    lines = report(out)
    (RESULTS / "knob_agents.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def ship_best(objective, agents, how, suite, command) -> str:
    """Ship the agent with the best validation objective as the general agent searches start
    from (autoscale/agents/warm/)."""
    from autoscale.agents.warm import ship_agent

    best = min(agents, key=objective.get)
    algo, history, now = how[best]
    episode = suite.members[0].episode
    action = (episode.at_scale_time() if now else episode).action.to_dict()
    ship_agent(
        CACHE / "policies" / f"{best}.sb3.zip", name=best, algo=algo, history=history,
        scale_time=now, action=action,
        info={
            "trained": f"{command.strip()}: the suite's train members' replay"
            + (", scenario knobs drawn per episode" if best.endswith("-knobs") else ""),
            "validation_objective": round(float(objective[best]), 4),
            "auto_validation_objective": round(float(objective["auto"]), 4),
        },
    )  # fmt: skip
    return best


def report(out: dict) -> list[str]:
    obj, val = out["objective"], out["validation"]
    ranked = sorted((n for n in obj if n != "torch"), key=obj.get)
    lines = [
        "# Agents trained under drawn scenario knobs, on the validation members",
        "",
        f"`{out['command'].strip()}`. Objective against `torch` on the same held-out real-step "
        "episodes (lower is better), the validation members only: "
        + ", ".join(val)
        + ". The test members were not run.",
        "",
        "| candidate | validation objective | misses the bar on | training |",
        "|---|---|---|---|",
    ]
    for n in ranked:
        a = out["agents"].get(n)
        trained = (
            f"{a['timesteps']} steps, {a['wall_s'] / 60:.1f} min{' (reused)' if a['reused'] else ''}"
            if a
            else "-"
        )
        lines.append(
            f"| {n} | {obj[n]:+.4f} | {', '.join(out['misses_bar'][n]) or '-'} | {trained} |"
        )
    lines += ["", "Per member:", "", "| candidate | " + " | ".join(val) + " |",
              "|---|" + "---|" * len(val)]  # fmt: skip
    for n in ranked:
        lines.append(
            f"| {n} | " + " | ".join(f"{out['per_member'][n][m]:+.4f}" for m in val) + " |"
        )
    pairs = [(n, n + "-knobs") for n in ranked if not n.endswith("-knobs") and n + "-knobs" in obj]
    if pairs:
        lines += ["", "Knobs against none, agent by agent (validation objective):"]
        for plain, knob in pairs:
            diff = obj[knob] - obj[plain]
            lines.append(
                f"- `{knob}` {obj[knob]:+.4f} vs `{plain}` {obj[plain]:+.4f}: "
                f"{'better' if diff < 0 else 'worse'} by {abs(diff):.4f}"
            )
    if out.get("shipped"):
        lines += ["", f"Shipped as the general agent searches start from (autoscale/agents/warm/): "
                  f"`{out['shipped']}`, the best on validation."]  # fmt: skip
    t = out["timings"]
    lines += ["", "Time: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in t.items()) + "."]
    return lines


if __name__ == "__main__":
    sys.exit(main())
