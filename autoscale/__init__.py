"""autoscale: learned loss-scale policies for fp16 mixed-precision training.

``autoscale.get_scaler("NAME")`` returns a drop-in replacement for ``torch.amp.GradScaler``.
Importing autoscale loads torch and PyYAML only; the learning parts (Gymnasium, SB3, Optuna) load
when their subpackages are imported.
"""

from autoscale.errors import AutoscaleError
from autoscale.scalers import LossScaler, StepStats, get_scaler, list_scalers, register_loss_scaler

__version__ = "0.1.0"

__all__ = [
    "AutoscaleError",
    "LossScaler",
    "StepStats",
    "get_scaler",
    "list_scalers",
    "register_loss_scaler",
    "__version__",
]
