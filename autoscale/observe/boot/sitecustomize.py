"""Loaded at interpreter start by a program that ``autoscale wrap`` runs (this folder is put on
its ``PYTHONPATH``). Standard library only, and nothing at all unless ``AUTOSCALE_WRAP`` is set:
it waits for ``import torch`` and then lets :func:`autoscale.observe.wrap.install` replace the
GradScaler classes, so a program that never imports torch pays nothing. Then it runs the
``sitecustomize`` this one shadows, if there is one.

It leaves an empty ``<pid>-<ns>.boot`` file in the launcher's summary folder (the launcher then
knows that a Python of the command started wrapped), and a ``.fail`` file holding the error where
the wrap could not install (the exit line names it). Python run with ``-S`` (no
``sitecustomize``), ``-E`` or ``-I`` (no ``PYTHONPATH``) never reaches this file: the launcher
finds no ``.boot`` file and says why."""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_installed = []  # once per process


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds ``torch`` with the other finders and wraps its loader, so that the wrap installs when
    torch's module is executed: the import itself, not a lookup. ``importlib.util.find_spec("torch")``
    (``transformers``, ``datasets``, ``accelerate`` ask it at import) executes nothing, so the finder
    stays on ``sys.meta_path`` until the wrap is installed.

    A program that imports autoscale before torch (its integrations, ``get_scaler``) imports torch
    from inside autoscale's own import, where the wrap cannot import autoscale yet: autoscale's
    loader is wrapped too, and the wrap installs once autoscale's import has finished."""

    def find_spec(self, name, path=None, target=None):
        if name not in _WAITS_FOR or "torch" in sys.modules and name == "torch":
            return None
        if name == "autoscale" and "torch" in sys.modules:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self)
        return spec


_WAITS_FOR = ("torch", "autoscale")


class _Loader(importlib.abc.Loader):
    """torch's (or autoscale's) own loader, and the wrap's install once it has executed it."""

    def __init__(self, inner, finder):
        self.inner = inner
        self.finder = finder

    def __getattr__(self, name):  # resource readers and the like: the module's own loader answers
        return getattr(self.inner, name)

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        # the module keeps its own loader (importlib.resources, pickle and torch read it)
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        inside = module.__name__ != "autoscale" and _initializing("autoscale")
        if "torch" not in sys.modules or inside:
            return  # autoscale first, torch from inside it: its loader installs when it is done
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        _install()


def _initializing(name):
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _chain():
    """Run the sitecustomize that this one shadows (a distribution's or a venv's)."""
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _install():
    if _installed:
        return
    _installed.append(True)
    try:
        from autoscale.observe.wrap import install

        install()
    except Exception as exc:  # noqa: BLE001 - the program runs on with torch's GradScaler
        why = f"{type(exc).__name__}: {exc}"
        print(
            f"autoscale wrap: could not install autoscale ({why}); GradScaler stays torch's",
            file=sys.stderr,
        )
        _mark("fail", why)


def _mark(kind, text=""):
    """Leave a ``.boot`` or ``.fail`` file for the launcher (never raises)."""
    try:
        import json
        import time

        folder = json.loads(os.environ["AUTOSCALE_WRAP"]).get("summary_dir")
        if folder:
            name = os.path.join(folder, f"{os.getpid()}-{time.time_ns()}.{kind}")
            with open(name, "w") as fh:
                fh.write(text)
    except Exception:  # noqa: BLE001, S110 - the program runs on, the exit line says less
        pass


if os.environ.get("AUTOSCALE_WRAP"):
    _mark("boot")
    if "torch" in sys.modules:  # imported already (another startup hook)
        _install()
    else:
        sys.meta_path.insert(0, _AfterTorch())
_chain()
