"""What fine-tuning the shipped general agent on a user's replay changes, on held-out real steps.

A search with ``--space rl|both`` starts its first RL trial from the agent shipped in
``autoscale/agents/warm/`` and fine-tunes it on the user's replay
(:class:`autoscale.search.agent_trials.RLObjective`). This measures that step alone, per
workload: the train instances' traces are recorded as a search records them; the shipped agent is
exported as it is (**before**), fine-tuned for ``--timesteps`` replay steps (**after**), and, for
comparison, an agent of the same algorithm is trained from nothing for as many steps (**cold**).
All three run beside ``torch`` and ``auto`` on real steps of the workload's held-out (test)
instances; the objective is against ``torch`` on the same episodes (lower is better), as the
search's validation has it.

    OMP_NUM_THREADS=1 python experiments/warm_start.py [--workload mlp/bad-batches ...]
                                                       [--timesteps 40000] [--steps 128]

Writes experiments/results/warm_start.md and .json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
CACHE = ROOT / "experiments" / ".cache" / "warm_start"
DEFAULT_WORKLOADS = ("mlp/bad-batches", "gpt2-tiny/bad-batches", "mlp/small-grads")


def measure(workload: str, agent, timesteps: int, steps: int, horizon: int, seed: int) -> dict:
    from autoscale.agents.train import export_agent, saved_agent, train_agent
    from autoscale.envs.episodes import scaler_for
    from autoscale.envs.suite import as_suite
    from autoscale.search.plan import shape_suite
    from autoscale.search.traces import load_traces
    from autoscale.search.workload import base_spec
    from autoscale.selection import suite_eval as ev

    model, scenario = workload.split("/")
    spec = base_spec(model=model, scenario=scenario)
    suite = shape_suite(as_suite(spec), horizon, 3, 1)
    t0 = time.monotonic()
    traces, _ = load_traces(
        suite, CACHE, 2 * horizon, cost=lambda m, n: 0.0, stop_at=math.inf, progress=True
    )
    timings = {"record": time.monotonic() - t0}

    def for_agent(m, episode):  # one train instance selects the model, as a search's trial does
        train = m.instances["train"]
        return dataclasses.replace(
            m, episode=episode, instances={"train": train[:-1], "test": train[-1:]}
        )

    warm_spec = dataclasses.replace(
        suite,
        members=tuple(for_agent(m, agent.episode_for(m.episode)) for m in suite.members),
        left_out=(),
    )
    cold_spec = dataclasses.replace(
        suite,
        members=tuple(
            for_agent(m, m.episode.at_scale_time() if agent.scale_time else m.episode)
            for m in suite.members
        ),
        left_out=(),
    )
    out_dir = Path(tempfile.mkdtemp(prefix="warm-start-"))
    paths = {
        "before": export_agent(
            saved_agent(agent.algo, agent.model),
            warm_spec,
            "before",
            export_dir=out_dir,
            replay=traces,
        )  # fmt: skip
    }
    for label, spec_, init in (("after", warm_spec, agent.model), ("cold", cold_spec, None)):
        t0 = time.monotonic()
        result = train_agent(
            spec_, agent.algo, timesteps, replay=traces, seed=seed, init=init, progress=True
        )
        timings[f"train {label}"] = time.monotonic() - t0
        paths[label] = export_agent(result.model, spec_, label, export_dir=out_dir, replay=traces)
    member = suite.members[0]
    factories = {n: (lambda p=p: scaler_for(str(p), member)) for n, p in paths.items()}
    factories["auto"] = lambda: scaler_for("auto", member)
    factories["torch"] = lambda: scaler_for("torch", member)
    t0 = time.monotonic()
    cards = ev.held_out(suite, factories, steps)
    timings["held-out"] = time.monotonic() - t0
    names = [m.name for m in suite.members]
    objective = ev.objective_of(cards, names, suite.reward)
    skipped = {
        n: sum(c.skip_rate for m in names for c in cards[n][m])
        / sum(len(cards[n][m]) for m in names)
        for n in factories
    }
    precision = {
        n: sum(c.precision_loss for m in names for c in cards[n][m])
        / sum(len(cards[n][m]) for m in names)
        for n in factories
    }
    return {
        "objective": objective,
        "skipped": skipped,
        "precision_loss": precision,
        "episodes": sum(len(cards["torch"][m]) for m in names),
        "timings": timings,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", action="append", default=[], help="MODEL/SCENARIO (repeatable)")
    p.add_argument("--timesteps", type=int, default=40_000, help="replay steps of fine-tuning")
    p.add_argument("--steps", type=int, default=128, help="real steps of each held-out episode")
    p.add_argument("--horizon", type=int, default=256, help="replayed episode length")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    from autoscale.agents.warm import shipped_agent

    torch.set_num_threads(1)
    agent = shipped_agent()
    if agent is None:
        print("warm_start.py: error: no general agent ships in autoscale/agents/warm/; "
              "make one with experiments/knob_agents.py --ship", file=sys.stderr)  # fmt: skip
        return 2
    results = {
        w: measure(w, agent, args.timesteps, args.steps, args.horizon, args.seed)
        for w in (args.workload or DEFAULT_WORKLOADS)
    }
    out = {
        "command": "python experiments/warm_start.py " + " ".join(argv or sys.argv[1:]),
        "agent": {"name": agent.name, "algo": agent.algo, **agent.info},
        "timesteps": args.timesteps,
        "steps": args.steps,
        "results": results,
    }
    (RESULTS / "warm_start.json").write_text(json.dumps(out, indent=1, default=float) + "\n")
    lines = report(out)
    (RESULTS / "warm_start.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def report(out: dict) -> list[str]:
    a = out["agent"]
    lines = [
        "# Fine-tuning the shipped general agent on a workload's replay",
        "",
        f"`{out['command'].strip()}`. The agent: `{a['name']}` ({a['algo']}; {a.get('trained', '')})."
        f" Fine-tuned for {out['timesteps']} replay steps of the workload's train instances; "
        f"`cold` is the same algorithm trained from nothing for as many. Held-out: real steps "
        f"({out['steps']} per episode) of the workload's test instances; objective against `torch` on "
        "the same episodes (lower is better; the search's validation objective).",
        "",
        "| workload | before (as shipped) | after fine-tuning | cold | auto | skipped before / after / auto | precision loss before / after / auto |",
        "|---|---|---|---|---|---|---|",
    ]
    for w, r in out["results"].items():
        o, s, pl = r["objective"], r["skipped"], r["precision_loss"]
        lines.append(
            f"| {w} | {o['before']:+.4f} | {o['after']:+.4f} | {o['cold']:+.4f} | {o['auto']:+.4f} | "
            f"{s['before']:.2%} / {s['after']:.2%} / {s['auto']:.2%} | "
            f"{pl['before']:.2%} / {pl['after']:.2%} / {pl['auto']:.2%} |"
        )
    lines.append("")
    for w, r in out["results"].items():
        lines.append(
            f"- {w}: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in r["timings"].items())
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
