"""How much of a scaler's fixed cost per step is torch's own ops: the floor under its Python.

The small conv net of ``scaler_overhead.py`` (about 0.85 ms a fp16 step on one CPU thread) trains
with ``torch.amp.GradScaler`` and with each ``--rules`` scaler. For each, one step is captured
op by op (every aten op the scaler's ``scale``, ``unscale_``, ``step`` and ``update`` dispatch,
``optimizer.step`` left out); then, beside the real scalers, a loop replays only those ops each
step, on that step's loss and gradients, with nothing else around them: one Python call per op,
the least any implementation of the same ops in Python issues. Blocks of ``--steps`` steps,
every loop in turn (``scaler_overhead.rotation``: each in each place of the order about
equally often, exactly so over rounds that are a multiple of twice the loops); medians per step.

- overhead: the real scaler's step minus GradScaler's;
- ops alone: the replay of its ops minus GradScaler's real step. A target under this cannot be
  met on this machine by removing Python: only by issuing fewer or cheaper ops;
- Python: overhead minus ops alone (what a leaner implementation of the same ops could save).

Usage::

    OMP_NUM_THREADS=1 python experiments/benchmarks/scaler_floor.py --rules torch,auto
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scaler_overhead  # noqa: E402  (the small model and its targets, shared)

import autoscale  # noqa: E402


class _Capture(TorchDispatchMode):
    """Records (op, args, kwargs, result) of every aten op while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.on:
            self.calls.append((func, args, kwargs, out))
        return out


class OpProgram:
    """A captured step's ops, replayable on another step's loss and gradients: each tensor
    argument is the step's loss, a parameter's gradient, the result of an earlier op of the
    program, or a tensor of the scaler's state (used as it was captured). Replayed as generated
    straight-line code (one call of each op's C++ entry a line: no interpretation per argument)."""

    def __init__(self, calls, loss: torch.Tensor, grads: list[torch.Tensor], scaled: torch.Tensor):
        where: dict[int, str] = {id(loss): "loss"}
        for i, g in enumerate(grads):
            where[id(g)] = f"g[{i}]"
        self.consts: list[Any] = []
        lines: list[list[str]] = [[], []]
        part = 0
        for k, (func, args, kwargs, out) in enumerate(calls):
            self.consts.append(func._op)  # the C++ entry of the overload
            fn = len(self.consts) - 1
            call = ", ".join(
                [self._expr(a, where) for a in args]
                + [f"{n}={self._expr(v, where)}" for n, v in kwargs.items()]
            )
            lines[part].append(f"o{k} = c[{fn}]({call})")
            if isinstance(out, (list, tuple)):
                for j, t in enumerate(out):
                    if isinstance(t, torch.Tensor) and id(t) not in where:
                        where[id(t)] = f"o{k}[{j}]"
            elif isinstance(out, torch.Tensor) and id(out) not in where:
                where[id(out)] = f"o{k}"
            if (
                part == 0 and out is scaled
            ):  # the first part returns the scaled loss and its results
                made = ", ".join(f"o{j}" for j in range(k + 1))
                lines[part].append(f"return {where[id(scaled)]}, ({made},)")
                lines[1].append(f"{made}, = s")
                part = 1
        self.n_ops = len(calls)
        src = "def scale(loss, c):\n    " + "\n    ".join(lines[0]) + "\n"
        src += "def after(loss, g, c, s):\n    " + "\n    ".join(lines[1] or ["pass"]) + "\n"
        namespace: dict[str, Any] = {}
        exec(compile(src, "<captured step>", "exec"), namespace)  # noqa: S102
        self.scale, self.after = namespace["scale"], namespace["after"]
        self.source = src
        self._keep = calls  # ids stay unique while the captured tensors live

    def _expr(self, x: Any, where: dict[int, str]) -> str:
        if isinstance(x, torch.Tensor):
            if id(x) in where:
                return where[id(x)]
            self.consts.append(x)
            return f"c[{len(self.consts) - 1}]"
        if isinstance(x, (list, tuple)):
            inner = ", ".join(self._expr(y, where) for y in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner},)"
        if x is None or type(x) in (bool, int):
            return repr(x)
        self.consts.append(x)
        return f"c[{len(self.consts) - 1}]"


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def _forward(model, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        return torch.nn.functional.cross_entropy(model(x).float(), y)


def capture(name: str, model, opt) -> tuple[OpProgram, collections.Counter]:
    """The ops of one step of scaler ``name`` (after warm-up steps), ``optimizer.step`` left out."""
    scaler = (
        torch.amp.GradScaler("cpu")
        if name == "GradScaler"
        else autoscale.get_scaler(name, device="cpu")
    )
    x, y = _batch()
    mode = _Capture()
    real_step = opt.step

    def opt_step(*a, **k):
        was, mode.on = mode.on, False
        try:
            return real_step(*a, **k)
        finally:
            mode.on = was

    opt.step = opt_step
    try:
        with mode:
            for i in range(21):
                opt.zero_grad(set_to_none=True)
                loss = _forward(model, x, y)
                mode.on = i == 20
                scaled = scaler.scale(loss)
                mode.on = False
                scaled.backward()
                grads = [p.grad for p in model.parameters()]
                mode.on = i == 20
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
                mode.on = False
    finally:
        del opt.step
    counts = collections.Counter(str(f) for f, *_ in mode.calls)
    return OpProgram(mode.calls, loss, grads, scaled), counts


class Loop:
    """Steps of the small model with a real scaler, or with a scaler's ops replayed alone."""

    def __init__(self, label: str, model, scaler=None, program: OpProgram | None = None):
        self.label, self.model, self.scaler, self.program = label, model, scaler, program
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.params = list(model.parameters())
        self.x, self.y = _batch()
        self.step_s: list[float] = []

    def block(self, steps: int) -> None:
        model, opt, scaler, prog, x, y = (
            self.model, self.opt, self.scaler, self.program, self.x, self.y
        )  # fmt: skip
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = _forward(model, x, y)
            if prog is None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            else:
                consts = prog.consts
                scaled, made = prog.scale(loss, consts)
                scaled.backward()
                prog.after(loss, [p.grad for p in self.params], consts, made)
                opt.step()
            self.step_s.append(time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rules", default="torch,auto", help="comma-separated scalers")
    p.add_argument("--steps", type=int, default=60, help="steps per block")
    p.add_argument("--repeats", type=int, default=21, help="rounds of blocks")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rules = [r for r in args.rules.split(",") if r]
    base_model = scaler_overhead.small_model()
    loops, counts = [], {}
    for name in ["GradScaler", *rules]:
        model = copy.deepcopy(base_model)
        program, counts[name] = capture(name, model, torch.optim.AdamW(model.parameters()))
        scaler = (
            torch.amp.GradScaler("cpu")
            if name == "GradScaler"
            else autoscale.get_scaler(name, device="cpu")
        )
        loops.append(Loop(name, copy.deepcopy(base_model), scaler=scaler))
        loops.append(Loop(f"{name} ops", copy.deepcopy(base_model), program=program))
    for loop in loops:  # warm-up
        loop.block(args.steps)
        loop.step_s.clear()
    for r in range(args.repeats):
        for loop in scaler_overhead.rotation(loops, r):
            loop.block(args.steps)
    med = {loop.label: statistics.median(loop.step_s) * 1e6 for loop in loops}
    base = med["GradScaler"]
    print(
        f"# torch {torch.__version__}, 1 CPU thread; {args.repeats} rounds of {args.steps}-step "
        f"blocks; medians per step (us)\n"
    )
    print(
        "| scaler | aten ops a step | step us | overhead us | ops alone us | Python us | target us |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in ["GradScaler", *rules]:
        n_ops = sum(counts[name].values())
        over = med[name] - base
        ops = med[f"{name} ops"] - base
        target = "" if name == "GradScaler" else f"{scaler_overhead.small_target(name):.0f}"
        print(
            f"| {name} | {n_ops} | {med[name]:.1f} | {over:+.1f} | {ops:+.1f} | "
            f"{over - ops:+.1f} | {target} |"
        )
    print()
    for name in ["GradScaler", *rules]:
        ops = ", ".join(f"{k.removeprefix('aten.')} x{v}" for k, v in counts[name].most_common())
        print(f"- {name}: {ops}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
