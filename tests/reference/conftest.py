"""Differential tests against the upstream implementations of the built-in rules.

The upstream packages come from the ``reference`` extra (``pip install -e '.[reference]'``);
a test whose package is missing skips and says which package to install.
"""

from __future__ import annotations

import importlib
import logging

import pytest


@pytest.fixture(scope="module")
def deepspeed_group(tmp_path_factory):
    """A 1-rank gloo group for DeepSpeed's comm layer (its loss scaler and config read the rank).

    DeepSpeed's comm layer would first build its shared-memory all-reduce kernel (a C++ build of
    about 40 s here); a 1-rank group never all-reduces, so it goes without it, as DeepSpeed does
    off Linux. The group is torn down after the module, so other tests can make their own.
    """
    pytest.importorskip(
        "deepspeed", reason="install the reference extra: pip install -e '.[reference]'"
    )
    import torch.distributed as dist
    from deepspeed.utils import logger

    ds_comm = importlib.import_module("deepspeed.comm.comm")
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    level = logger.level
    logger.setLevel(logging.WARNING)  # one INFO line per overflow otherwise
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path_factory.mktemp('ds') / 'rendezvous'}",
        rank=0,
        world_size=1,
    )
    patch = pytest.MonkeyPatch()
    patch.setattr(ds_torch, "build_shm_op", lambda: None)
    ds_comm.init_distributed(dist_backend="gloo")
    yield
    ds_comm.cdb = None
    dist.destroy_process_group()
    patch.undo()
    logger.setLevel(level)
