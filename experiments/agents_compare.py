"""PPO, DQN and SAC, with and without history, trained across the suite and judged on what they
never saw.

The contextual-RL protocol of ``envs/suite.yaml``: every agent trains on the replay of the searched
members' *train* instances (episodes of ``--horizon`` steps starting anywhere in recorded runs of
twice that; one train instance per member held out to select the agent on, SB3's EvalCallback),
and is judged on real steps of every member's *test* instances, the left-out members (the
autoencoder, the CNN, the preference scenario) included, next to ``torch``, the built-in
``amax-loss`` and the shipped ``auto``. PPO and DQN pick one of the suite's discrete log2 deltas;
SAC sets a continuous log2 delta (``max_delta`` 2 bits, rounded to 1/8 bit). ``--history`` stacks
that many feature vectors (1: the current one only). ``--scale-time`` trains agents that act when
the loss is scaled (``episode.scale_time``: they see this step's loss; PPO and DQN may also drop
one step's scale by 4, 8, 12 or 16 bits), named ``ALGO-hH-now``.

    OMP_NUM_THREADS=1 python experiments/agents_compare.py [--timesteps 20000] [--horizon 128] \\
        [--steps 128] [--algos ppo,dqn,sac] [--histories 1,4] [--scale-time] [--out FILE]

Writes experiments/results/agents_compare.md (and .json). Traces and agents are cached in
experiments/.cache/agents_compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
RESULTS = ROOT / "experiments" / "results"
CACHE = ROOT / "experiments" / ".cache" / "agents_compare"
MODES = {"ppo": "discrete", "dqn": "discrete", "sac": "continuous"}


def with_action(suite, mode: str):
    """The suite with every member's action in ``mode`` (continuous: +-2 bits, 1/8-bit steps)."""
    from autoscale.scalers.actions import ActionMap

    if mode == "discrete":
        return suite
    action = ActionMap.from_dict({"mode": "continuous", "max_delta": 2.0, "resolution": 0.125})

    def shape(m):
        return dataclasses.replace(m, episode=dataclasses.replace(m.episode, action=action))

    return suite.replace_members(shape)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--timesteps", type=int, default=20_000, help="replay steps of training each")
    p.add_argument("--horizon", type=int, default=128, help="replayed episode length")
    p.add_argument("--steps", type=int, default=128, help="real steps of each held-out episode")
    p.add_argument("--algos", default="ppo,dqn,sac")
    p.add_argument("--histories", default="1,4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale-time", action="store_true",
                   help="agents that act when the loss is scaled, seeing it")  # fmt: skip
    p.add_argument("--reuse-agents", action="store_true",
                   help="take the agents an earlier run trained with these settings")  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS / "agents_compare.md")
    args = p.parse_args(argv)
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    histories = [int(h) for h in args.histories.split(",")]
    unknown = [a for a in algos if a not in MODES]
    if unknown:
        print(f"agents_compare.py: error: --algos {','.join(unknown)}: known are "
              f"{', '.join(MODES)}", file=sys.stderr)  # fmt: skip
        return 2

    import torch

    torch.set_num_threads(1)
    from suite_pages import table

    from autoscale.agents.train import train_agent
    from autoscale.envs.episodes import scaler_for
    from autoscale.envs.suite import load_spec
    from autoscale.scalers import find_policy
    from autoscale.selection.agents import rl_suite, with_scale_time
    from autoscale.selection.auto import AutoBuild, BuildSettings
    from autoscale.selection.suite_eval import acceptance, held_out, objective_of, save_cards

    suite = load_spec(ROOT / "envs" / "suite.yaml")
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    settings = BuildSettings(horizon=args.horizon, seed=args.seed)
    traces = AutoBuild(suite, settings, CACHE, log=lambda t: print(t, flush=True)).record()
    timings["record"] = time.monotonic() - t0

    agents: dict[str, Path] = {}
    runs: dict[str, dict] = {}
    ledger = CACHE / "policies" / "agents.json"
    known = json.loads(ledger.read_text()) if ledger.is_file() else {}
    for algo in algos:
        for history in histories:
            name = f"{algo}-h{history}" + ("-now" if args.scale_time else "")
            mine = {"timesteps": args.timesteps, "horizon": args.horizon, "seed": args.seed}
            entry = known.get(name)
            folder = CACHE / "policies" / name
            if args.reuse_agents and entry and entry["settings"] == mine and folder.is_dir():
                agents[name], runs[name] = folder, {**entry["run"], "reused": True}
                print(f"{name}: reused from {folder}", flush=True)
                continue
            t0 = time.monotonic()
            spec = rl_suite(with_action(suite, MODES[algo]), args.horizon, history)
            if args.scale_time:
                spec = with_scale_time(spec)
            result = train_agent(
                spec, algo, args.timesteps, replay=traces, seed=args.seed, progress=True,
                export_name=name, export_dir=str(CACHE / "policies"), force=True,
                eval_freq=max(args.horizon * 8, args.timesteps // 10),
            )  # fmt: skip
            timings[f"train {name}"] = time.monotonic() - t0
            agents[name] = result.policy_dir
            runs[name] = {
                "timesteps": result.timesteps,
                "wall_s": result.wall_s,
                "best_eval_reward": result.best_eval_reward,
            }
            known[name] = {"settings": mine, "run": runs[name]}
            ledger.write_text(json.dumps(known, indent=1, default=float) + "\n")
            runs[name] = {**runs[name], "reused": False}
            print(f"{name}: {result.timesteps} steps in {result.wall_s:.0f} s, best eval reward "
                  f"{result.best_eval_reward:.3f}", flush=True)  # fmt: skip

    member = suite.members[0]
    factories = {n: (lambda p=p: scaler_for(str(p), member)) for n, p in agents.items()}
    factories["amax-loss"] = lambda: scaler_for("amax-loss", member)
    auto = find_policy("auto")
    if auto is not None:
        factories["auto"] = lambda: scaler_for(str(auto), member)
    factories["torch"] = lambda: scaler_for("torch", member)
    t0 = time.monotonic()
    cards = held_out(suite, factories, args.steps)
    timings["judge"] = time.monotonic() - t0
    searched = [m.name for m in suite.members]
    left = [m.name for m in suite.left_out]
    weights = suite.reward
    obj = objective_of(cards, searched, weights)
    zero = objective_of(cards, left, weights)
    names = [n for n in factories if n != "torch"]
    met = {n: sum(r["met"] for r in acceptance(cards, n).values()) for n in names}
    ranked = sorted(names, key=lambda n: obj[n])
    n_members = len(searched) + len(left)

    lines = [
        "# Agents across the suite: "
        + ", ".join(a.upper() for a in algos)
        + (", acting at scale time" if args.scale_time else "")
        + ", with and without history",
        "",
        f"`OMP_NUM_THREADS=1 python experiments/agents_compare.py {' '.join(argv or sys.argv[1:])}`".replace(
            " `", "`"
        ),
        "",
        "Time: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()) + ".",
        "",
        f"Every agent trained on {args.timesteps:,} replayed steps of the searched members' train "
        f"instances ({len(searched)} members, episodes of {args.horizon} steps), selected on one "
        "held-out train instance per member, then judged on real steps of every member's test "
        f"instances (seeds 100-102, {args.steps} steps; {len(left)} members left out of training). "
        "Objective against torch on the same episodes (lower is better, below 0 beats torch); "
        "bar: skip rate at most torch's + 0.5 points, eval loss within seed noise, precision "
        "loss lower where torch underflows, per member on its three episodes (a screen: the "
        "`auto` build confirms misses on eval loss alone with more paired episodes).",
        "",
        "| policy | objective, searched members | objective, left-out members | bar met on | "
        "training steps | training time | best eval reward |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in ranked:
        r = runs.get(n)
        train = (
            f"{r['timesteps']:,} | {r['wall_s'] / 60:.1f} min"
            + (" (an earlier run's)" if r["reused"] else "")
            + f" | {r['best_eval_reward']:.3f}"
            if r
            else "- | - | -"
        )
        lines.append(
            f"| `{n}` | {obj[n]:+.4f} | {zero[n]:+.4f} | {met[n]} of {n_members} | {train} |"
        )
    lines += ["| `torch` | +0.0000 | +0.0000 | (the reference) | - | - | - |", ""]
    lines += table(cards, searched + left, set(left), weights, [*ranked, "torch"])
    args.out.write_text("\n".join(lines) + "\n")
    save_cards(
        cards, args.out.with_suffix(".json"), objective=obj, zero_shot=zero, bar_met=met,
        agents=runs, timings=timings,
    )  # fmt: skip
    print("\n".join(lines[: 12 + len(ranked) + 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
