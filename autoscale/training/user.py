"""A user's own workload: ``module:factory`` or ``path/to/file.py:factory`` wherever a model goes.

The protocol (documented in ``docs/workloads.md``)::

    def make(seed: int, device: str):
        model = ...                                   # a torch.nn.Module (float32 weights)
        return {
            "model": model,
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
            "batches": loader,                        # an iterable of batches (re-iterated per epoch)
            "loss": lambda model, batch: ...,         # a scalar tensor
            "eval": lambda model: ...,                # optional: a float, lower is better
            "lr_scheduler": scheduler,                # optional: stepped after every applied step
        }

A dict or any object with those attributes. autoscale runs the loop: autocast forward, the loss
(times the scenario's weight), ``scaler.scale(loss).backward()``, ``unscale_``, clipping,
``scaler.step``, ``update``. Batches are moved to the device (tensors, and lists, tuples and dicts
of them), and kept in memory once drawn, so that a run can go back to an earlier step (the
environments' resets); the first ``eval_batches`` are held out for the eval loss when there is no
``eval``. The module is imported from the current directory and ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoscale.errors import ConfigError
from autoscale.training.data import BatchStream
from autoscale.training.presets import REFERENCE

__all__ = [
    "UserStream",
    "UserWorkload",
    "build_user_workload",
    "load_factory",
]

REQUIRED = ("model", "optimizer", "batches", "loss")
OPTIONAL = ("eval", "lr_scheduler")


def load_factory(ref: str) -> Callable[..., Any]:
    """The factory a reference names, imported.

    Raises:
        ConfigError: a malformed reference, a module or file that does not import (its own error
            named), or no callable of that name in it.
    """
    m = REFERENCE.match(ref)
    if m is None:
        raise ConfigError(
            f"workload '{ref}' is not MODULE:FACTORY or path/to/file.py:FACTORY (e.g. mypkg.train:make)"
        )
    target, name = m["target"], m["factory"]
    try:
        if target.endswith(".py") or os.sep in target or "/" in target:
            path = Path(target).expanduser()
            if not path.is_file():
                raise ConfigError(f"workload '{ref}': no file '{target}'")
            key = "autoscale_workload_" + re.sub(r"\W", "_", str(path.resolve()))
            module = sys.modules.get(key)
            if module is None:
                spec = importlib.util.spec_from_file_location(key, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[key] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[key]
                    raise
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # "from the current directory", as python -m does
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as exc:  # the module's own error, named
        raise ConfigError(
            f"workload '{ref}': '{target}' does not import ({type(exc).__name__}: {exc}); "
            "fix it, or run from its folder / add it to PYTHONPATH"
        ) from None
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(
            f"workload '{ref}': '{target}' has no callable '{name}'"
            + (f" (it defines {', '.join(found[:8])})" if found else "")
        )
    return factory


@dataclass
class UserWorkload:
    """What a factory returned, checked."""

    ref: str
    model: Any
    optimizer: Any
    batches: Iterable[Any]
    loss: Callable[[Any, Any], Any]
    eval: Callable[[Any], float] | None = None
    lr_scheduler: Any = None


def build_user_workload(ref: str, seed: int, device: str) -> UserWorkload:
    """Call the factory of ``ref`` with ``(seed, device)`` and check what it returned.

    Raises:
        ConfigError: as :func:`load_factory`; the factory raised (its error named); or its value
            lacks a required part or has one of the wrong kind.
    """
    factory = load_factory(ref)
    try:
        made = factory(seed, device)
    except Exception as exc:
        raise ConfigError(
            f"workload '{ref}': the factory raised {type(exc).__name__}: {exc} "
            f"(called with seed={seed}, device='{device}')"
        ) from None
    parts = {}
    for key in REQUIRED + OPTIONAL:
        if isinstance(made, dict):
            parts[key] = made.get(key)
        else:
            parts[key] = getattr(made, key, None)
    missing = [k for k in REQUIRED if parts[k] is None]
    if missing:
        raise ConfigError(
            f"workload '{ref}': the factory's value has no {', '.join(missing)} (it must give "
            f"{', '.join(REQUIRED)}; optionally {', '.join(OPTIONAL)})"
        )
    checks = {
        "model": (isinstance(parts["model"], torch.nn.Module), "a torch.nn.Module"),
        "optimizer": (
            isinstance(parts["optimizer"], torch.optim.Optimizer),
            "a torch.optim.Optimizer",
        ),
        "batches": (isinstance(parts["batches"], Iterable), "an iterable of batches"),
        "loss": (callable(parts["loss"]), "a callable (model, batch) -> scalar tensor"),
        "eval": (parts["eval"] is None or callable(parts["eval"]), "a callable (model) -> float"),
        "lr_scheduler": (
            parts["lr_scheduler"] is None or hasattr(parts["lr_scheduler"], "step"),
            "a learning-rate scheduler (with step())",
        ),
    }
    for key, (ok, what) in checks.items():
        if not ok:
            raise ConfigError(
                f"workload '{ref}': '{key}' must be {what}, got {type(parts[key]).__name__}"
            )
    model_params = {id(p) for p in parts["model"].parameters()}
    opt_params = [p for g in parts["optimizer"].param_groups for p in g["params"]]
    if not opt_params or not all(id(p) in model_params for p in opt_params):
        raise ConfigError(
            f"workload '{ref}': the optimizer must hold the model's own parameters "
            "(build it from model.parameters() in the factory)"
        )
    return UserWorkload(ref, **parts)


def _to(batch: Any, device: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [_to(v, device) for v in batch]
        return type(batch)(moved) if isinstance(batch, list) else tuple(moved)
    return batch


class UserStream(BatchStream):
    """The batches of a :class:`UserWorkload` as a :class:`~autoscale.training.data.BatchStream`.

    Batches are drawn from the workload's iterable once and kept (on the device), so that the
    cursor can go back (snapshots). The first ``eval_batches`` are held out for the eval loss when
    the workload has no ``eval``. An iterable that ends is iterated again (a new epoch); a one-shot
    iterator that ends is cycled from the batches drawn.
    """

    def __init__(self, workload: UserWorkload, *, eval_batches: int, device: Any) -> None:
        super().__init__(batch_size=0, seed=0, eval_batches=eval_batches, device=device)
        self.workload = workload
        self._source = workload.batches
        self._it = iter(self._source)
        self._reiterable = self._it is not self._source  # a list or a DataLoader, not a generator
        self._kept: list[Any] = []
        self._fresh = 0  # batches drawn from the source (the rest repeat them)
        self._exhausted = False
        self._held = (
            [] if workload.eval is not None else [self._draw() for _ in range(eval_batches)]
        )
        if any(b is None for b in self._held):
            raise ConfigError(
                f"workload '{workload.ref}': its batches ran out while holding {eval_batches} out "
                "for the eval loss; give more batches, or an eval callable"
            )

    def _draw(self) -> Any:
        for _ in range(2):  # this epoch, else a new one
            try:
                return _to(next(self._it), self.device)
            except StopIteration:
                if not self._reiterable:
                    return None
                self._it = iter(self._source)
        return None

    def next_batch(self) -> Any:
        while self.cursor >= len(self._kept):
            batch = None if self._exhausted else self._draw()
            if batch is None:
                self._exhausted = True
                if self._fresh == 0:
                    raise ConfigError(
                        f"workload '{self.workload.ref}': its batches ran out before the first step"
                    )
                batch = self._kept[len(self._kept) % self._fresh]
            else:
                self._fresh += 1
            self._kept.append(batch)
        batch = self._kept[self.cursor]
        self.cursor += 1
        return batch

    def eval_batches(self) -> list[Any]:
        return self._held

    def loss(self, model: Any, batch: Any) -> Any:
        out = self.workload.loss(model, batch)
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ConfigError(
                f"workload '{self.workload.ref}': loss must return a scalar tensor, got {shape}"
            )
        return out.reshape(())

    def preference_logprobs(self, model: Any, batch: Any) -> Any:
        raise ConfigError(
            f"workload '{self.workload.ref}': the preference scenario needs a language-model "
            "preset or mlp; a user workload takes clean, bad-batches, small-grads, moving, drift or "
            "token-sum"
        )
