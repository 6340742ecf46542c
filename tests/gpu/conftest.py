"""The CUDA tier: every test here is marked ``cuda`` and skips without a CUDA device.

Run it on a GPU machine with ``python -m pytest -m cuda tests/gpu`` (``experiments/gpu/check.sh``
runs it with the CUDA benchmarks and writes ``experiments/results/gpu.md``).
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    skip = pytest.mark.skip(reason="no CUDA device here: the GPU tier runs on a CUDA machine")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)
