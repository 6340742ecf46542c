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
    get_scaler,
    list_scalers,
    register_loss_scaler,
)

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
