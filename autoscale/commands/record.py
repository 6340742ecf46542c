"""``autoscale record``."""

from __future__ import annotations

import argparse
import dataclasses

from autoscale.commands.base import Command


class RecordCommand(Command):
    """Record per-step traces of real training for the replay environment."""

    epilog = """examples:
  autoscale record --env envs/bad-batches.yaml --steps 256 --out traces/bad-batches.npz
  autoscale record --env envs/suite.yaml --steps 512 --out traces/suite   (a folder: one trace per member)
  autoscale record --workload experiments/workloads/cnn.py:make --steps 256 --out traces/cnn.npz
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from autoscale.commands.run import add_env_or_workload

        add_env_or_workload(parser)
        parser.add_argument("--steps", type=int, required=True, help="steps recorded per instance")
        parser.add_argument(
            "--out", required=True, help="trace file to write (.npz); for a suite, a folder"
        )
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
        from autoscale.commands.run import check_output, env_spec_from_args
        from autoscale.envs import record_trace
        from autoscale.envs.suite import SuiteSpec, load_spec
        from autoscale.envs.traces import record_suite

        spec = env_spec_from_args(args, load_spec)
        # a trace is written once every step is recorded: a path it cannot take fails now
        suite = isinstance(spec, SuiteSpec)
        check_output(args.out, "--out", folder=suite, parents=not suite)
        if args.fp16 is not None:
            fp16 = args.fp16
            spec = (
                spec.replace_members(
                    lambda m: dataclasses.replace(m, workload=m.workload.replace(fp16=fp16))
                )
                if isinstance(spec, SuiteSpec)
                else dataclasses.replace(spec, workload=spec.workload.replace(fp16=fp16))
            )
        if isinstance(spec, SuiteSpec):
            traces = record_suite(spec, args.steps, args.out, progress=True)
            n = sum(t.steps for tr in traces.values() for t in tr.instances.values())
            print(f"wrote {len(traces)} member traces ({n} steps) to {args.out}/")
            return 0
        groups = tuple(s.strip() for s in args.instances.split(",") if s.strip())
        trace = record_trace(spec, args.steps, args.out, instances=groups, progress=True)
        n = sum(t.steps for t in trace.instances.values())
        over = sum(int((t.nonfinite | (t.threshold < 0)).sum()) for t in trace.instances.values())
        print(
            f"wrote {args.out}: {len(trace.instances)} instances, {n} steps ({over} with a non-finite loss or negative threshold)"
        )
        return 0
