"""The private members of torch that autoscale relies on, checked once when the scalers load.

:class:`~autoscale.scalers.scaler.LossScaler` subclasses ``torch.amp.GradScaler`` and overrides or
calls members that torch does not promise to keep (``_maybe_opt_step``, ``_check_inf_per_device``,
the per-optimizer state that ``_refresh_per_optimizer_state`` makes); the rules and the gradient
reader call private foreach kernels; ``autoscale wrap``'s instruments and the fp16 workload hook
into ``torch.utils._python_dispatch`` and ``_pytree``. pyproject's torch range is the releases
these were tested on (:data:`TORCH_RANGE`). A torch that lacks one of them fails here, at import,
with one line naming the torch version and the member, rather than inside a training step; the
CLI prints that line and exits with 2.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

from autoscale.errors import TorchVersionError

__all__ = ["REQUIRED", "SCALER_STATE", "TORCH_RANGE", "check_torch", "missing_member"]

#: The torch releases autoscale claims (pyproject's ``dependencies``; a test keeps the two equal):
#: those its tests run on.
TORCH_RANGE = ">=2.13,<2.15"

#: Dotted names, each a module or a module's attribute (a class's member included).
REQUIRED: tuple[str, ...] = (
    "torch.amp.grad_scaler.GradScaler._maybe_opt_step",
    "torch.amp.grad_scaler.GradScaler._check_inf_per_device",
    "torch.amp.grad_scaler.GradScaler._lazy_init_scale_growth_tracker",
    "torch.amp.grad_scaler.GradScaler._check_scale_growth_tracker",
    "torch.amp.grad_scaler.GradScaler._unscale_grads_",
    "torch.amp.grad_scaler.OptState.READY",
    "torch.amp.grad_scaler.OptState.UNSCALED",
    "torch.amp.grad_scaler.OptState.STEPPED",
    "torch.amp.grad_scaler._refresh_per_optimizer_state",
    "torch._foreach_norm",
    "torch._foreach_mul_",
    "torch._amp_update_scale_",
    "torch._amp_foreach_non_finite_check_and_unscale_",
    "torch._C._set_grad_enabled",
    "torch.Tensor._version",
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.utils._pytree.tree_flatten",
    "torch.utils._pytree.tree_map",
)

#: Attributes GradScaler's ``__init__`` sets that LossScaler reads or writes, and the keys of the
#: per-optimizer state it fills in.
SCALER_STATE: tuple[str, ...] = (
    "_enabled",
    "_device",
    "_scale",
    "_init_scale",
    "_growth_factor",
    "_backoff_factor",
    "_growth_interval",
    "_per_optimizer_states",
)
OPTIMIZER_STATE_KEYS = ("stage", "found_inf_per_device")


def _resolve(dotted: str) -> bool:
    """Whether ``dotted`` names something: its longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def missing_member() -> str | None:
    """The first member of torch autoscale relies on that this torch lacks, or None."""
    for dotted in REQUIRED:
        if not _resolve(dotted):
            return dotted
    from torch.amp import grad_scaler

    scaler = grad_scaler.GradScaler("cpu")  # sets its attributes only; no tensor yet
    for name in SCALER_STATE:
        if not hasattr(scaler, name):
            return f"torch.amp.GradScaler().{name}"
    state = grad_scaler._refresh_per_optimizer_state()
    for key in OPTIMIZER_STATE_KEYS:
        if key not in state:
            return f"torch.amp.grad_scaler._refresh_per_optimizer_state()['{key}']"
    return None


def _under_the_cli() -> bool:
    """Whether this process is the ``autoscale`` command (its script or ``python -m autoscale``)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return os.path.basename(sys.argv[0]) == "autoscale" or argv[1:3] == ["-m", "autoscale"]


def check_torch() -> None:
    """Raise :class:`~autoscale.errors.TorchVersionError` if this torch lacks a member autoscale
    relies on; under the ``autoscale`` command, print that one line and exit with 2 instead (the
    package's import runs before the CLI's own error handling could)."""
    member = missing_member()
    if member is None:
        return
    error = TorchVersionError(
        f"torch {torch.__version__} has no {member}, which autoscale's scaler relies on; "
        f"install a torch that autoscale is tested on: pip install 'torch{TORCH_RANGE}'"
    )
    if _under_the_cli():
        print(f"autoscale: error: {error}", file=sys.stderr)
        raise SystemExit(2)
    raise error
