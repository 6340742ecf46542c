"""``autoscale record``."""

from __future__ import annotations

import argparse
import dataclasses

from autoscale.commands.base import Command


class RecordCommand(Command):
    """Record per-step traces of real training for the replay environment."""

    epilog = """example:
  autoscale record --env envs/bad-batches.yaml --steps 256 --out traces/bad-batches.npz
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--env", required=True, help="env spec: a YAML path or a name in envs/")
        parser.add_argument("--steps", type=int, required=True, help="steps recorded per instance")
        parser.add_argument("--out", required=True, help="trace file to write (.npz)")
        parser.add_argument(
            "--instances",
            default="train,test",
            help="instance sets or names, comma-separated (default: train,test)",
        )
        parser.add_argument(
            "--fp16",
            help="fp16 products on a CPU: auto, native or emulated (default: the spec's)",
        )

    def run(self, args: argparse.Namespace) -> int:
        from autoscale.envs import load_env_spec, record_trace

        groups = tuple(s.strip() for s in args.instances.split(",") if s.strip())
        spec = load_env_spec(args.env)
        if args.fp16 is not None:
            spec = dataclasses.replace(spec, workload=spec.workload.replace(fp16=args.fp16))
        trace = record_trace(spec, args.steps, args.out, instances=groups, progress=True)
        n = sum(t.steps for t in trace.instances.values())
        over = sum(int((t.nonfinite | (t.threshold < 0)).sum()) for t in trace.instances.values())
        print(
            f"wrote {args.out}: {len(trace.instances)} instances, {n} steps ({over} with a non-finite loss or negative threshold)"
        )
        return 0
