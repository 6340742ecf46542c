"""autoscale: learned loss-scale policies for fp16 mixed-precision training.

``autoscale.get_scaler("NAME")`` returns a drop-in replacement for ``torch.amp.GradScaler``.
Importing autoscale loads torch and PyYAML only; the learning parts (Gymnasium, SB3, Optuna) load
when their subpackages are imported.
"""

import time as _time

#: ``time.monotonic()`` when autoscale was first imported: budgets count from here, so imports
#: (torch and the rest) are paid from them. Not the process's start: under ``bash -c 'a && autoscale'``
#: the shell execs autoscale in its own process, whose start would include ``a``.
IMPORT_TIME = _time.monotonic()

from autoscale.errors import AutoscaleError  # noqa: E402
from autoscale.scalers import (  # noqa: E402
    LossScaler,
    ScaleRule,
    StepStats,
    list_scalers,
    register_loss_scaler,
)
from autoscale.scalers import catalog as _catalog  # noqa: E402


def get_scaler(
    name: str,
    device: str | None = None,
    *,
    record: str | None = None,
    log: str | list[str] | None = None,
    **overrides,
) -> LossScaler:
    """Build the scaler registered (or exported) as ``name``: a drop-in ``torch.amp.GradScaler``.

    As :func:`autoscale.scalers.make_scaler` (which builds it), plus:

    Args:
        record: A folder to record every step to (``autoscale report`` reads it; see
            :func:`autoscale.observe.watch_scaler`).
        log: Live logs: ``csv:FILE``, ``tensorboard:DIR`` or ``wandb:PROJECT`` (or a list).

    Example::

        scaler = autoscale.get_scaler("auto", record="runs/x")
    """
    scaler = _catalog.make_scaler(name, device, **overrides)
    if record is not None or log:
        from autoscale.observe import watch_scaler

        watch_scaler(scaler, record=record, log=log)
    return scaler


__version__ = "0.1.0"

__all__ = [
    "AutoscaleError",
    "LossScaler",
    "ScaleRule",
    "StepStats",
    "get_scaler",
    "list_scalers",
    "register_loss_scaler",
    "__version__",
]
