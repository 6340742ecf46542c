"""``autoscale run``, and the workload arguments shared with ``compare`` and ``doctor``."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

from autoscale.commands.base import Command
from autoscale.errors import ConfigError

EPILOG = """examples:
  autoscale run --scaler torch --model gpt2-tiny --steps 200
  autoscale run --scaler deepspeed --scenario bad-batches --param every=5 --steps 300 --plot run.png
  autoscale run --scaler static --scaler-param init_scale=1024 --model mlp --dtype fp16 --json out.json
"""


def workload_help() -> str:
    """The models and scenarios (with their parameters), for the epilog of --help."""
    from autoscale.training.presets import PRESETS
    from autoscale.training.scenarios import list_scenarios, scenario_class

    lines = [
        "models (or a Hugging Face causal-LM id / local folder whose files are on this machine):"
    ]
    lines += [f"  {p.name:<12} {p.description}" for p in PRESETS.values()]
    lines.append("scenarios (--param KEY=VALUE sets a parameter):")
    for name in list_scenarios():
        cls = scenario_class(name)
        params = ", ".join(f"{k}={v:g}" for k, v in cls.defaults.items())
        lines.append(f"  {name:<12} {cls.description}" + (f" [{params}]" if params else ""))
    return "\n".join(lines) + "\n"


def add_env_or_workload(parser: argparse.ArgumentParser) -> None:
    """``--env SPEC`` or ``--workload NAME [--scenario S]`` (one of them), for commands that work
    on an env spec; :func:`env_spec_from_args` makes the spec."""
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--env", help="env spec: a YAML path or a name in envs/")
    which.add_argument(
        "--workload",
        "--model",
        dest="model",
        help="a model or your own workload (module:factory or file.py:factory) on the "
        "defaults of envs/ for --scenario",
    )
    parser.add_argument(
        "--scenario", help="with --workload: the failure mode (default bad-batches)"
    )


def env_spec_from_args(args: argparse.Namespace, load: Any) -> Any:
    """The spec of :func:`add_env_or_workload`'s arguments: ``load(args.env)``, or the defaults
    for ``--workload``, whose user workloads take one real step first (one line if broken)."""
    if args.env is not None:
        return load(args.env)
    from autoscale.search.workload import base_spec, check_user_workloads

    spec = base_spec(model=args.model, scenario=args.scenario)
    check_user_workloads(spec)
    return spec


def add_workload_arguments(parser: argparse.ArgumentParser, *, steps: int | None = 200) -> None:
    """The flags that make a :class:`~autoscale.training.WorkloadSpec` (and ``--steps``)."""
    from autoscale.training import list_models, list_scenarios

    g = parser.add_argument_group("workload")
    g.add_argument(
        "--model",
        "--workload",
        dest="model",
        default="gpt2-tiny",
        help=f"preset ({', '.join(list_models())}), Hub id, local folder, or your own workload "
        "as module:factory or path/to/file.py:factory (docs/workloads.md)",
    )
    g.add_argument(
        "--scenario",
        default="clean",
        help=f"failure mode to reproduce ({', '.join(list_scenarios())})",
    )
    g.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="scenario parameter (repeatable)",
    )
    if steps is not None:
        g.add_argument(
            "--steps", type=int, default=steps, help=f"optimizer steps (default {steps})"
        )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--dtype", default="fp16", help="autocast dtype: fp16, bf16 or fp32 (default fp16)"
    )
    g.add_argument(
        "--fp16",
        default="auto",
        help="fp16 products on a CPU: native (torch's kernels), emulated (fp32 products rounded "
        "to fp16) or auto (emulated where that is faster; default)",
    )
    g.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1... (default: cuda when present)"
    )
    g.add_argument("--batch-size", type=int, default=4)
    g.add_argument("--seq-len", type=int, default=64)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--grad-accum", type=int, default=1)
    g.add_argument(
        "--clip",
        default="1.0",
        help="max gradient norm; none (or 0) disables clipping (default 1.0)",
    )
    g.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="text file or folder (default: pydoc_data.topics)",
    )
    g.add_argument("--init", default="auto", help="auto, pretrained or random (default auto)")
    g.add_argument("--eval-batches", type=int, default=4)


def spec_from_args(args: argparse.Namespace):
    """Build and validate the WorkloadSpec the workload flags describe."""
    from autoscale.training import WorkloadSpec
    from autoscale.training.data import check_data

    clip = None if str(args.clip).lower() in ("none", "off", "0") else _number("--clip", args.clip)
    check_data(args.model, args.data)
    return WorkloadSpec(
        model=args.model,
        scenario=args.scenario,
        scenario_params=parse_pairs(args.param, "--param"),
        dtype=args.dtype,
        fp16=args.fp16,
        device=args.device,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        grad_accum=args.grad_accum,
        clip=clip,
        data=args.data,
        init=args.init,
        seed=args.seed,
        eval_batches=args.eval_batches,
    )


def _number(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag} expects a number or 'none', got {text!r}") from None


def parse_pairs(items: list[str], flag: str) -> dict[str, Any]:
    """``["k=v", ...]`` -> ``{k: v}``, values parsed as YAML scalars (``5`` -> 5, ``1e-4`` -> 1e-4)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        if isinstance(parsed, str):  # YAML 1.1 reads 1e-4 as a string
            with contextlib.suppress(ValueError):
                parsed = float(parsed)
        out[key.strip()] = parsed
    return out


def check_steps(steps: int) -> int:
    if steps <= 0:
        raise ConfigError(f"--steps must be a positive number of optimizer steps, got {steps}")
    return steps


def check_output(
    path: str | None, flag: str, *, folder: bool = False, parents: bool = False
) -> None:
    """Refuse, before any work, an output the command could not write: a file ``path`` (or, with
    ``folder``, a folder of files) whose folder does not exist (with ``parents``, or a folder:
    whose nearest existing folder), is a file, or takes no new entry (read-only, ``/proc``: a
    probe tells, as permission bits do not for root)."""
    import tempfile

    if path is None:
        return
    where = Path(path).expanduser().absolute()
    if not folder and where.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give the path of a file to write")
    where = where if folder else where.parent
    while (folder or parents) and not where.exists() and where != where.parent:
        where = where.parent  # made with its parents by the writer
    if not where.is_dir():
        what = "is a file" if where.exists() else "does not exist"
        raise ConfigError(f"{flag} {path}: folder {where} {what}; create it or pick another path")
    try:
        Path(tempfile.mkdtemp(prefix=".autoscale-probe-", dir=where)).rmdir()
    except OSError as exc:
        raise ConfigError(
            f"{flag} '{path}': cannot write in {where} ({exc.strerror or exc}); pick a path in a "
            "writable folder"
        ) from None


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write strict JSON (non-finite floats as null); ConfigError if the path is not writable."""
    from autoscale.training.scorecard import json_safe

    try:
        Path(path).write_text(json.dumps(json_safe(payload), indent=2, allow_nan=False) + "\n")
    except OSError as exc:
        raise ConfigError(f"cannot write JSON '{path}': {exc.strerror or exc}") from exc


def describe(spec, *, seed: bool = True, fp16_path: str | None = None) -> str:
    """One line naming the workload (and the fp16 path a run took, when given)."""
    params = ", ".join(f"{k}={v}" for k, v in spec.scenario_params.items())
    scenario = f"{spec.scenario}({params})" if params else spec.scenario
    dtype = f"{spec.dtype} ({fp16_path})" if fp16_path else spec.dtype
    return f"{spec.model} / {scenario} / {dtype}" + (f" / seed {spec.seed}" if seed else "")


def add_run_arguments(
    parser: argparse.ArgumentParser, *, scaler_param_help: str, json_help: str, plot_help: str
) -> None:
    """``--scaler-param``, the workload flags and the output flags, shared by run and compare."""
    parser.add_argument(
        "--scaler-param", action="append", default=[], metavar="KEY=VALUE", help=scaler_param_help
    )
    add_workload_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help=json_help)
    out.add_argument("--plot", metavar="PATH", help=plot_help)
    out.add_argument("--quiet", action="store_true", help="no progress bar")


def read_run_arguments(args: argparse.Namespace) -> tuple[Any, int, dict[str, Any]]:
    """Validate what :func:`add_run_arguments` declared: (spec, steps, scaler overrides)."""
    spec = spec_from_args(args)
    steps = check_steps(args.steps)
    check_output(args.json, "--json")
    check_output(args.plot, "--plot")
    return spec, steps, parse_pairs(args.scaler_param, "--scaler-param")


class RunCommand(Command):
    """Train one workload under one loss scaler and print its scorecard."""

    @property
    def epilog(self) -> str:
        return EPILOG + "\n" + workload_help()

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--scaler",
            default="torch",
            help="registered scaler or exported policy (autoscale list)",
        )
        add_run_arguments(
            parser,
            scaler_param_help="scaler keyword argument (repeatable)",
            json_help="write spec, scorecard and per-step trajectory as JSON",
            plot_help="write a PNG of the scale trajectory and the loss",
        )

    def run(self, args: argparse.Namespace) -> int:
        from autoscale.training import TrainingRun
        from autoscale.training.report import format_scorecard, plot_run, trajectory

        spec, steps, overrides = read_run_arguments(args)
        run = TrainingRun(spec, args.scaler, **overrides)
        card = run.run(steps, progress=not args.quiet)
        title = f"{args.scaler} on {describe(spec, fp16_path=run.fp16_path)}"
        print(format_scorecard(card, title=f"scorecard: {title}"))
        if args.json:
            write_json(
                args.json,
                {
                    "spec": spec.to_dict(),
                    "fp16_path": run.fp16_path,
                    "scaler": run.scaler_spec,
                    "model": {"init": run.built.init, "source": run.built.source},
                    "scorecard": card.to_dict(),
                    "trajectory": trajectory(run.records),
                },
            )
        if args.plot:
            plot_run(run.records, args.plot, title=title)
        return 0
