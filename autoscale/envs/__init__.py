"""Gymnasium environments over real mixed-precision training steps, and their trace replay.

Importing this module registers ``autoscale/LossScale-v0`` and ``autoscale/LossScaleReplay-v0``::

    env = gymnasium.make("autoscale.envs:autoscale/LossScale-v0", spec="envs/gpt2-tiny.yaml")

The specs and traces need no Gymnasium, so ``autoscale report`` reads a record in the base install;
the environments (``LossScaleEnv``, ``ReplayEnv``, ``ScaleEnvBase``) load on first use and need the
'search' extra.
"""

import importlib
from typing import Any

from autoscale.envs.spec import (
    EnvSpec,
    EpisodeSpec,
    InstanceSpec,
    RewardWeights,
    find_env_spec,
    load_env_spec,
)
from autoscale.envs.traces import Trace, record_trace

__all__ = [
    "EnvSpec",
    "EpisodeSpec",
    "InstanceSpec",
    "LossScaleEnv",
    "ReplayEnv",
    "RewardWeights",
    "ScaleEnvBase",
    "Trace",
    "find_env_spec",
    "load_env_spec",
    "record_trace",
    "step_reward",
]

# the names that import Gymnasium, by the module that defines them
_ENVS = {
    "ScaleEnvBase": "autoscale.envs.base",
    "step_reward": "autoscale.envs.base",
    "LossScaleEnv": "autoscale.envs.loss_scale_env",
    "ReplayEnv": "autoscale.envs.replay_env",
}


def __getattr__(name: str) -> Any:
    if name in _ENVS:
        return getattr(importlib.import_module(_ENVS[name]), name)
    raise AttributeError(f"module 'autoscale.envs' has no attribute '{name}'")


try:
    from gymnasium.envs.registration import register, registry
except ModuleNotFoundError:  # the base install: no Gymnasium, nothing to register with
    pass
else:
    for _id, _entry in (
        ("autoscale/LossScale-v0", "autoscale.envs.loss_scale_env:LossScaleEnv"),
        ("autoscale/LossScaleReplay-v0", "autoscale.envs.replay_env:ReplayEnv"),
    ):
        if _id not in registry:
            register(id=_id, entry_point=_entry, nondeterministic=True)
