"""Run a function on a module once a program has imported it, without importing it first.

``autoscale wrap`` replaces classes of modules that a program may import late or never (FSDP's
``torch.distributed.fsdp.sharded_grad_scaler``, whose package takes seconds to import): importing
them up front would cost every wrapped program that time. :func:`when_imported` calls
``then(module)`` right after the module's code has run, before the importer gets it, so that
``from M import NAME`` already sees the replacement; at once where the module is imported already.
A lookup that does not import (``importlib.util.find_spec``) runs nothing and leaves the hook in
place. ``during`` sets up what the module's own code should see while it runs (the classes it
subclasses as torch has them, not as the wrap replaced them).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["when_imported"]


def when_imported(
    name: str,
    then: Callable[[ModuleType], None],
    during: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """Call ``then(module)`` once the module ``name`` is imported (now, if it is already); its
    code runs inside ``during()``."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
        return
    sys.meta_path.insert(0, _Finder(name, then, during))


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``name`` with the other finders and wraps its loader; leaves once it has run."""

    def __init__(self, name: str, then: Callable[[ModuleType], None], during: Callable) -> None:
        self.name = name
        self.then = then
        self.during = during

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or fullname in sys.modules:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self)
        return spec


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the finder's function on the module it executed."""

    def __init__(self, inner: Any, finder: _Finder) -> None:
        self.inner = inner
        self.finder = finder

    def __getattr__(self, name: str) -> Any:  # resource readers and the like: the real loader's
        return getattr(self.inner, name)

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.inner  # the module keeps its own loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        with self.finder.during():
            self.inner.exec_module(module)
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        try:
            self.finder.then(module)
        except Exception as exc:  # noqa: BLE001 - the program's import goes on as it would
            print(
                f"autoscale wrap: could not patch {module.__name__} ({type(exc).__name__}: {exc})",
                file=sys.stderr,
            )
