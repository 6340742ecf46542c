"""Loaded at interpreter start by a program that ``autoscale wrap`` runs (this folder is put on
its ``PYTHONPATH``). Standard library only, and nothing at all unless ``AUTOSCALE_WRAP`` is set:
it waits for ``import torch`` and then lets :func:`autoscale.observe.wrap.install` replace the
GradScaler classes, so a program that never imports torch pays nothing. Then it runs the
``sitecustomize`` this one shadows, if there is one."""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds ``torch`` with the other finders, and wraps its loader to install the wrap after it."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once: the real finders do the search
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _install()


def _chain():
    """Run the sitecustomize that this one shadows (a distribution's or a venv's)."""
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _install():
    try:
        from autoscale.observe.wrap import install

        install()
    except Exception as exc:  # noqa: BLE001 - the program runs on with torch's GradScaler
        print(
            f"autoscale wrap: could not install autoscale ({type(exc).__name__}: {exc}); "
            "GradScaler stays torch's",
            file=sys.stderr,
        )


if os.environ.get("AUTOSCALE_WRAP"):
    if "torch" in sys.modules:  # imported already (another startup hook)
        _install()
    else:
        sys.meta_path.insert(0, _AfterTorch())
_chain()
