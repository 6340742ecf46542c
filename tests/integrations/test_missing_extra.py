"""An integration whose framework is not installed says which extra installs it, in one line
(``MissingExtraError``, an ImportError), as a command whose extra is missing does."""

from __future__ import annotations

import importlib
import sys

import pytest

from autoscale.errors import MissingExtraError


def _hide(monkeypatch, *modules: str) -> None:
    """Make ``modules`` unimportable, and the integration modules imported afresh."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)
    for name in list(sys.modules):
        if name.startswith("autoscale.integrations."):
            monkeypatch.delitem(sys.modules, name)


def test_lightning_without_the_extra(monkeypatch):
    _hide(monkeypatch, "lightning", "lightning.pytorch", "pytorch_lightning")
    with pytest.raises(MissingExtraError) as info:
        importlib.import_module("autoscale.integrations.lightning")
    assert str(info.value) == (
        "autoscale.integrations.lightning needs the 'integrations' extra (lightning is not "
        "installed): pip install 'autoscale[integrations]'"
    )


def test_make_accelerator_without_the_extra(monkeypatch):
    _hide(monkeypatch, "accelerate")
    from autoscale.integrations import make_accelerator

    with pytest.raises(MissingExtraError, match=r"pip install 'autoscale\[integrations\]'$"):
        make_accelerator("auto")


def test_the_trainer_without_transformers(monkeypatch):
    _hide(monkeypatch, "transformers")
    with pytest.raises(MissingExtraError) as info:
        importlib.import_module("autoscale.integrations.trainer")
    assert str(info.value).endswith(
        "needs the 'hf' extra (transformers is not installed): pip install 'autoscale[hf]'"
    )
